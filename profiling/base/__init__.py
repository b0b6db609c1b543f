"""The floor below everything of the profiler: its errors, the events table's schema, interval sets."""
