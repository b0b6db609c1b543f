"""``shardline convert``: a shardline checkpoint out of the training layout, in this one process.

    shardline convert CHECKPOINT OUT --to hf [--dtype bfloat16] [--max-shard-size 2GiB] [--model-index 0]
    shardline convert CHECKPOINT OUT --to state_dict [--dtype bfloat16] [--optimizer]
    shardline convert CHECKPOINT OUT --migrate --trust

``--migrate`` rewrites a checkpoint of format version 1 or 2 (its state files were ``torch.save`` pickles) as one
of today's format, which holds no pickle; it unpickles the old files, so it runs only with ``--trust``
(:func:`~shardline.plugins.checkpoint.convert.migrate`).

``CHECKPOINT`` is a checkpoint folder (what ``trainer.save_checkpoint`` or the checkpoint callback wrote under
:class:`~shardline.plugins.lightning.strategy.HybridParallelStrategy`) or a folder of them (its ``latest``, else
its newest complete one). ``--to hf`` writes a Hugging Face model folder, ``--to state_dict`` one consolidated
Lightning checkpoint file of the dense model; see :mod:`shardline.plugins.checkpoint.convert` for both formats.
No process group, no DeepSpeed, no GPU: the weights stream from the checkpoint's files.

``--max-shard-size`` reads sizes as Hugging Face does: bytes, or a number with ``KB``/``MB``/``GB`` (powers of
1000) or ``KiB``/``MiB``/``GiB`` (powers of 1024). Bad input (not a checkpoint, a missing or misshapen tensor, an
existing output, a bad dtype or size) prints one line ``shardline convert: error: ...`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import enum
import re
import sys

DTYPE_NAMES = ("bfloat16", "float16", "float32")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class Target(enum.Enum):
    HF = "hf"
    STATE_DICT = "state_dict"


class ConvertError(ValueError):
    """A command-line value ``shardline convert`` cannot use (the message names it)."""


def add_commands(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert", help="a checkpoint to a Hugging Face folder or one consolidated state dict (one process)",
        description="Convert a shardline checkpoint, in one process and without the training layout, to a "
                    "Hugging Face model folder or to a single consolidated PyTorch (Lightning) state dict.")
    parser.add_argument("checkpoint", help="a checkpoint folder, or a folder of them (its latest)")
    parser.add_argument("out", help="the folder (--to hf) or file (--to state_dict) to write; must not exist")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--to", choices=[t.value for t in Target], help="the output format")
    what.add_argument("--migrate", action="store_true",
                      help="rewrite an old (format version 1-2) checkpoint, whose state files are pickles, as one of "
                           "today's format (no pickle); needs --trust")
    parser.add_argument("--trust", action="store_true",
                        help="--migrate: unpickle the old checkpoint's state files. Unpickling runs any code their "
                             "author put in them: only for a checkpoint you or someone you trust wrote")
    parser.add_argument("--dtype", default=None, metavar="|".join(DTYPE_NAMES),
                        help="cast every weight to this dtype (default: as saved, float32 master weights)")
    parser.add_argument("--max-shard-size", default="2GiB", metavar="SIZE",
                        help="--to hf: largest safetensors file (default 2GiB; e.g. 500MB, 5GB)")
    parser.add_argument("--model-index", type=int, default=0,
                        help="--to hf: which decoder model of the module, when it holds several (default 0)")
    parser.add_argument("--optimizer", action="store_true",
                        help="--to state_dict: also the optimizer's moments (exp_avg, exp_avg_sq) per parameter")
    parser.set_defaults(func=_command)


def parse_size(text: str) -> int:
    """Bytes of ``text`` (``"2GiB"``, ``"500MB"``, ``"123"``); ConvertError naming it otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or int(float(match.group(1)) * _UNITS[unit]) < 1:
        raise ConvertError(f"--max-shard-size {text!r}: not a size (bytes, or a number with KB, MB, GB (powers of "
                           "1000) or KiB, MiB, GiB (powers of 1024)), at least 1 byte")
    return int(float(match.group(1)) * _UNITS[unit])


def _command(args: argparse.Namespace) -> int:
    from shardline.plugins.errors import ShardlineError

    try:
        done = run_convert(args)
    except (ConvertError, ShardlineError, OSError) as error:
        text = " ".join(str(error).split())  # one line, whatever the message
        print(f"shardline convert: error: {text}", file=sys.stderr)
        return 2
    print(f"shardline convert: wrote {done.out} ({done.tensors} tensors, {done.nbytes / 1e6:.1f} MB) from "
          f"{done.checkpoint}")
    return 0


def run_convert(args: argparse.Namespace):
    """The conversion ``args`` ask for; returns :class:`~shardline.plugins.checkpoint.convert.Converted`."""
    if getattr(args, "migrate", False):
        from shardline.plugins.checkpoint import convert

        if not args.trust:
            raise ConvertError(f"--migrate without --trust: migrating unpickles the old checkpoint's state files, "
                               f"and {convert.TRUST}")
        return convert.migrate(args.checkpoint, args.out, trust=True)
    if args.trust:
        raise ConvertError("--trust goes with --migrate (nothing else unpickles anything)")
    target = Target(args.to)
    if args.dtype is not None and args.dtype not in DTYPE_NAMES:
        raise ConvertError(f"--dtype {args.dtype!r}: one of {', '.join(DTYPE_NAMES)}")
    if target is Target.HF and args.optimizer:
        raise ConvertError("--optimizer: a Hugging Face folder holds no optimizer state (use --to state_dict)")
    limit = parse_size(args.max_shard_size)
    from shardline.plugins.checkpoint import convert  # torch: only once the command runs

    if target is Target.HF:
        return convert.to_hf(args.checkpoint, args.out, dtype=args.dtype, max_shard_bytes=limit,
                             model_index=args.model_index)
    return convert.to_state_dict(args.checkpoint, args.out, dtype=args.dtype, optimizer=args.optimizer)
