"""Writes the packaged recipes per model size, ``recipes/sizes/<model>.yaml``: for each packaged model the layout
``shardline plan`` picks on the stated cluster, emitted by :mod:`shardline.recipes.planning.emit`.

    python -m shardline.recipes.sizes.generate                  # plan every size and (re)write its file
    python -m shardline.recipes.sizes.generate llama3-8b        # only these
    python -m shardline.recipes.sizes.generate --check          # plan again; exit 1 naming the stale files

Each size states its cluster, GPU count, sequence length and global batch, and the training hyperparameters of
its public training setup where there is one (``SIZES``; ``source`` says where each number comes from):

- GPT-2 (Radford et al. 2019, §2.3): context 1024, batch 512 sequences (0.5M tokens). Its learning rates and
  token budget are not published: the GPT-3 paper's (Brown et al. 2020, Table 2.1) for the nearest size.
- GPT-3 (Brown et al. 2020, Table 2.1 and Appendix B): context 2048, batch 0.5M-3.2M tokens, learning rate per
  size, warm-up over 375M tokens, 300B tokens, weight decay 0.1, gradient clipping 1.0; on A100 nodes.
- Llama 2 (Touvron et al. 2023, §2.2): context 4096, 4M-token batches, lr 3e-4 (7B, 13B) and 1.5e-4 (70B),
  2000 warm-up steps, weight decay 0.1, clipping 1.0, 2T tokens; A100 80GB (Meta's Research Super Cluster).
- Llama 3 (Llama Team 2024, "The Llama 3 Herd of Models", §3.4.1): 405B at context 8192 with 16M-token batches
  (the last stage of its batch schedule), lr 8e-5, 8000 warm-up steps, 15.6T tokens. The paper gives no batch or
  learning rate for 8B and 70B: Llama 2's 4M tokens and learning rates are assumed. RoPE theta 500000.

The suite's check (tests/recipes/planning/test_recipes_sizes.py) re-prices each file's own layout (:func:`render`
with ``layout``), which is instant and catches a changed estimator, step-time model or emitter. ``--check``
repeats the whole search for every size (about a minute in all on the 2-core CI machine); ``.ci/run`` runs it
after the suite, so a recipe the planner would no longer pick fails CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SIZES_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Size:
    """One packaged recipe's request: ``model`` on ``gpus`` GPUs of the catalog's ``cluster``, ``global_batch``
    sequences of ``seq_len`` tokens per optimizer step, and the public ``training`` hyperparameters."""

    model: str
    cluster: str
    gpus: int
    seq_len: int
    global_batch: int
    source: str
    training: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return SIZES_DIR / f"{self.model}.yaml"


def _tokens_steps(tokens: float, batch: int, seq: int) -> int:
    return round(tokens / (batch * seq))


def _gpt(name, cluster, gpus, *, seq, batch, lr, tokens=300e9, source):
    # GPT-3 Appendix B: linear warm-up over the first 375M tokens, 300B tokens, weight decay 0.1, clip 1.0.
    return Size(name, cluster, gpus, seq, batch, source,
                {"lr": lr, "warmup_steps": _tokens_steps(375e6, batch, seq), "weight_decay": 0.1,
                 "max_steps": _tokens_steps(tokens, batch, seq)})


def _llama(name, cluster, gpus, *, seq, batch, lr, warmup, tokens, rope_theta, source):
    return Size(name, cluster, gpus, seq, batch, source,
                {"lr": lr, "warmup_steps": warmup, "weight_decay": 0.1, "rope_theta": rope_theta,
                 "rms_norm_eps": 1e-5, "max_steps": _tokens_steps(tokens, batch, seq)})


_GPT2 = ("GPT-2 (Radford et al. 2019): context 1024, batch 512; lr, warm-up and 300B tokens from GPT-3 "
         "Table 2.1 / Appendix B ({size})")
_GPT3 = ("GPT-3 (Brown et al. 2020) Table 2.1: {tokens} tokens per batch, lr {lr}; Appendix B: 375M-token warm-up, "
         "300B tokens")
_LLAMA2 = "Llama 2 (Touvron et al. 2023) §2.2: 4M-token batches, lr {lr}, 2000 warm-up steps, 2T tokens"
_LLAMA3 = ("Llama 3 (Llama Team 2024) §3.4.1 gives 405B's setup only; assumed here: Llama 2's 4M-token batches "
           "and lr {lr}, 15T tokens (the model card)")

SIZES: dict[str, Size] = {s.model: s for s in (
    _gpt("gpt2-125m", "dgx-a100-40gb", 8, seq=1024, batch=512, lr=6e-4, source=_GPT2.format(size="GPT-3 Small")),
    _gpt("gpt2-350m", "dgx-a100-40gb", 8, seq=1024, batch=512, lr=3e-4, source=_GPT2.format(size="GPT-3 Medium")),
    _gpt("gpt2-760m", "dgx-a100-80gb", 8, seq=1024, batch=512, lr=2.5e-4, source=_GPT2.format(size="GPT-3 Large")),
    _gpt("gpt2-1.5b", "dgx-a100-80gb", 16, seq=1024, batch=512, lr=2e-4, source=_GPT2.format(size="GPT-3 XL")),
    _gpt("gpt3-2.7b", "dgx-a100-80gb", 16, seq=2048, batch=512, lr=1.6e-4,
         source=_GPT3.format(tokens="1M", lr="1.6e-4")),
    _gpt("gpt3-6.7b", "dgx-a100-80gb", 32, seq=2048, batch=1024, lr=1.2e-4,
         source=_GPT3.format(tokens="2M", lr="1.2e-4")),
    _gpt("gpt3-13b", "dgx-a100-80gb", 64, seq=2048, batch=1024, lr=1.0e-4,
         source=_GPT3.format(tokens="2M", lr="1.0e-4")),
    _gpt("gpt3-175b", "dgx-a100-80gb", 1024, seq=2048, batch=1536, lr=0.6e-4,
         source=_GPT3.format(tokens="3.2M", lr="0.6e-4") + "; 1024 A100s as in Narayanan et al. 2021 §5.1"),
    _llama("llama2-7b", "dgx-a100-80gb", 32, seq=4096, batch=1024, lr=3e-4, warmup=2000, tokens=2e12,
           rope_theta=10000.0, source=_LLAMA2.format(lr="3e-4")),
    _llama("llama2-13b", "dgx-a100-80gb", 64, seq=4096, batch=1024, lr=3e-4, warmup=2000, tokens=2e12,
           rope_theta=10000.0, source=_LLAMA2.format(lr="3e-4")),
    _llama("llama2-70b", "dgx-a100-80gb", 256, seq=4096, batch=1024, lr=1.5e-4, warmup=2000, tokens=2e12,
           rope_theta=10000.0, source=_LLAMA2.format(lr="1.5e-4")),
    _llama("llama3-8b", "dgx-h100", 8, seq=8192, batch=512, lr=3e-4, warmup=2000, tokens=15e12,
           rope_theta=500000.0, source=_LLAMA3.format(lr="3e-4")),
    _llama("llama3-70b", "dgx-h100", 64, seq=8192, batch=512, lr=1.5e-4, warmup=2000, tokens=15e12,
           rope_theta=500000.0, source=_LLAMA3.format(lr="1.5e-4")),
    _llama("llama3-405b", "dgx-h100", 512, seq=8192, batch=2048, lr=8e-5, warmup=8000, tokens=15.6e12,
           rope_theta=500000.0,
           source="Llama 3 (Llama Team 2024) §3.4.1: 16M-token batches (the last stage of its schedule), lr 8e-5, "
                  "8000 warm-up steps, 15.6T tokens"),
)}


def command(size: Size) -> str:
    """The ``shardline plan`` command line that plans ``size`` (the layout and the comment block's numbers; the
    training fields come from ``SIZES``) and writes its file."""
    return (f"shardline plan --model {size.model} --cluster {size.cluster} --gpus {size.gpus} --seq {size.seq_len} "
            f"--global-batch {size.global_batch} --emit recipes/sizes/{size.model}.yaml")


def plan_row(size: Size, *, layout: dict[str, Any] | None = None):
    """``(ModelSpec, Cluster, the plan's pick)`` for ``size``; ``layout`` fixes the layout (all of
    PlanLayout's fields: the row is priced, not searched)."""
    from shardline.recipes.planning.catalog import load_catalog
    from shardline.recipes.planning.models import packaged
    from shardline.recipes.planning.search import plan

    model, cluster = packaged(size.model), load_catalog().cluster(size.cluster)
    result = plan(model, cluster, gpus=size.gpus, seq_len=size.seq_len, global_batch=size.global_batch,
                  layout=layout)
    return model, cluster, result.pick


def render(size: Size, *, layout: dict[str, Any] | None = None) -> str:
    """The file text of ``size``: planned (or, with ``layout``, that layout priced) and emitted."""
    from shardline.recipes.planning import emit

    model, cluster, row = plan_row(size, layout=layout)
    return emit.recipe_yaml(model, row, cluster, gpus=size.gpus, seq_len=size.seq_len,
                            global_batch=size.global_batch, command=command(size), training=size.training,
                            notes=[f"(The command plans the layout and these numbers; lr, warm-up, weight decay and "
                                   f"max_steps are from the public setup.) Setup: {size.source}."])


def recorded_layout(text: str) -> dict[str, Any]:
    """The PlanLayout fields (a dict for ``plan(layout=...)``) of a written recipe."""
    import yaml

    from shardline.recipes.planning.emit import layout_of

    return dataclasses.asdict(layout_of(yaml.safe_load(text)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardline.recipes.sizes.generate", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help=f"sizes to plan (default: all of {', '.join(SIZES)})")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; sizes: {', '.join(SIZES)}")
    stale = []
    for name in args.models or SIZES:
        size = SIZES[name]
        text = render(size)
        if args.check:
            current = size.path.is_file() and size.path.read_text() == text
            if not current:
                stale.append(str(size.path))
            print(f"{name}: {'up to date' if current else 'stale'}", flush=True)
        else:
            size.path.write_text(text)
            print(f"{name}: wrote {size.path}", flush=True)
    if stale:
        print(f"stale: {', '.join(stale)} (run python -m shardline.recipes.sizes.generate)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
