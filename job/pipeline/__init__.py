"""Pipeline schedules as data (pure Python): the action IR (:mod:`.actions`), the generators
(:mod:`.schedule`), validation and simulation (:mod:`.simulate`), drawings (:mod:`.render`) and the bubble
closed forms per schedule (:mod:`.theory`, exported here). The training engine (``shardline.plugins.pipeline``)
executes exactly what :func:`.simulate.validate` proved; the profiler's what-ifs and the planner simulate the
same values."""

from .theory import bubble_fraction, bubble_time, closed_form_schedules, has_closed_form, makespan

__all__ = ["bubble_fraction", "bubble_time", "closed_form_schedules", "has_closed_form", "makespan"]
