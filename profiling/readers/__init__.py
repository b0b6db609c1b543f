"""Readers: one module per input format, each turning a file into rows of the events table."""
