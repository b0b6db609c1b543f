"""Models built from shardline's layers: ``gpt`` (GPT-2 style: LayerNorm, GELU, learned positions)."""
