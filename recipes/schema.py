"""Recipe files: what a ``shardline fit`` recipe may contain, and the checks that run before anything is built.

A recipe is LightningCLI's ``fit`` configuration as YAML, with four sections (all optional):
``seed_everything``, ``trainer`` (``pytorch_lightning.Trainer`` arguments; ``trainer.strategy`` is a registered
name such as ``shardline_tp2_zero1`` or ``{class_path: shardline.plugins.lightning.strategy.HybridParallelStrategy,
init_args: {...}}``), ``model`` (:class:`~shardline.recipes.lit_lm.LanguageModule` arguments) and ``data``
(:class:`~shardline.recipes.data.TextDataModule` arguments; ``data.seq_len`` is not a recipe field: the fit
command links it to ``model.seq_len``). ``ckpt_path`` resumes a run.

Validation has two layers, both raising :class:`RecipeError` with the file and every offending field:

1. :func:`load_recipe` reads the file as written: YAML syntax (with the line), unknown sections and keys (with
   the nearest valid name), and the type of every field whose annotation is made of plain types (int, float,
   bool, str, None, Literal, list, dict and unions of them). Fields of richer types (a logger, callbacks) are
   left to jsonargparse, which LightningCLI runs next.
2. :func:`check_recipe` checks what no single field shows: the parallel layout against the world
   (``ParallelDims``: ``tp*pp*cp`` must divide ``devices*num_nodes``), the model shape (``GPTConfig`` or
   ``LlamaConfig``, or ``model.init_from``'s config.json), the model against the layout (heads, KV heads and FFN
   against tp, ...), the pipeline (a layer per stage, micro-batches dividing ``data.batch_size``), the
   vocabulary (the bytes', or ``init_from``'s tokenizer's), and that ``data.path`` exists. The fit command runs
   it on the file alone and again on the configuration LightningCLI parsed,
   command-line overrides included (jsonargparse's own errors become RecipeError there too).
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from shardline.plugins.errors import ShardlineError

SECTIONS = ("seed_everything", "trainer", "model", "data", "ckpt_path")
# fields the fit command sets from another; not recipe fields
LINKED = {"data.seq_len": "model.seq_len", "data.tokenizer": "model.init_from"}
HYBRID_CLASS = "shardline.plugins.lightning.strategy.HybridParallelStrategy"
_SIMPLE = (int, float, bool, str, type(None), list, dict)
# DeepSpeedStrategy arguments that take effect whatever its DeepSpeed config is. Its others only build a default
# config, which HybridParallelStrategy replaces by one derived from zero_stage/offload_* (+ deepspeed_config):
# there they would be silently ignored, so a recipe may not set them.
DEEPSPEED_ARGS_KEPT = frozenset({
    "accelerator", "parallel_devices", "cluster_environment", "precision_plugin", "process_group_backend",
    "timeout", "logging_level", "remote_device", "load_full_weights", "exclude_frozen_parameters", "loss_scale",
    "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"})


class RecipeError(ShardlineError, ValueError):
    """A recipe (file or command-line override) that cannot work; names the file and every bad field."""


def _fail(source: str, problems: list[str]) -> None:
    if problems:
        raise RecipeError(f"recipe {source}: " + "; ".join(problems))


def load_recipe(path: str | Path) -> dict[str, Any]:
    """The recipe at ``path`` as a dict, after both validation layers (see the module docstring)."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise RecipeError(f"recipe {source}: cannot be read ({error.strerror})") from None
    try:
        recipe = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"recipe {source}: not valid YAML{where}: {getattr(error, 'problem', error)}") from None
    if recipe is None:
        recipe = {}
    if not isinstance(recipe, dict):
        raise RecipeError(f"recipe {source}: must be a mapping of sections {SECTIONS}, "
                          f"got {type(recipe).__name__}")
    _fail(source, structure_problems(recipe))
    check_recipe(recipe, source=source)
    return recipe


# --- layer 1: keys and types -----------------------------------------------------------------------------------

def _signature_hints(cls: type) -> dict[str, Any]:
    """Parameter name -> annotation of ``cls.__init__`` (``Any`` where unresolvable), without ``self``/``**``."""
    params = inspect.signature(cls.__init__).parameters
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation that does not resolve here: leave that type to jsonargparse
        hints = {}
    return {name: hints.get(name, Any) for name, p in params.items()
            if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def section_fields() -> dict[str, dict[str, Any]]:
    """Field annotations per section: ``model``, ``data``, ``trainer`` and ``strategy`` (HybridParallelStrategy
    init_args: its own arguments plus the DeepSpeedStrategy ones its ``**lightning_kwargs`` forwards)."""
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DeepSpeedStrategy

    from shardline.plugins.lightning.strategy import HybridParallelStrategy
    from shardline.recipes.data import TextDataModule
    from shardline.recipes.lit_lm import LanguageModule

    data = _signature_hints(TextDataModule)
    for field in LINKED:
        data.pop(field.split(".", 1)[1])
    strategy = {k: v for k, v in _signature_hints(DeepSpeedStrategy).items() if k in DEEPSPEED_ARGS_KEPT}
    strategy.update(_signature_hints(HybridParallelStrategy))
    return {"model": _signature_hints(LanguageModule), "data": data, "trainer": _signature_hints(pl.Trainer),
            "strategy": strategy}


def _type_ok(value: Any, annotation: Any) -> bool:
    """False only when ``value`` certainly does not fit ``annotation``; richer types are not judged here."""
    if annotation is Any or annotation is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        members = typing.get_args(annotation)
        if any(_type_ok(value, m) for m in members if _is_simple(m)):
            return True
        return not all(_is_simple(m) for m in members)
    if origin is Literal:
        return value in typing.get_args(annotation) and type(value) in {type(a) for a in typing.get_args(annotation)}
    if origin is not None:
        annotation = origin
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in _SIMPLE:
        return isinstance(value, annotation)
    return True


def _is_simple(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return all(_is_simple(m) for m in typing.get_args(annotation))
    return origin is Literal or (origin or annotation) in _SIMPLE


def _describe(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "")
    return annotation.__name__ if isinstance(annotation, type) else text


def _field_problems(prefix: str, values: Any, fields: dict[str, Any], *, what: str) -> list[str]:
    if values is None:
        return []
    if not isinstance(values, dict):
        return [f"{prefix} must be a mapping of {what} arguments, got {type(values).__name__} {values!r}"]
    problems = []
    for key, value in values.items():
        name = f"{prefix}.{key}"
        if name in LINKED:
            problems.append(f"{name} is not a recipe field: it follows {LINKED[name]}")
        elif key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {prefix}.{near[0]}?)" if near else ""
            problems.append(f"{name} is not a {what} argument{hint}")
        elif not _type_ok(value, fields[key]):
            problems.append(f"{name}={value!r} is a {type(value).__name__}, expected {_describe(fields[key])}")
    return problems


def structure_problems(recipe: dict[str, Any]) -> list[str]:
    """Unknown sections and keys, and simple-typed fields of the wrong type, each naming the field."""
    problems = []
    for key in recipe:
        if key not in SECTIONS:
            near = difflib.get_close_matches(str(key), SECTIONS, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            problems.append(f"{key!r} is not a recipe section; sections are {SECTIONS}{hint}")
    for key, annotation in (("seed_everything", int | bool), ("ckpt_path", str | None)):
        if key in recipe and not _type_ok(recipe[key], annotation):
            problems.append(f"{key}={recipe[key]!r} is a {type(recipe[key]).__name__}, expected {annotation}")
    fields = section_fields()
    problems += _field_problems("model", recipe.get("model"), fields["model"], what="LanguageModule")
    problems += _field_problems("data", recipe.get("data"), fields["data"], what="TextDataModule")
    trainer = recipe.get("trainer")
    problems += _field_problems("trainer", trainer, fields["trainer"], what="Trainer")
    strategy = trainer.get("strategy") if isinstance(trainer, dict) else None
    if isinstance(strategy, dict):
        problems += _strategy_problems(strategy, fields["strategy"])
    return problems


def _strategy_problems(strategy: dict[str, Any], fields: dict[str, Any]) -> list[str]:
    extra = sorted(set(strategy) - {"class_path", "init_args"})
    if extra:
        return [f"trainer.strategy has keys {extra}; a strategy is class_path plus init_args"]
    if _is_hybrid(strategy.get("class_path")):
        init_args = strategy.get("init_args") or {}
        ignored = ignored_deepspeed_args(init_args)
        problems = [f"trainer.strategy.init_args.{key} is a DeepSpeedStrategy argument that "
                    "HybridParallelStrategy ignores (ZeRO comes from zero_stage and offload_*; other DeepSpeed "
                    "options go in deepspeed_config)" for key in ignored]
        rest = {k: v for k, v in init_args.items() if k not in ignored}
        return problems + _field_problems("trainer.strategy.init_args", rest, fields,
                                          what="HybridParallelStrategy")
    return []


def ignored_deepspeed_args(init_args: dict[str, Any], *, only_changed: bool = False) -> list[str]:
    """Keys of ``init_args`` that HybridParallelStrategy passes to DeepSpeedStrategy where they have no effect;
    with ``only_changed``, only those set to something other than DeepSpeedStrategy's default."""
    from pytorch_lightning.strategies import DeepSpeedStrategy

    from shardline.plugins.lightning.strategy import HybridParallelStrategy

    own = set(inspect.signature(HybridParallelStrategy.__init__).parameters)
    params = inspect.signature(DeepSpeedStrategy.__init__).parameters
    return [key for key, value in init_args.items()
            if key in params and key not in own and key not in DEEPSPEED_ARGS_KEPT and key != "self"
            and not (only_changed and value == params[key].default)]


def _is_hybrid(class_path: Any) -> bool:
    return class_path in (HYBRID_CLASS, "shardline.plugins.HybridParallelStrategy", "HybridParallelStrategy")


# --- layer 2: fields together ------------------------------------------------------------------------------------

#: HybridParallelStrategy's arguments that make up its Layout, and the Layout part each goes to.
_LAYOUT_ARGS = {"tp": None, "pp": None, "cp": None, "sp": None, "gpus_per_node": None, "schedule": "pipeline",
                "chunks": "pipeline", "micro_batches": "pipeline", "zero_stage": "zero", "offload_optimizer": "zero",
                "offload_params": "zero", "nvme_path": "zero"}


def strategy_arguments(strategy: Any) -> dict[str, Any] | None:
    """HybridParallelStrategy's arguments in a recipe's ``trainer.strategy``, whichever spelling ``shardline fit``
    accepts: a registered name (``shardline_tp2_zero1``) or a class_path dict (the full path, the
    ``shardline.plugins`` re-export or the bare class name) with its init_args; None for any other strategy.
    A name outside the registered family raises ContractError naming it."""
    from shardline.plugins.lightning.registry import parse_strategy_name

    if isinstance(strategy, str) and strategy.startswith("shardline"):
        return parse_strategy_name(strategy)
    if isinstance(strategy, dict) and _is_hybrid(strategy.get("class_path")):
        return dict(strategy.get("init_args") or {})
    return None


def strategy_layout(strategy: Any):
    """The unbound :class:`~shardline.plugins.layout.Layout` of a shardline strategy given as a registered name
    or class_path dict (the strategy's own value, built the way the strategy builds it); None for any other
    strategy. Bad values raise the Layout's ContractError/LayoutError, naming them."""
    from shardline.plugins.layout import Layout, PipelineSpec, ZeroSpec

    args = strategy_arguments(strategy)
    if args is None:
        return None
    parts: dict[str | None, dict] = {None: {}, "pipeline": {}, "zero": {}}
    for key, part in _LAYOUT_ARGS.items():
        if key in args:
            parts[part][{"zero_stage": "stage"}.get(key, key)] = args[key]
    return Layout(**parts[None], pipeline=PipelineSpec(**parts["pipeline"]), zero=ZeroSpec(**parts["zero"]))


def _with_defaults(cls: type, section: Any) -> dict[str, Any]:
    """``cls.__init__``'s defaults updated with the recipe section's values."""
    defaults = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
                if p.default is not p.empty}
    return {**defaults, **(section if isinstance(section, dict) else {})}


def _pipeline_problems(strategy: Any, n_layer: Any, data: dict[str, Any]) -> list[str]:
    """With pp > 1: every stage needs a layer, and the micro-batches must divide the per-replica batch."""
    if not (isinstance(strategy, dict) and _is_hybrid(strategy.get("class_path"))):
        return []
    args = strategy.get("init_args") or {}
    pp, chunks, m = args.get("pp", 1), args.get("chunks", 1), args.get("micro_batches")
    if not (isinstance(pp, int) and pp > 1 and isinstance(chunks, int)):
        return []
    problems = []
    batch = data.get("batch_size")
    if isinstance(n_layer, int) and n_layer + 2 < pp * chunks:
        problems.append(f"model.n_layer={n_layer}: the pipeline cuts its n_layer + 2 = {n_layer + 2} layers "
                        f"(embedding, blocks, head) into pp*chunks = {pp}*{chunks} = {pp * chunks} non-empty stages")
    if isinstance(m, int) and isinstance(batch, int) and m > 0 and batch % m:
        problems.append(f"data.batch_size={batch} is not divisible by trainer.strategy.init_args.micro_batches={m}")
    return problems


def _as_int(value: Any) -> Any:
    """``"4"`` (how the command line may deliver ``--trainer.devices 4``) as 4; anything else unchanged."""
    return int(value) if isinstance(value, str) and value.isdigit() else value


def check_recipe(recipe: dict[str, Any], *, source: str) -> None:
    """Cross-field checks (layout vs world, model shape, model vs layout, vocabulary); RecipeError naming
    ``source`` and the fields. Reuses ParallelDims and the model configs, whose messages name every value."""
    from shardline.plugins.errors import ContractError, LayoutError, ShardlineError
    from shardline.recipes.data import VOCAB_SIZE, TextDataModule, tokenizer_class, tokenizer_file
    from shardline.recipes.lit_lm import LanguageModule, model_config

    trainer = recipe.get("trainer") or {}
    model = _with_defaults(LanguageModule, recipe.get("model"))
    problems, dims, config, model_class = [], None, None, None
    try:
        layout = strategy_layout(trainer.get("strategy"))
    except (ContractError, LayoutError) as error:
        layout, problems = None, [f"trainer.strategy: {error}"]
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict) and _is_hybrid(strategy.get("class_path")):
        problems += [f"trainer.strategy.init_args.{key} has no effect under HybridParallelStrategy (ZeRO comes "
                     "from zero_stage and offload_*; other DeepSpeed options go in deepspeed_config)"
                     for key in ignored_deepspeed_args(strategy.get("init_args") or {}, only_changed=True)]
    data_path = (recipe.get("data") or {}).get("path")
    if isinstance(data_path, str) and not Path(data_path).expanduser().exists():
        problems.append(f"data.path={data_path!r} does not exist (relative paths are from the working folder)")
    devices, nodes = (_as_int(trainer.get(k, 1)) for k in ("devices", "num_nodes"))
    if layout is not None and isinstance(devices, int) and isinstance(nodes, int):
        try:
            dims = layout.for_world(devices * nodes)
        except LayoutError as error:
            degrees = {"tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "sp": layout.sp.value}
            problems.append(f"trainer.devices={devices} x trainer.num_nodes={nodes} with trainer.strategy "
                            f"{degrees}: {error}")
    init_from = model.get("init_from")
    try:
        model_class, config = model_config(model)
    except ShardlineError as error:
        problems.append(f"model{'.init_from' if init_from else ''}: {error}")
    n_layer = config.n_layer if config is not None else model.get("n_layer")
    problems += _pipeline_problems(trainer.get("strategy"), n_layer,
                                   _with_defaults(TextDataModule, recipe.get("data")))
    if config is not None:
        tokenizer = tokenizer_file(init_from) if init_from else None
        vocab, what = VOCAB_SIZE, "the byte vocabulary"
        if tokenizer is not None:
            try:
                vocab = tokenizer_class(tokenizer).from_file(str(tokenizer)).get_vocab_size()
                what = f"the tokenizer {tokenizer}"
            except RecipeError:
                raise
            except Exception as error:  # the tokenizers library raises a bare Exception for a bad file
                problems.append(f"model.init_from: {tokenizer} is not a readable tokenizer.json ({error})")
                vocab = 0
        if config.vocab_size < vocab:
            field = "model.init_from's vocab_size" if init_from else "model.vocab_size"
            problems.append(f"{field}={config.vocab_size} is below {what} ({vocab})")
    if config is not None and dims is not None:
        problems += [f"model vs trainer.strategy: {p}" for p in model_class.layout_problems(config, dims)]
    _fail(source, problems)
