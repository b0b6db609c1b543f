"""Pipeline schedules as data (pure Python): the action IR (:mod:`.actions`), the generators
(:mod:`.schedule`), validation and simulation (:mod:`.simulate`) and drawings (:mod:`.render`). The training
engine (``shardline.plugins.pipeline``) executes exactly what :func:`.simulate.validate` proved; the profiler's
what-ifs and the planner simulate the same values."""
