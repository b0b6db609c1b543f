"""Pipeline parallelism: schedules as data, partitioning into stages, and the engine that runs them."""
