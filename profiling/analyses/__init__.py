"""The analyses of an attribution: critical path, what-if, diff, findings, coverage, top kernels, traffic,
pipeline bubbles, idle tables, rank summaries."""
