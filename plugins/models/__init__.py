"""Models built from shardline's layers on one decoder skeleton (``decoder``): ``gpt`` (GPT-2 style: LayerNorm,
GELU, learned positions) and ``llama`` (the Llama family: RMSNorm, SwiGLU, rotary positions with Llama-3 scaling,
grouped-query attention, optional Qwen2 q/k/v bias)."""
