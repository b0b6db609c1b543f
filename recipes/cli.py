"""The ``shardline`` command. Each subcommand lives with its package and registers itself here.

Start-up stays cheap: a provider module is imported only to build its parser, and heavy imports (torch,
Lightning, DeepSpeed) happen inside the subcommand that needs them, so ``shardline profile`` runs without torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

# (module, function): function(subparsers) adds one or more subcommands, each setting ``func(args) -> int``.
PROVIDERS: tuple[tuple[str, str], ...] = (
    ("shardline.profiling.present.cli", "add_commands"),
    ("shardline.recipes.fit", "add_commands"),
    ("shardline.recipes.convert", "add_commands"),
    ("shardline.recipes.planning.cli", "add_commands"),
)


def package_version() -> str:
    try:
        return version("shardline")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardline",
        description="Train transformers with DeepSpeed ZeRO x tensor/sequence x pipeline parallelism under "
                    "PyTorch Lightning, and see where every step's time went.")
    parser.add_argument("--version", action="version", version=f"shardline {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module, function in PROVIDERS:
        getattr(importlib.import_module(module), function)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0 if args.command is None else 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
