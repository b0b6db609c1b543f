"""``shardline fit``: the main job. LightningCLI over LanguageModule, TextDataModule and the strategy, from a recipe.

    shardline fit --config recipes/tiny.yaml                      # or: --config tiny (a packaged recipe)
    shardline fit --config tiny --trainer.max_steps 20 --model.n_layer 2 --trainer.strategy.init_args.tp 1
    python -m shardline.recipes.cli fit --config tiny            # the same

Everything after ``fit`` belongs to LightningCLI (``shardline fit --help`` is LightningCLI's help), so every
recipe field is overridden the usual LightningCLI way. Validation (see :mod:`shardline.recipes.schema`): each
``--config`` file is checked as written before LightningCLI sees it, then the parsed configuration (file plus
overrides) is checked again before anything is instantiated; jsonargparse's own parse errors (a bad override
type, an unknown flag) are re-raised as :class:`RecipeError` too, and so is an error raised while LightningCLI
builds the objects (jsonargparse would wrap it in a 60-line message quoting every value). The command prints a
RecipeError as one bounded line and exits with status 2, before any worker starts; an error after launch exits with
status 1 and is printed once for all ranks (:func:`report_failure`): shardline's own (a non-finite loss, a dead rank)
as its message, without a traceback, with every rank's traceback in a file whose path is printed. The
configuration about to be launched is also held against this machine's memory (``check_recipe(machine=True)``).

Workers: with ``accelerator=cpu, devices=N`` Lightning starts ranks 1..N-1 by running this process's command
line again (``sys.argv``, via ``python -m <module>`` or the script path) with ``LOCAL_RANK`` set. That is the
``shardline`` console script or ``python -m shardline.recipes.cli`` with the same arguments, so each worker
parses and validates the same recipe. Calling :func:`run_fit` in-process with arguments that are not
``sys.argv`` therefore cannot launch workers; it is refused before training starts when it would have to.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from shardline.recipes.schema import (
    RecipeError,
    as_int,
    check_recipe,
    clip,
    load_recipe,
    read_recipe_file,
    short_repr,
    strategy_arguments,
    strategy_layout,
    with_defaults,
)

RECIPES_DIR = Path(__file__).resolve().parent
RUN_CHECKPOINT = "shardline.plugins.lightning.callbacks.RunCheckpoint"
HELP_FLAGS = frozenset({"-h", "--help", "--print_config", "--print-config"})
#: The longest error line the command prints (a recipe error lists at most 20 problems of at most 400 characters).
MAX_ERROR_CHARS = 10_000


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
    """Status 2 and one line for a bad recipe or override (before anything is launched); status 1 for an error
    after launch, told by :func:`report_failure`."""
    try:
        run_fit(args.lightning_args)
    except RecipeError as error:
        print(f"shardline fit: error: {clip(error, MAX_ERROR_CHARS)}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - every failure is told once, below
        return report_failure(error)
    return 0


def report_failure(error: BaseException) -> int:
    """An error that stopped the run, told once for all ranks: the rank the ranks agreed on (the strategy's
    :class:`~shardline.plugins.errors.ErrorReport`: the rank whose own code raised, else the lowest one still
    alive) prints it, shardline's own errors as their message without a traceback, any other with its
    traceback; every rank writes its full traceback to ``<log dir>/rank<N>-error.txt`` and the speaker says
    where. An error without a report (raised before the ranks connected, or by one process) is printed by the
    process that raised it. Returns the exit status, 1."""
    from shardline.plugins.errors import ShardlineError, report_of

    ours = isinstance(error, ShardlineError)
    text = "".join(traceback.format_exception(error))
    report = report_of(error)
    written = None
    if report is not None:
        path = report.traceback_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written = path
        except OSError as exc:
            print(f"shardline fit: rank {report.rank}: cannot write {path}: {exc}", file=sys.stderr)
        if not report.speaks:
            return 1
    message = f"shardline fit: error: {type(error).__name__}: {error}" if ours else text.rstrip()
    if written is not None:
        message += f"\n(each rank's full traceback: {Path(written).parent}/rank<N>-error.txt)"
    print(message, file=sys.stderr)
    return 1


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
    argv, ckpt_every = take_ckpt_every(typed)
    argv, paths = resolve_config_args(argv)
    if not paths and not HELP_FLAGS & set(typed):
        names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
        raise RecipeError(f"no recipe: shardline fit needs --config RECIPE (a YAML file, or a packaged recipe: "
                          f"{names}); --help lists every field")
    # before anything imports DeepSpeed (the recipe checks build the strategy): read the files as written first
    quiet_start(requested_accelerator(typed, [read_recipe_file(path) or {} for path in paths]))
    for path in paths:
        load_recipe(path)
    source = " + ".join(paths) if paths else "(no --config)"
    cli_class = _fit_cli_class()
    if run:
        return cli_class(typed=typed, source=source, ckpt_every=ckpt_every, args=["fit", *argv])
    return cli_class(typed=typed, source=source, ckpt_every=ckpt_every, args=argv, run=False)


def take_ckpt_every(argv: list[str]) -> tuple[list[str], int | None]:
    """``argv`` without shardline's ``--ckpt-every N`` shortcut, and N (None when absent): save a checkpoint every
    N steps and at the end (:class:`~shardline.plugins.lightning.callbacks.RunCheckpoint`), or none with 0."""
    rest, every = [], None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--ckpt-every" or arg.startswith("--ckpt-every="):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
            i += 1 if "=" in arg else 2
            if value is None or not value.isdigit():
                raise RecipeError(f"--ckpt-every {value!r}: must be a whole number of steps (0: no checkpoints)")
            every = int(value)
            continue
        rest.append(arg)
        i += 1
    return rest, every


def apply_ckpt_every(config, every: int | None) -> None:
    """Set ``--ckpt-every``'s N on the parsed configuration's RunCheckpoint callbacks (adding one when there is
    none), or with 0 remove them, and turn Lightning's checkpointing off when no other ModelCheckpoint is left."""
    if every is None:
        return
    callbacks = list(config.trainer.callbacks or [])
    ours = [c for c in callbacks if str(getattr(c, "class_path", "")).endswith("callbacks.RunCheckpoint")]
    if every == 0:
        callbacks = [c for c in callbacks if c not in ours]
        if not any("Checkpoint" in str(getattr(c, "class_path", "")) for c in callbacks):
            config.trainer.enable_checkpointing = False
    elif ours:
        for callback in ours:
            callback.init_args.every_n_train_steps = every
    else:
        from jsonargparse import Namespace

        callbacks.append(Namespace(class_path=RUN_CHECKPOINT,
                                   init_args=Namespace(every_n_train_steps=every)))
        config.trainer.enable_checkpointing = True
    config.trainer.callbacks = callbacks


def requested_accelerator(typed: list[str], recipes: list[dict[str, Any]]) -> str | None:
    """``trainer.accelerator`` as the command line sets it (its last ``--trainer.accelerator``), else as the last
    recipe file that names it sets it; None when neither does (Lightning's default, ``auto``)."""
    value = None
    for recipe in recipes:
        trainer = recipe.get("trainer") if isinstance(recipe, dict) and isinstance(recipe.get("trainer"), dict) else {}
        value = trainer.get("accelerator", value)
    for i, arg in enumerate(typed):
        if arg == "--trainer.accelerator" and i + 1 < len(typed):
            value = typed[i + 1]
        elif arg.startswith("--trainer.accelerator="):
            value = arg.split("=", 1)[1]
    return value if isinstance(value, str) else None


def quiet_start(accelerator: str | None) -> None:
    """What ``shardline fit`` keeps off the terminal before the first step (:mod:`shardline.plugins.lightning.quiet`):
    Lightning's hosted-logger tip, the per-rank copies of Lightning's start-up lines on workers, and, for a CPU
    run, DeepSpeed's warning that it found no GPU (``DS_ACCELERATOR=cpu`` before DeepSpeed is imported, unless the
    environment names one already)."""
    from shardline.plugins.lightning.quiet import quiet_duplicate_logs, without_tips

    without_tips()
    quiet_duplicate_logs()
    if accelerator == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _fit_cli_class():
    """FitCLI, defined on first use so that ``shardline --help`` never imports Lightning."""
    global _FIT_CLI
    if _FIT_CLI is None:
        _FIT_CLI = _define_fit_cli()
    return _FIT_CLI


_FIT_CLI = None


def _define_fit_cli():
    from jsonargparse import ArgumentError
    from lightning_fabric.utilities.exceptions import MisconfigurationException
    from pytorch_lightning.cli import LightningCLI

    import shardline.plugins  # noqa: F401 - registers the strategy names (shardline_tp2_zero1, ...)
    from shardline.plugins.errors import ShardlineError
    from shardline.plugins.lightning.lightning_compat import SubprocessScriptLauncher
    from shardline.recipes.data import TextDataModule
    from shardline.recipes.lit_lm import LanguageModule

    class FitCLI(LightningCLI):
        """LightningCLI with recipe validation; ``typed`` is what the user typed after ``fit``."""

        def __init__(self, *, typed: list[str], source: str, ckpt_every: int | None = None, **kwargs):
            self.user_argv, self.source, self.ckpt_every = typed, source, ckpt_every
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
                raise RecipeError(f"recipe {self.source} with overrides {short_repr(self.user_argv)}: "
                                  f"{clip(error, 1000)}") from None

        def instantiate_classes(self) -> None:
            # The checks ran; what still fails while the objects are built is the configuration's too: one line
            # (jsonargparse wraps a constructor's error in a ValueError of 60 lines, the value printed whole).
            try:
                super().instantiate_classes()
            except (ShardlineError, ValueError, TypeError, MisconfigurationException) as error:
                raise RecipeError(f"recipe {self.source} with overrides {short_repr(self.user_argv)}: cannot be "
                                  f"built: {_constructor_reason(error)}") from None

        def before_instantiate_classes(self) -> None:
            config = self.config.get(self.subcommand) if self.subcommand else self.config
            source = f"{self.source} with overrides {short_repr(self.user_argv)}"
            apply_ckpt_every(config, self.ckpt_every)
            recipe = config.as_dict()
            check_recipe(recipe, source=source)
            problems = machine_problems(recipe)
            if problems:
                raise RecipeError(f"recipe {source}: " + "; ".join(problems))

        def before_fit(self) -> None:
            launcher = self.trainer.strategy.launcher
            relaunches = (isinstance(launcher, SubprocessScriptLauncher)
                          and not launcher.cluster_environment.creates_processes_externally
                          and launcher.num_processes * launcher.num_nodes > 1)
            if relaunches and sys.argv[1:] != ["fit", *self.user_argv]:
                raise RecipeError(
                    f"recipe {self.source}: Lightning starts the other {launcher.num_processes - 1} workers by "
                    f"re-running this command line, sys.argv={sys.argv}, which is not 'fit' with these arguments; "
                    "run it as `shardline fit ...` or `python -m shardline.recipes.cli fit ...`")

    return FitCLI


def _constructor_reason(error: BaseException) -> str:
    """The reason in a constructor's error, one line: jsonargparse's union message lists each member's error
    (``  - ...``) among the type's name and the whole value; the one that is not "Expected a <type>" is it."""
    text = str(error)
    reasons = [line.strip()[2:] for line in text.splitlines()
               if line.startswith("  - ") and not line.strip()[2:].startswith("Expected a ")]
    reason = "; ".join(reasons) if reasons else text.splitlines()[0] if text else ""
    return clip(f"{type(error).__name__}: {reason}" if not reasons else reason, 1000)


def machine_problems(recipe: dict[str, Any]) -> list[str]:
    """:func:`memory_problems` of a recipe that passed :func:`~shardline.recipes.schema.check_recipe`, on this
    machine; nothing for a strategy other than shardline's (its memory per rank is not modelled here)."""
    from shardline.recipes.lit_lm import LanguageModule, model_config

    trainer = recipe.get("trainer") or {}
    layout = strategy_layout(trainer.get("strategy"))
    devices, nodes = (as_int(trainer.get(k, 1)) for k in ("devices", "num_nodes"))
    if layout is None or not isinstance(devices, int) or not isinstance(nodes, int):
        return []
    model = with_defaults(LanguageModule, recipe.get("model"))
    _, config = model_config(model)
    return memory_problems(config, layout.for_world(devices * nodes), strategy_arguments(trainer.get("strategy")),
                           trainer=trainer, optimizer=model.get("optimizer"))


# --- this machine's memory --------------------------------------------------------------------------------------

def _bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / (1 << 20):.2f} MiB"


def available_ram() -> int | None:
    """Bytes of RAM this machine can still give (MemAvailable: free plus reclaimable cache); None if unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gpu_memory() -> int | None:
    """The smallest visible GPU's memory in bytes; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


def model_state_bytes(params: int, dims, args: dict[str, Any], *, precision: Any, optimizer: Any) -> dict[str, float]:
    """A lower bound of one rank's model states in bytes, split by where they live: ``{"device", "cpu"}`` (NVMe
    parts left out). Closed form after Rajbhandari et al. 2020 (Table 1): ``Ψ_r = Ψ/(tp*pp)`` parameters per
    rank (the mean; the most loaded rank holds at least that), ``E`` bytes each for weights and gradients (2 in
    16-bit precision, 4 in float32, 8 in float64), ``K`` for the optimizer (AdamW's two float32 moments, 8, plus
    a float32 master copy, 4, when weights are 16-bit; SGD only the master); ZeRO stage 1 divides the optimizer
    states by ``N = dp*cp``, stage 2 the gradients too, stage 3 the weights too; ``offload_optimizer='cpu'`` puts
    the optimizer states in CPU RAM, ``offload_params='cpu'`` the weights."""
    text = str(precision)
    e = 2 if "16" in text else 8 if "64" in text else 4
    k = (8 if optimizer != "sgd" else 0) + (4 if e == 2 else 0)
    per, n = params / (dims.tp * dims.pp), dims.dp * dims.cp
    stage = args.get("zero_stage", 1)
    parts = {"params": e * per / (n if stage == 3 else 1), "grads": e * per / (n if stage >= 2 else 1),
             "optimizer": k * per / (n if stage >= 1 else 1)}
    where = {"params": args.get("offload_params") or "none", "grads": "none",
             "optimizer": args.get("offload_optimizer") or "none"}
    return {"device": sum(v for key, v in parts.items() if where[key] == "none"),
            "cpu": sum(v for key, v in parts.items() if where[key] == "cpu")}


def _parameter_count(config) -> int | None:
    """The model's parameters (closed form, the planner's :class:`~shardline.recipes.planning.models.ModelSpec`)."""
    from shardline.recipes.planning.models import ModelSpec

    llama = hasattr(config, "n_kv_head")
    try:
        return ModelSpec(name="recipe", architecture="llama" if llama else "gpt2", vocab_size=config.vocab_size,
                         seq_len=config.seq_len, n_layer=config.n_layer, n_head=config.n_head,
                         d_model=config.d_model, d_ff=config.d_ff, n_kv_head=getattr(config, "n_kv_head", None),
                         head_dim=getattr(config, "head_dim", None) if llama else None,
                         tie_embeddings=bool(config.tie_embeddings),
                         qkv_bias=bool(getattr(config, "qkv_bias", False))).params()
    except RecipeError:
        return None


def memory_problems(config, dims, args: dict[str, Any], *, trainer: dict[str, Any], optimizer: Any) -> list[str]:
    """The model's least memory (:func:`model_state_bytes`) against this machine: the ranks of one node together
    against its available RAM (all of it on the CPU accelerator, the offloaded part on GPUs), and one rank's
    device part against the smallest GPU's memory when the run is on GPUs and this machine has them. Activations
    are not counted: a refusal here is certain, passing it is not a promise. Only the launching process checks
    (a worker, ``LOCAL_RANK`` > 0, would see the RAM its siblings already took, and put a CUDA context on GPU 0);
    an accelerator other than cpu, gpu, cuda or auto is not judged."""
    accelerator = str(trainer.get("accelerator") or "auto").lower()
    params = _parameter_count(config)
    if params is None or os.environ.get("LOCAL_RANK", "0") != "0" or accelerator not in ("cpu", "gpu", "cuda",
                                                                                           "auto"):
        return []
    states = model_state_bytes(params, dims, args, precision=trainer.get("precision"), optimizer=optimizer)
    gpu = _gpu_memory() if accelerator != "cpu" else None
    on_gpu = accelerator in ("gpu", "cuda") or gpu is not None  # GPUs named but absent here: not this RAM's part
    ranks = min(dims.world_size, as_int(trainer.get("devices", 1)))
    ram_need = ranks * (states["cpu"] + (0 if on_gpu else states["device"]))
    shape = ", ".join(f"{k}={getattr(config, k)}" for k in ("n_layer", "d_model", "d_ff", "vocab_size"))
    what = (f"model ({shape}): {params:,} parameters, whose weights, gradients and optimizer states need at least "
            f"{{need}} ({dims.tp * dims.pp} model-parallel parts, ZeRO-{args.get('zero_stage', 1)} over dp*cp="
            f"{dims.dp * dims.cp}, precision {trainer.get('precision', '32-true')})")
    problems = []
    ram = available_ram()
    if ram is not None and ram_need > ram:
        problems.append(what.format(need=f"{_bytes(ram_need)} of RAM for the {ranks} ranks on this node") +
                        f"; this machine has {_bytes(ram)} available")
    if gpu is not None and states["device"] > gpu:
        problems.append(what.format(need=f"{_bytes(states['device'])} per GPU") +
                        f"; this machine's GPUs have {_bytes(gpu)} each")
    return problems
