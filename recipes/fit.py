"""``shardline fit``: the main job. LightningCLI over LanguageModule, TextDataModule and the strategy, from a recipe.

    shardline fit --config recipes/tiny.yaml                      # or: --config tiny (a packaged recipe)
    shardline fit --config tiny --trainer.max_steps 20 --model.n_layer 2 --trainer.strategy.init_args.tp 1
    python -m shardline.recipes.cli fit --config tiny            # the same

Everything after ``fit`` belongs to LightningCLI (``shardline fit --help`` is LightningCLI's help), so every
recipe field is overridden the usual LightningCLI way. Validation (see :mod:`shardline.recipes.schema`): each
``--config`` file is checked as written before LightningCLI sees it, then the parsed configuration (file plus
overrides) is checked again before anything is instantiated; jsonargparse's own parse errors (a bad override
type, an unknown flag) are re-raised as :class:`RecipeError` too. The command prints a RecipeError as one line
and exits with status 2.

Workers: with ``accelerator=cpu, devices=N`` Lightning starts ranks 1..N-1 by running this process's command
line again (``sys.argv``, via ``python -m <module>`` or the script path) with ``LOCAL_RANK`` set. That is the
``shardline`` console script or ``python -m shardline.recipes.cli`` with the same arguments, so each worker
parses and validates the same recipe. Calling :func:`run_fit` in-process with arguments that are not
``sys.argv`` therefore cannot launch workers; it is refused before training starts when it would have to.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardline.recipes.schema import RecipeError, check_recipe, load_recipe

RECIPES_DIR = Path(__file__).resolve().parent
HELP_FLAGS = frozenset({"-h", "--help", "--print_config", "--print-config"})


def add_commands(subparsers) -> None:
    parser = subparsers.add_parser(
        # No option of its own: with a prefix character no argument can start with (NUL cannot occur in argv),
        # argparse hands every argument, --help included, to the REMAINDER positional untouched.
        "fit", add_help=False, prefix_chars="\x00",
        help="train a GPT-2 or Llama model from a recipe (LightningCLI; try: shardline fit --config tiny)",
        description="LightningCLI fit over shardline's language models (GPT-2, Llama family; random or from a "
                    "Hugging Face checkpoint), text data and HybridParallelStrategy.")
    parser.add_argument("lightning_args", nargs=argparse.REMAINDER,
                        help="LightningCLI arguments: --config RECIPE and any --section.field VALUE override")
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    try:
        run_fit(args.lightning_args)
    except RecipeError as error:
        print(f"shardline fit: error: {error}", file=sys.stderr)
        return 2
    return 0


def resolve_recipe(name: str) -> str:
    """A recipe path as given when it exists, else the packaged recipe of that name (``tiny`` or ``tiny.yaml``);
    RecipeError listing the packaged ones otherwise."""
    if Path(name).exists():
        return name
    packaged = RECIPES_DIR / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if packaged.is_file() and Path(name).name == name:
        return str(packaged)
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    raise RecipeError(f"recipe {name}: no such file, and not a packaged recipe (packaged: {names})")


def resolve_config_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` with every ``--config``/``-c`` value resolved by :func:`resolve_recipe`, and those paths."""
    out, paths, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config", "-c") and i + 1 < len(argv):
            path = resolve_recipe(argv[i + 1])
            out += [arg, path]
            paths.append(path)
            i += 2
            continue
        if arg.startswith("--config="):
            path = resolve_recipe(arg.split("=", 1)[1])
            out.append(f"--config={path}")
            paths.append(path)
        else:
            out.append(arg)
        i += 1
    return out, paths


def run_fit(argv: list[str], *, run: bool = True):
    """Validate the recipe(s) in ``argv`` (LightningCLI ``fit`` arguments), then build the CLI and, with
    ``run``, train. Returns the LightningCLI object (with ``run=False``: parsed and instantiated, not fitted)."""
    typed = list(argv)
    argv, paths = resolve_config_args(typed)
    if not paths and not HELP_FLAGS & set(typed):
        names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
        raise RecipeError(f"no recipe: shardline fit needs --config RECIPE (a YAML file, or a packaged recipe: "
                          f"{names}); --help lists every field")
    for path in paths:
        load_recipe(path)
    source = " + ".join(paths) if paths else "(no --config)"
    cli_class = _fit_cli_class()
    if run:
        return cli_class(typed=typed, source=source, args=["fit", *argv])
    return cli_class(typed=typed, source=source, args=argv, run=False)


def _fit_cli_class():
    """FitCLI, defined on first use so that ``shardline --help`` never imports Lightning."""
    global _FIT_CLI
    if _FIT_CLI is None:
        _FIT_CLI = _define_fit_cli()
    return _FIT_CLI


_FIT_CLI = None


def _define_fit_cli():
    from jsonargparse import ArgumentError
    from pytorch_lightning.cli import LightningCLI
    from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    import shardline.plugins  # noqa: F401 - registers the strategy names (shardline_tp2_zero1, ...)
    from shardline.recipes.data import TextDataModule
    from shardline.recipes.lit_lm import LanguageModule

    class FitCLI(LightningCLI):
        """LightningCLI with recipe validation; ``typed`` is what the user typed after ``fit``."""

        def __init__(self, *, typed: list[str], source: str, **kwargs):
            self.user_argv, self.source = typed, source
            kwargs.setdefault("parser_kwargs", {"exit_on_error": False, "fit": {"exit_on_error": False}})
            super().__init__(LanguageModule, TextDataModule, save_config_kwargs={"overwrite": True},
                             auto_configure_optimizers=False, **kwargs)

        def add_arguments_to_parser(self, parser) -> None:
            parser.link_arguments("model.seq_len", "data.seq_len")
            # a checkpoint's tokenizer (tokenizer.json beside config.json), when it has one
            parser.link_arguments("model.init_from", "data.tokenizer")

        def parse_arguments(self, parser, args) -> None:
            # LightningCLI warns when both ``args`` and sys.argv are set; here they are the same command line.
            try:
                self.config = parser.parse_args(args)
            except ArgumentError as error:
                raise RecipeError(f"recipe {self.source} with overrides {self.user_argv}: {error}") from None

        def before_instantiate_classes(self) -> None:
            config = self.config.get(self.subcommand) if self.subcommand else self.config
            check_recipe(config.as_dict(), source=f"{self.source} with overrides {self.user_argv}")

        def before_fit(self) -> None:
            launcher = self.trainer.strategy.launcher
            relaunches = (isinstance(launcher, _SubprocessScriptLauncher)
                          and not launcher.cluster_environment.creates_processes_externally
                          and launcher.num_processes * launcher.num_nodes > 1)
            if relaunches and sys.argv[1:] != ["fit", *self.user_argv]:
                raise RecipeError(
                    f"recipe {self.source}: Lightning starts the other {launcher.num_processes - 1} workers by "
                    f"re-running this command line, sys.argv={sys.argv}, which is not 'fit' with these arguments; "
                    "run it as `shardline fit ...` or `python -m shardline.recipes.cli fit ...`")

    return FitCLI
