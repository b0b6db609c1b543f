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
   command-line overrides included (jsonargparse's own errors become RecipeError there too). It also builds
   the shardline strategy from its arguments (its own validation: ZeRO stage, offload, collective timeout,
   ``nonfinite_loss``, ...), refuses fp16 with pp > 1 and checks the model's training fields (a finite
   ``lr > 0``, ...). The fit command then holds the configuration it launches against this machine's memory
   (:func:`shardline.recipes.fit.machine_problems`).

Every message is one line and bounded: a value is quoted short (:func:`short_repr`), a problem clipped, at most
:data:`MAX_PROBLEMS` listed. The file itself is bounded before anything is built from it: UTF-8, at most
:data:`MAX_BYTES` bytes, nested at most :data:`MAX_DEPTH` levels, and at most :data:`MAX_NODES` values once its
YAML aliases are expanded (a 300-byte alias bomb would otherwise expand to gigabytes); a recursive alias is refused.

One file: both layers report through the same bounded problem list and :class:`RecipeError`, and the second
layer reuses the first's field tables; the model and layout rules it applies live in :mod:`shardline.job`.
"""

from __future__ import annotations

import difflib
import inspect
import re
import reprlib
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


#: Bounds on a recipe file (a real one is a few KB, a few hundred values, nested 5 or 6 levels).
MAX_BYTES = 1 << 20
MAX_DEPTH = 64
MAX_NODES = 100_000
#: Bounds on an error message: problems listed, characters per problem.
MAX_PROBLEMS = 20
MAX_PROBLEM_CHARS = 400


class RecipeError(ShardlineError, ValueError):
    """A recipe (file or command-line override) that cannot work; names the file and every bad field."""


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset = 3, 6, 8, 8, 6
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 80, 80, 40


def short_repr(value: Any) -> str:
    """``repr(value)`` bounded (reprlib: long strings, containers and numbers elided with ``...``), for messages."""
    return _REPR.repr(value)


def clip(text: str, limit: int = MAX_PROBLEM_CHARS) -> str:
    """``text`` on one line (newlines and their indentation folded into one space), at most ``limit``
    characters: a longer text keeps its beginning and end around `` ... ``."""
    text = re.sub(r"\s*\n\s*", " ", str(text)).strip()
    if len(text) <= limit:
        return text
    head = (limit - 5) * 2 // 3
    return f"{text[:head]} ... {text[len(text) - (limit - 5 - head):]}"


def _fail(source: str, problems: list[str]) -> None:
    if problems:
        shown = [clip(p) for p in problems[:MAX_PROBLEMS]]
        if len(problems) > MAX_PROBLEMS:
            shown.append(f"and {len(problems) - MAX_PROBLEMS} more problems")
        raise RecipeError(f"recipe {source}: " + "; ".join(shown))


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader refusing nesting deeper than :data:`MAX_DEPTH` (it composes recursively: a 100k-deep
    file would end in a RecursionError)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _expanded_size(root: yaml.Node) -> int:
    """How many values the node graph holds once every alias is expanded (memoised per node, so linear in the
    file); ValueError for a recursive alias, which would expand forever."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ValueError(f"a recursive alias at line {node.start_mark.line + 1}")
        open_nodes.add(key)
        if isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        else:
            total = 1
        open_nodes.discard(key)
        sizes[key] = total
        return total

    return size(root)


def _yaml_problem(error: yaml.YAMLError, text: str) -> str:
    """One line for a PyYAML error: where (line, column) and what."""
    if isinstance(error, yaml.reader.ReaderError):
        line = text.count("\n", 0, error.position) + 1
        column = error.position - (text.rfind("\n", 0, error.position) + 1) + 1
        char = error.character
        what = f"character #x{char:04x}: {error.reason}" if isinstance(char, int) else f"{error.reason}"
        return f" at line {line}, column {column}: {what}"
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    what = " ".join(p for p in (getattr(error, "context", None), getattr(error, "problem", None)) if p)
    return f"{where}: {clip(what or error, 200)}"


def read_recipe_file(path: str | Path) -> Any:
    """The YAML value of the recipe file at ``path``, read within the bounds of the module docstring;
    RecipeError naming the file (and the line) otherwise. Aliases are expanded into shared objects."""
    source = str(path)
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_BYTES + 1)
    except OSError as error:
        raise RecipeError(f"recipe {source}: cannot be read ({error.strerror or error})") from None
    if len(data) > MAX_BYTES:
        raise RecipeError(f"recipe {source}: larger than {MAX_BYTES} bytes, which no recipe is")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise RecipeError(f"recipe {source}: not UTF-8 text: byte 0x{data[error.start]:02x} at line {line}, "
                          f"column {column}") from None
    loader = None
    try:
        loader = _BoundedLoader(text)  # its reader refuses unprintable characters here
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node)
        if size > MAX_NODES:
            raise RecipeError(f"recipe {source}: its YAML aliases expand it to {size} values, more than the "
                              f"{MAX_NODES} a recipe may hold (an alias repeats a value; here they multiply)")
        return loader.construct_document(node)
    except yaml.YAMLError as error:
        raise RecipeError(f"recipe {source}: not valid YAML{_yaml_problem(error, text)}") from None
    except ValueError as error:  # a recursive alias (RecipeError is a ValueError too: kept as it is)
        if isinstance(error, RecipeError):
            raise
        raise RecipeError(f"recipe {source}: not valid for a recipe: {error}") from None
    finally:
        if loader is not None:
            loader.dispose()


def load_recipe(path: str | Path) -> dict[str, Any]:
    """The recipe at ``path`` as a dict, after both validation layers (see the module docstring)."""
    source = str(path)
    recipe = read_recipe_file(path)
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
        return [f"{prefix} must be a mapping of {what} arguments, got {type(values).__name__} {short_repr(values)}"]
    problems = []
    for key, value in values.items():
        name = f"{prefix}.{key if isinstance(key, str) and len(key) <= 80 else short_repr(key)}"
        if name in LINKED:
            problems.append(f"{name} is not a recipe field: it follows {LINKED[name]}")
        elif key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {prefix}.{near[0]}?)" if near else ""
            problems.append(f"{name} is not a {what} argument{hint}")
        elif not _type_ok(value, fields[key]):
            problems.append(f"{name}={short_repr(value)} is a {type(value).__name__}, expected "
                            f"{_describe(fields[key])}")
    return problems


def structure_problems(recipe: dict[str, Any]) -> list[str]:
    """Unknown sections and keys, and simple-typed fields of the wrong type, each naming the field."""
    problems = []
    for key in recipe:
        if key not in SECTIONS:
            near = difflib.get_close_matches(str(key), SECTIONS, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            problems.append(f"{short_repr(key)} is not a recipe section; sections are {SECTIONS}{hint}")
    for key, annotation in (("seed_everything", int | bool), ("ckpt_path", str | None)):
        if key in recipe and not _type_ok(recipe[key], annotation):
            problems.append(f"{key}={short_repr(recipe[key])} is a {type(recipe[key]).__name__}, "
                            f"expected {annotation}")
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
    extra = sorted((key for key in strategy if key not in ("class_path", "init_args")), key=str)
    if extra:
        return [f"trainer.strategy has keys {short_repr(extra)}; a strategy is class_path plus init_args"]
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

def strategy_arguments(strategy: Any) -> dict[str, Any] | None:
    """HybridParallelStrategy's arguments in a recipe's ``trainer.strategy``, whichever spelling ``shardline fit``
    accepts: a registered name (``shardline_tp2_zero1``) or a class_path dict (the full path, the
    ``shardline.plugins`` re-export or the bare class name) with its init_args; None for any other strategy.
    A name outside the registered family raises ContractError naming it."""
    from shardline.job.layout import parse_strategy_name

    if isinstance(strategy, str) and strategy.startswith("shardline"):
        return parse_strategy_name(strategy)
    if isinstance(strategy, dict) and _is_hybrid(strategy.get("class_path")):
        return dict(strategy.get("init_args") or {})
    return None


def strategy_layout(strategy: Any):
    """The unbound :class:`~shardline.plugins.layout.Layout` of a shardline strategy given as a registered name
    or class_path dict (the strategy's own value, built the way the strategy builds it); None for any other
    strategy. Bad values raise the Layout's ContractError/LayoutError, naming them."""
    from shardline.plugins.layout import Layout

    args = strategy_arguments(strategy)
    return None if args is None else Layout.from_strategy_args(args)


def with_defaults(cls: type, section: Any) -> dict[str, Any]:
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


def as_int(value: Any) -> Any:
    """``"4"`` (how the command line may deliver ``--trainer.devices 4``) as 4; anything else unchanged."""
    return int(value) if isinstance(value, str) and value.isdigit() else value


#: Class-path prefixes of Lightning's unified namespace -> the standalone packages' prefixes shardline fit runs
#: (its strategy, data module and LanguageModule are pytorch_lightning classes; a lightning.pytorch class is another
#: class there).
NAMESPACE_TWINS = {"lightning.pytorch.": "pytorch_lightning.", "lightning.fabric.": "lightning_fabric."}


def namespace_problems(recipe: Any, where: str = "") -> list[str]:
    """Every ``class_path`` in ``recipe`` (at any depth) that names a class of Lightning's other namespace
    (``lightning.pytorch``), each with the ``pytorch_lightning`` path to use instead: mixing the two namespaces
    gives Lightning two unrelated copies of each class (a callback of one is not a Callback of the other)."""
    problems = []
    if isinstance(recipe, dict):
        for key, value in recipe.items():
            here = f"{where}.{key}" if where else str(key)
            twin = next((p for p in NAMESPACE_TWINS if isinstance(value, str) and value.startswith(p)), None)
            if key == "class_path" and twin is not None:
                use = NAMESPACE_TWINS[twin] + value[len(twin):]
                problems.append(f"{here}={short_repr(value)} is a class of the lightning namespace, but shardline "
                                f"fit runs pytorch_lightning (the two are different classes): use {use}")
            else:
                problems += namespace_problems(value, here)
    elif isinstance(recipe, list):
        for i, value in enumerate(recipe):
            problems += namespace_problems(value, f"{where}[{i}]")
    return problems


def check_recipe(recipe: dict[str, Any], *, source: str) -> None:
    """Cross-field checks (layout vs world, the strategy's own arguments, precision vs pp, model shape and
    training fields, model vs layout, vocabulary); RecipeError naming ``source`` and the fields. Reuses
    ParallelDims, the strategy and the model configs, whose messages name every value. Nothing here depends on
    the machine it runs on (the planner checks recipes for other machines); the fit command adds that
    (:func:`shardline.recipes.fit.machine_problems`)."""
    from shardline.plugins.errors import ContractError, LayoutError, ShardlineError
    from shardline.recipes.data import TextDataModule
    from shardline.recipes.lit_lm import LanguageModule, model_config, training_problems

    trainer = recipe.get("trainer") or {}
    model = with_defaults(LanguageModule, recipe.get("model"))
    problems, dims, config, model_class = [], None, None, None
    strategy = trainer.get("strategy")
    try:
        layout = strategy_layout(strategy)
    except (ContractError, LayoutError) as error:
        layout, problems = None, [f"trainer.strategy: {error}"]
    if layout is not None:
        problems += _strategy_build_problems(strategy) + _precision_problems(trainer.get("precision"), layout.pp)
    if isinstance(strategy, dict) and _is_hybrid(strategy.get("class_path")):
        problems += [f"trainer.strategy.init_args.{key} has no effect under HybridParallelStrategy (ZeRO comes "
                     "from zero_stage and offload_*; other DeepSpeed options go in deepspeed_config)"
                     for key in ignored_deepspeed_args(strategy.get("init_args") or {}, only_changed=True)]
    data_path = (recipe.get("data") or {}).get("path")
    if isinstance(data_path, str) and not Path(data_path).expanduser().exists():
        problems.append(f"data.path={short_repr(data_path)} does not exist (relative paths are from the working "
                        "folder)")
    devices, nodes = (as_int(trainer.get(k, 1)) for k in ("devices", "num_nodes"))
    if layout is not None and isinstance(devices, int) and isinstance(nodes, int):
        try:
            dims = layout.for_world(devices * nodes)
        except LayoutError as error:
            degrees = {"tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "sp": layout.sp.value}
            problems.append(f"trainer.devices={devices} x trainer.num_nodes={nodes} with trainer.strategy "
                            f"{degrees}: {error}")
    problems += [f"model.{problem}" for problem in training_problems(model)]
    problems += namespace_problems(recipe)
    init_from = model.get("init_from")
    try:
        model_class, config = model_config(model)
    except ShardlineError as error:
        problems.append(f"model{'.init_from' if init_from else ''}: {error}")
    n_layer = config.n_layer if config is not None else model.get("n_layer")
    problems += _pipeline_problems(strategy, n_layer, with_defaults(TextDataModule, recipe.get("data")))
    if config is not None:
        problems += _vocab_problems(config, init_from)
    if config is not None and dims is not None:
        problems += [f"model vs trainer.strategy: {p}" for p in model_class.layout_problems(config, dims)]
    _fail(source, problems)


def _vocab_problems(config, init_from: Any) -> list[str]:
    """The model's vocabulary must hold the tokenizer's (the bytes', or ``init_from``'s tokenizer.json's)."""
    from shardline.recipes.data import VOCAB_SIZE, tokenizer_class, tokenizer_file

    tokenizer = tokenizer_file(init_from) if init_from else None
    vocab, what = VOCAB_SIZE, "the byte vocabulary"
    if tokenizer is not None:
        try:
            vocab = tokenizer_class(tokenizer).from_file(str(tokenizer)).get_vocab_size()
            what = f"the tokenizer {tokenizer}"
        except RecipeError:
            raise
        except Exception as error:  # the tokenizers library raises a bare Exception for a bad file
            return [f"model.init_from: {tokenizer} is not a readable tokenizer.json ({error})"]
    if config.vocab_size < vocab:
        field = "model.init_from's vocab_size" if init_from else "model.vocab_size"
        return [f"{field}={config.vocab_size} is below {what} ({vocab})"]
    return []


def _strategy_build_problems(strategy: Any) -> list[str]:
    """HybridParallelStrategy built from the recipe's arguments for it (its own, not Lightning's), so that its
    own validation (ZeRO stage and offload, deepspeed_config, collective_timeout, pipeline_annotations,
    async_checkpoint, nonfinite_loss, ...) speaks now, in the launching process, with the field named, instead of
    inside jsonargparse (a 60-line traceback) or on every rank. Building it allocates nothing."""
    from shardline.plugins.errors import ShardlineError
    from shardline.plugins.lightning.strategy import HybridParallelStrategy

    args = strategy_arguments(strategy)
    if args is None:
        return []
    own = set(inspect.signature(HybridParallelStrategy.__init__).parameters) - {"self", "lightning_kwargs"}
    try:
        HybridParallelStrategy(**{key: value for key, value in args.items() if key in own})
    except ShardlineError as error:
        return [f"trainer.strategy: {error}"]
    except (TypeError, ValueError, AttributeError) as error:  # a value no check anticipated: still one line
        return [f"trainer.strategy: {type(error).__name__}: {error}"]
    return []


def _precision_problems(precision: Any, pp: int) -> list[str]:
    """fp16 with pp > 1: the strategy refuses it at setup, on every rank, after the launch; say it now."""
    if isinstance(pp, int) and pp > 1 and str(precision).startswith("16"):
        return [f"trainer.precision={short_repr(precision)} with trainer.strategy pp={pp}: fp16 loss scaling would "
                "apply twice on every stage but the last; use precision='bf16-mixed'"]
    return []
