"""``GPTModule``: :class:`~shardline.recipes.lit_lm.LanguageModule` fixed to the GPT-2 architecture, with the model
under ``self.gpt`` (the reference GPT that the parity tests and benches train)."""

from __future__ import annotations

from shardline.recipes.lit_lm import LanguageModule


class GPTModule(LanguageModule):
    """A GPT language model: ``batch = (ids [b, S], targets [b, S])``, AdamW with linear warm-up."""

    MODEL_ATTRIBUTE = "gpt"

    def __init__(self, vocab_size: int = 256, seq_len: int = 128, n_layer: int = 4, n_head: int = 4,
                 d_model: int = 128, d_ff: int | None = None, dropout: float = 0.0, tie_embeddings: bool = True,
                 lr: float = 3e-3, weight_decay: float = 0.01, warmup_steps: int = 10, seed: int = 0,
                 optimizer: str = "adamw"):
        super().__init__(architecture="gpt2", vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer,
                         n_head=n_head, d_model=d_model, d_ff=d_ff, dropout=dropout, tie_embeddings=tie_embeddings,
                         lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps, seed=seed, optimizer=optimizer)
