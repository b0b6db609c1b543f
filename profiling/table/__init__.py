"""The events table of a trace set: ``load`` (readers -> one table), classification (``kinds``, ``names``,
``dims``, ``linking``, ``classify``), the partition's labels, and the per-rank survey (``survey``, ``rows``)."""
