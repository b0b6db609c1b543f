"""``shardline plan --emit``: a plan's row as a runnable ``shardline fit`` recipe, and the recipe's CPU twin.

**The recipe** (:func:`recipe_yaml`) is a comment block, then the YAML :func:`recipe_dict` builds:

- ``trainer``: ``accelerator: gpu``, ``devices`` = GPUs per node (all ``gpus`` when fewer than a node),
  ``num_nodes`` = ``gpus / devices``, ``precision: bf16-mixed``, and HybridParallelStrategy with the layout's
  ``tp, pp, cp, sp, schedule, chunks, zero_stage, offload_*`` and ``gpus_per_node`` (so the strategy refuses a TP
  group that would leave a node);
- the plan's ``micro_batches`` of ``micro_batch_size`` sequences per replica: under ``pp > 1`` the strategy's
  ``micro_batches`` and ``data.batch_size = micro_batches * micro_batch_size`` (the pipeline cuts the batch);
  at ``pp = 1`` ``data.batch_size = micro_batch_size`` and ``trainer.accumulate_grad_batches = micro_batches``
  (Lightning's accumulation, which DeepSpeed runs: one forward of ``micro_batch_size`` at a time, as priced).
  Either way ``data.batch_size * accumulate_grad_batches * dp`` is the global batch;
- ``recompute``: ``full`` is ``activation_checkpointing: true`` (each block's input kept, the block recomputed
  in backward: what the estimator prices). ``selective`` (Korthikanti et al.: recompute attention's softmax and
  dropout) has no switch in shardline and needs none: its attention is fused (flash SDPA, ring attention keeping
  the log-sum-exp), so no ``s x s`` tensor is ever stored and selective equals none in memory and time, which is
  how the estimator and the step-time model price it under flash attention. It is emitted as
  ``activation_checkpointing: false`` and the comment block says so;
- ``model``: the architecture fields of the :class:`~.models.ModelSpec` (random weights) plus ``training``'s
  fields (``lr``, ``warmup_steps``, ...; LanguageModule's own defaults otherwise);
- ``data``: byte-level text (the Python standard library's sources unless ``data.path`` is set).

What shardline cannot run is refused with :class:`~.catalog.PlanError` naming the numbers, never emitted:
a row that does not fit or was not priced, a layout whose GPUs, global batch or node do not match the request,
an FP8 plan (shardline trains in bf16), a ``head_dim`` other than ``d_model / n_head`` or a GPT-2 whose
``seq_len`` differs from the model's (LanguageModule has no such field; its ``seq_len`` is both the window and
GPT-2's position table), NVMe offload without ``nvme_path``. The emitted recipe is then checked the way
``shardline fit`` checks a file (:func:`~shardline.recipes.schema.structure_problems` and
:func:`~shardline.recipes.schema.check_recipe`).

**The CPU twin** (:func:`cpu_twin`): the same recipe at a size one CPU machine trains in seconds, for CI.
Kept: the architecture (GPT-2 or Llama), the GQA ratio ``n_head / n_kv_head``, tied embeddings, q/k/v biases,
``d_ff / d_model`` (to a multiple of 8), the schedule, the ZeRO stage, the SP mode, CPU offload, activation
checkpointing, the optimizer (DeepSpeed's CPU Adam under offload), gradient clipping and whether batches
accumulate. Reduced, the *reduction rule*:

- every parallel degree ``tp, cp, pp, dp`` greater than 1 becomes 2 (the smallest degree with communication:
  each group's collectives run, every SP mode keeps its degree, ZeRO still shards over ``dp * cp``), 1 stays
  1; when all four are greater than 1 (16 ranks) ``dp`` drops to 1, ZeRO then sharding over ``cp = 2``.
  So a twin has at most 8 ranks;
- ``chunks`` -> ``min(chunks, 2)``; ``micro_batches`` -> ``min(m, 2 pp)`` (a multiple of ``pp`` when
  interleaved); ``micro_batch_size`` -> ``min(b, 2)``; ``accumulate_grad_batches`` -> ``min(a, 2)``;
- NVMe offload -> CPU offload (a CI machine has no NVMe swap path); ``gpus_per_node`` dropped (one host);
- the model: vocabulary 256 (bytes), ``seq_len`` 32, ``n_layer = max(2, pp * chunks)``, head dim 8,
  ``n_kv_head`` the first of 2, 4, 8, 1 giving ``n_head = ratio * n_kv_head >= 4`` that the layout can spread;
- ``accelerator: cpu``, ``precision: 32-true``, ``max_steps: 2`` (optimizer steps: with accumulation that is
  ``2 * accumulate_grad_batches`` batches), no validation, no checkpointing, no logger, 200 kB of data.

Two recipes whose twins have the same trainer and data sections (:func:`twin_layout_key`) exercise the same
layout; CI trains one per key.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import textwrap
from typing import Any

import yaml

from shardline.job.errors import ContractError, ShardlineError
from shardline.job.family import SHAPE_FIELDS
from shardline.job.layout import Layout
from shardline.recipes.planning.catalog import Cluster, PlanError
from shardline.recipes.planning.layout import PlanLayout
from shardline.recipes.planning.memory import GIB
from shardline.recipes.planning.models import ModelSpec
from shardline.recipes.planning.search import ERROR_BAND
from shardline.recipes.schema import HYBRID_CLASS, strategy_arguments

#: The twin's limits (see the module docstring).
TWIN_MAX_RANKS = 8
TWIN_DEGREE = 2
TWIN_SEQ_LEN = 32
TWIN_HEAD_DIM = 8
TWIN_MAX_BYTES = 200_000
#: Where NVMe offload swaps when the caller names no folder: a placeholder the comment block points at.
DEFAULT_NVME_PATH = "/local_nvme/shardline"
SEED = 1234
COMMENT_WIDTH = 108  # the comment block's lines, '# ' included, within ruff's 110


# --- the recipe ---------------------------------------------------------------------------------------------------

def _node(cluster: Cluster, gpus: int) -> tuple[int, int]:
    """``(devices, num_nodes)`` of ``gpus`` GPUs on ``cluster``'s nodes."""
    g = cluster.gpus_per_node
    if gpus <= g:
        if g % gpus:
            raise PlanError(f"emit: gpus={gpus} (one partial node) must divide gpus_per_node={g}")
        return gpus, 1
    if gpus % g:
        raise PlanError(f"emit: gpus={gpus} is not a whole number of {g}-GPU nodes")
    return g, gpus // g


def _refusals(model: ModelSpec, row, cluster: Cluster, *, gpus: int, seq_len: int, global_batch: int) -> list[str]:
    """Every reason ``row`` cannot become a runnable recipe (each naming its numbers)."""
    lay: PlanLayout = row.layout
    problems = []
    if not row.fits:
        problems.append("the layout does not fit or cannot run: " + ("; ".join(row.problems) or "fits=False"))
    if row.memory is None or row.prediction is None:
        problems.append("the row was not priced (no memory estimate or step-time prediction)")
    if lay.world != gpus:
        problems.append(f"tp*cp*dp*pp = {lay.tp}*{lay.cp}*{lay.dp}*{lay.pp} = {lay.world} != gpus={gpus}")
    if lay.global_batch != global_batch:
        problems.append(f"micro_batch_size*micro_batches*dp = {lay.micro_batch_size}*{lay.micro_batches}*{lay.dp} "
                        f"= {lay.global_batch} != global_batch={global_batch}")
    if lay.tp > min(cluster.gpus_per_node, gpus):
        problems.append(f"tp={lay.tp} > {min(cluster.gpus_per_node, gpus)} GPUs per node: shardline keeps a TP "
                        "group inside one node")
    prediction = row.prediction
    if prediction is not None and not math.isclose(prediction.peak_flops, cluster.gpu.peak_flops("bf16")):
        problems.append(f"the plan was priced at a peak of {prediction.peak_flops / 1e12:g} TFLOP/s, not the bf16 "
                        f"peak ({cluster.gpu.bf16_tflops:g}): shardline trains in bf16 mixed precision, not FP8")
    if model.head_dim is not None and model.head_dim * model.n_head != model.d_model:
        problems.append(f"head_dim={model.head_dim} != d_model/n_head={model.d_model}/{model.n_head}: a "
                        "shardline fit recipe has no head_dim field")
    if model.family.learned_positions and seq_len != model.seq_len:
        problems.append(f"seq_len={seq_len} != the {model.family.model_name} model's seq_len={model.seq_len}: the "
                        "recipe's model.seq_len is both the training window and the learned position table (plan a "
                        f"model with seq_len={seq_len} instead)")
    return problems


def _strategy_args(lay: PlanLayout, *, gpus_per_node: int, nvme_path: str | None) -> dict[str, Any]:
    layout = lay.layout
    if "nvme" in (lay.offload_optimizer, lay.offload_params):
        layout = dataclasses.replace(layout, zero=dataclasses.replace(layout.zero,
                                                                      nvme_path=nvme_path or DEFAULT_NVME_PATH))
    if lay.pp > 1:
        layout = dataclasses.replace(layout, pipeline=dataclasses.replace(layout.pipeline,
                                                                          micro_batches=lay.micro_batches))
    return {**layout.strategy_args(), "activation_checkpointing": lay.recompute == "full",
            "gpus_per_node": gpus_per_node}


def model_fields(model: ModelSpec, *, seq_len: int) -> dict[str, Any]:
    """The LanguageModule architecture fields of ``model`` trained on ``seq_len``-token windows."""
    shape = model.family.shape_fields(model.shardline_config())
    shape.pop("head_dim", None)  # a recipe has no head_dim field (refused above where it matters)
    if not shape.get("qkv_bias", True):
        del shape["qkv_bias"]
    fields: dict[str, Any] = {"architecture": model.architecture, **shape, "seq_len": seq_len}
    return {key: fields[key] for key in ("architecture", *SHAPE_FIELDS) if key in fields}


#: ``training`` keys that go to the trainer section; the rest go to the model (LanguageModule) section.
TRAINER_KEYS = ("max_steps", "gradient_clip_val", "val_check_interval", "limit_val_batches", "log_every_n_steps")


def recipe_dict(model: ModelSpec, row, cluster: Cluster, *, gpus: int, seq_len: int, global_batch: int,
                training: dict[str, Any] | None = None, nvme_path: str | None = None,
                deepspeed_config: dict | str | None = None) -> dict[str, Any]:
    """The recipe (as a dict) that runs ``row``'s layout; PlanError naming every reason it cannot.
    ``deepspeed_config`` (the one the plan's memory estimate followed) goes to the strategy as it is."""
    problems = _refusals(model, row, cluster, gpus=gpus, seq_len=seq_len, global_batch=global_batch)
    if problems:
        raise PlanError(f"cannot emit a recipe for {model.name!r} on {gpus} x {cluster.gpu.name}: "
                        + "; ".join(problems))
    lay: PlanLayout = row.layout
    devices, nodes = _node(cluster, gpus)
    training = dict(training or {})
    trainer: dict[str, Any] = {
        "accelerator": "gpu", "devices": devices, "num_nodes": nodes,
        "strategy": {"class_path": HYBRID_CLASS,
                     "init_args": _strategy_args(lay, gpus_per_node=devices, nvme_path=nvme_path)},
        "precision": "bf16-mixed"}
    if deepspeed_config is not None:
        trainer["strategy"]["init_args"]["deepspeed_config"] = deepspeed_config
    if lay.pp == 1 and lay.micro_batches > 1:
        trainer["accumulate_grad_batches"] = lay.micro_batches
    trainer.update({"max_steps": 1000, "gradient_clip_val": 1.0, "limit_val_batches": 4, "num_sanity_val_steps": 0,
                    "log_every_n_steps": 10})
    trainer.update({k: training.pop(k) for k in TRAINER_KEYS if k in training})
    trainer["logger"] = {"class_path": "pytorch_lightning.loggers.TensorBoardLogger",
                         "init_args": {"save_dir": "runs", "name": model.name}}
    batch = lay.micro_batch_size * (lay.micro_batches if lay.pp > 1 else 1)
    return {"seed_everything": SEED, "trainer": trainer,
            "model": {**model_fields(model, seq_len=seq_len), **training, "seed": 0,
                      # ZeRO-Offload's optimizer step runs on the CPU: DeepSpeed's CPU Adam, as the plan prices it
                      **({"optimizer": "cpu_adam"} if lay.offload_optimizer != "none" else {})},
            "data": {"path": None, "batch_size": batch, "max_bytes": 1_000_000_000_000}}


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def _layout_line(lay: PlanLayout) -> str:
    tp = f"tp={lay.tp}" + (" (Megatron-SP)" if lay.sp == "megatron" else "")
    cp = f"cp={lay.cp}" + (f" ({lay.sp} attention)" if lay.sp in ("ring", "ulysses") else "")
    if lay.pp > 1:
        sched = "interleaved 1F1B" if lay.schedule == "interleaved" else lay.schedule.upper()
        chunks = f", {lay.chunks} chunks per rank" if lay.chunks > 1 else ""
        pipe = (f"pp={lay.pp} ({sched}{chunks}, {lay.micro_batches} micro-batches of {lay.micro_batch_size} "
                f"per batch)")
    else:
        pipe = (f"pp=1 ({lay.micro_batches} accumulated micro-batch{'es' if lay.micro_batches > 1 else ''} of "
                f"{lay.micro_batch_size})")
    return f"{tp} x {cp} x {pipe} x dp={lay.dp}"


def _zero_line(lay: PlanLayout) -> str:
    offload = {("none", "none"): "no offload"}.get((lay.offload_optimizer, lay.offload_params))
    if offload is None:
        offload = f"optimizer states to {lay.offload_optimizer}, parameters to {lay.offload_params}"
    recompute = {"none": "no recompute", "full": "full recompute (activation_checkpointing)",
                 "selective": "selective recompute (= none here: shardline's fused attention stores no softmax, "
                              "so no switch is set)"}[lay.recompute]
    return f"ZeRO-{lay.zero_stage} over dp*cp={lay.zero_group}, {offload}, {recompute}"


def header(model: ModelSpec, row, cluster: Cluster, *, gpus: int, seq_len: int, global_batch: int,
           command: str, recipe: dict[str, Any], notes: list[str] = ()) -> list[str]:
    """The comment block's lines (without the ``# ``)."""
    lay, memory, pred = row.layout, row.memory, row.prediction
    top = memory.most_loaded
    devices, nodes = _node(cluster, gpus)
    init_args = recipe["trainer"]["strategy"]["init_args"]
    tokens = global_batch * seq_len
    arch = (f"{model.architecture}: {model.n_layer} layers, d_model {model.d_model}, {model.n_head} heads"
            + (f" / {model.kv_heads} KV heads" if model.architecture == "llama" else "")
            + f", d_ff {model.d_ff}, vocab {model.vocab_size}" + (", tied embeddings" if model.tie_embeddings else ""))
    cats = top.categories()
    times = {k: v for k, v in pred.categories().items() if k != "exposed_comm" and v >= 5e-4}  # shown to 1 ms
    lines = [
        f"{model.name}: {model.params() / 1e9:.2f}B parameters ({arch}), random weights.",
        f"seq_len {seq_len}, global batch {global_batch} sequences = {tokens:,} tokens per optimizer step.",
        f"Cluster {cluster.name}: {gpus} x {cluster.gpu.name} ({nodes} node{'s' if nodes > 1 else ''} of {devices}, "
        f"{cluster.intra_node.name} inside a node, {cluster.nics_per_node} x {cluster.inter_node.name} per node), "
        "bf16 mixed precision.",
        "",
        "Layout, as `shardline plan` picks it (of the layouts that fit with the allocator's headroom, the simplest "
        "within the step-time model's 3.44% error band of the fastest):",
        f"  {_layout_line(lay)}",
        f"  {_zero_line(lay)}",
        "",
        f"Memory per GPU, estimated (GiB), most loaded rank {memory.max_memory_rank} (pipeline rank {top.pp_rank}); "
        f"{cluster.gpu.hbm_gb:g} GB HBM:",
        "  " + "  ".join(f"{k} {_gib(v)}" for k, v in cats.items()),
    ]
    if top.cpu or top.nvme:
        lines.append(f"  offloaded per GPU: CPU RAM {_gib(top.cpu)} GiB, NVMe {_gib(top.nvme)} GiB")
    lines += [
        f"Predicted step {_three(pred.step_s)} s: {_three(pred.tokens_per_s_per_gpu)} tokens/s/GPU, "
        f"{pred.tflops_per_gpu:.0f} TFLOP/s/GPU, MFU {100 * pred.mfu:.1f}% (Megatron's model FLOPs over the bf16 "
        f"peak, {cluster.gpu.bf16_tflops:g} TFLOP/s), each +-{100 * ERROR_BAND:.2f}% (the step-time model's mean "
        "error on Korthikanti et al. 2022, Table 5)",
        "  " + ", ".join(f"{k} {v:.3f} s" for k, v in times.items()),
        "",
        f"Reproduce: {command}",
        *notes,
        "",
    ]
    if lay.recompute == "selective":
        lines.append("recompute=selective is emitted as activation_checkpointing: false (identical in shardline).")
    if "nvme_path" in init_args:
        lines.append(f"NVMe offload swaps under trainer.strategy.init_args.nvme_path={init_args['nvme_path']}: set "
                     "it to the node's local NVMe mount.")
    lines += [
        "data: byte-level text (the Python standard library's sources unless data.path is set); data.batch_size is",
        "sequences per data-parallel replica and batch (global batch = batch_size x accumulate_grad_batches x dp).",
        "CPU twin (CI trains it for two steps): shardline.recipes.planning.emit.cpu_twin.",
    ]
    return lines


def _three(x: float) -> str:
    """``x`` to three significant figures, thousands separated (the model is good to a few percent)."""
    places = 2 - math.floor(math.log10(abs(x))) if x else 0
    return f"{round(x, places):,.{max(0, places)}f}"


def recipe_yaml(model: ModelSpec, row, cluster: Cluster, *, gpus: int, seq_len: int, global_batch: int,
                command: str, training: dict[str, Any] | None = None, nvme_path: str | None = None,
                notes: list[str] = (), validate: bool = True, deepspeed_config: dict | str | None = None) -> str:
    """``row`` (a :class:`~.search.PlanRow` that fits) as a ``shardline fit`` recipe: the comment block (memory
    per rank by category and the most loaded rank, predicted step, tokens/s/GPU, MFU, the cluster, ``command``),
    then the YAML. ``training``: LanguageModule fields (``lr``, ``warmup_steps``, ``weight_decay``,
    ``rope_theta``, ...) and trainer fields (:data:`TRAINER_KEYS`); ``notes``: more comment lines. With
    ``validate`` the recipe is checked as
    ``shardline fit`` checks a file (imports Lightning). PlanError naming every reason it cannot be emitted."""
    recipe = recipe_dict(model, row, cluster, gpus=gpus, seq_len=seq_len, global_batch=global_batch,
                         training=training, nvme_path=nvme_path, deepspeed_config=deepspeed_config)
    if validate:
        validate_recipe(recipe, source=f"emitted for {model.name!r}")
    lines = header(model, row, cluster, gpus=gpus, seq_len=seq_len, global_batch=global_batch, command=command,
                   recipe=recipe, notes=list(notes))
    wrapped = [part for line in lines for part in (textwrap.wrap(line, width=COMMENT_WIDTH, subsequent_indent="    ",
                                                                 break_on_hyphens=False) or [""])]
    comment = "\n".join(f"# {line}".rstrip() for line in wrapped)
    return comment + "\n" + yaml.safe_dump(recipe, sort_keys=False, default_flow_style=False, width=110)


def validate_recipe(recipe: dict[str, Any], *, source: str) -> None:
    """The checks ``shardline fit`` runs on a file (keys and types, then the layout against world and model);
    PlanError naming ``source`` and every problem."""
    from shardline.recipes.schema import RecipeError, check_recipe, structure_problems

    problems = structure_problems(recipe)
    if problems:
        raise PlanError(f"recipe {source}: " + "; ".join(problems))
    try:
        check_recipe(recipe, source=source)
    except RecipeError as error:
        raise PlanError(str(error)) from None


# --- reading a recipe back ----------------------------------------------------------------------------------------

def layout_of(recipe: dict[str, Any]) -> PlanLayout:
    """The PlanLayout a recipe with HybridParallelStrategy runs (the inverse of :func:`recipe_dict`). Recompute
    is ``full`` or ``none`` (selective is emitted as none, which it equals). PlanError for another strategy."""
    trainer = recipe.get("trainer") or {}
    strategy = trainer.get("strategy")
    try:  # every spelling shardline fit accepts: a registered name, the class by any of its paths
        args = strategy_arguments(strategy)
    except ContractError as error:
        raise PlanError(f"recipe: trainer.strategy: {error}") from None
    if args is None:
        raise PlanError(f"recipe: trainer.strategy={strategy!r} is not {HYBRID_CLASS} (nor one of its registered "
                        "names, shardline[_tp{t}][_pp{p}][_zero{z}][_offload])")
    try:
        layout = Layout.from_strategy_args(args)
    except ShardlineError as error:
        raise PlanError(f"recipe: trainer.strategy: {error}") from None
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    bad = [f"trainer.{k}={v!r}" for k, v in (("devices", devices), ("num_nodes", nodes))
           if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad:
        raise PlanError(f"recipe: {', '.join(bad)} must be a whole number of GPUs (a plan needs the count)")
    world = devices * nodes
    if world % (tp * pp * cp):
        raise PlanError(f"recipe: tp*pp*cp = {tp * pp * cp} does not divide devices*num_nodes = {world}")
    batch = (recipe.get("data") or {}).get("batch_size", 8)
    if pp > 1:
        m = layout.micro_batches
        if not isinstance(m, int) or batch % m:
            raise PlanError(f"recipe: micro_batches={m!r} must be set and divide data.batch_size={batch} (pp={pp})")
        mbs = batch // m
    else:
        m, mbs = trainer.get("accumulate_grad_batches", 1), batch
    plain = dataclasses.replace(layout, gpus_per_node=None, pipeline=dataclasses.replace(layout.pipeline,
                                                                                        micro_batches=None))
    return PlanLayout.around(plain, dp=world // (tp * pp * cp), micro_batches=m, micro_batch_size=mbs,
                             recompute="full" if args.get("activation_checkpointing") else "none")


# --- the CPU twin -------------------------------------------------------------------------------------------------

def _twin_degrees(tp: int, cp: int, pp: int, dp: int) -> tuple[int, int, int, int]:
    """Every degree > 1 as 2; with all four > 1, dp dropped (see the module docstring)."""
    small = [min(d, TWIN_DEGREE) for d in (tp, cp, pp, dp)]
    if math.prod(small) > TWIN_MAX_RANKS:
        small[3] = 1
    return tuple(small)


def _twin_heads(model: dict[str, Any], *, tp: int, cp: int, sp: str) -> tuple[int, int]:
    """``(n_head, n_kv_head)``: the full model's GQA ratio with the first KV count the layout can spread."""
    n_head = model["n_head"]
    ratio = n_head // (model.get("n_kv_head") or n_head)
    for kv in (2, 4, 8, 1):
        heads = ratio * kv
        if heads < 4:  # at least 4 heads: MHA models too keep heads to spread over tp and cp
            continue
        spread = kv % tp == 0 or (tp % kv == 0 and TWIN_HEAD_DIM % (tp // kv) == 0)
        if heads % tp == 0 and spread and not (sp == "ulysses" and (heads // tp) % cp):
            return heads, kv
    raise PlanError(f"cpu twin: no head count keeps n_head/n_kv_head={ratio} on tp={tp}, cp={cp}, sp={sp!r}")


def _twin_model(model: dict[str, Any], *, tp: int, cp: int, sp: str, stages: int) -> dict[str, Any]:
    arch = model.get("architecture", "gpt2")
    heads, kv = _twin_heads(model, tp=tp, cp=cp, sp=sp)
    d = heads * TWIN_HEAD_DIM
    ratio = (model.get("d_ff") or 4 * model["d_model"]) / model["d_model"]
    d_ff = max(8, round(ratio * d / 8) * 8)
    twin: dict[str, Any] = {"architecture": arch, "vocab_size": 256, "seq_len": TWIN_SEQ_LEN,
                            "n_layer": max(2, stages), "n_head": heads}
    if arch == "llama":
        twin["n_kv_head"] = kv
    twin.update(d_model=d, d_ff=d_ff, tie_embeddings=model.get("tie_embeddings", True))
    for key in ("qkv_bias", "rope_theta", "rms_norm_eps", "optimizer"):  # optimizer: cpu_adam under offload
        if key in model:
            twin[key] = model[key]
    twin.update(lr=3e-3, warmup_steps=1, seed=0)
    return twin


def cpu_twin(recipe: dict[str, Any]) -> dict[str, Any]:
    """The CPU twin of a full-size recipe (see the module docstring's reduction rule): a recipe dict
    ``shardline fit`` trains on one CPU machine in seconds."""
    lay = layout_of(recipe)
    args = dict(recipe["trainer"]["strategy"]["init_args"])
    tp, cp, pp, dp = _twin_degrees(lay.tp, lay.cp, lay.pp, lay.dp)
    chunks = min(lay.chunks, TWIN_DEGREE) if pp > 1 else 1
    sp = lay.sp
    twin_args: dict[str, Any] = {"tp": tp, "pp": pp, "cp": cp, "sp": sp, "zero_stage": lay.zero_stage,
                                 "offload_optimizer": "cpu" if lay.offload_optimizer != "none" else "none",
                                 "offload_params": "cpu" if lay.offload_params != "none" else "none",
                                 "schedule": lay.schedule if pp > 1 else args.get("schedule", "1f1b"),
                                 "chunks": chunks}
    batch = min(lay.micro_batch_size, TWIN_DEGREE)
    accumulate = 1
    if pp > 1:
        m = min(lay.micro_batches, 2 * pp)
        if lay.schedule == "interleaved":
            m = pp * -(-m // pp)
        twin_args["micro_batches"] = m
        batch *= m
    else:
        accumulate = min(lay.micro_batches, TWIN_DEGREE)
    twin_args["activation_checkpointing"] = lay.recompute == "full"
    full_trainer = recipe["trainer"]
    trainer: dict[str, Any] = {"accelerator": "cpu", "devices": tp * cp * pp * dp, "num_nodes": 1,
                               "strategy": {"class_path": HYBRID_CLASS, "init_args": twin_args},
                               "precision": "32-true"}
    if accumulate > 1:
        trainer["accumulate_grad_batches"] = accumulate
    trainer.update({"max_steps": 2, "limit_val_batches": 0, "num_sanity_val_steps": 0,
                    "log_every_n_steps": 1, "enable_checkpointing": False, "logger": False,
                    "enable_progress_bar": False, "enable_model_summary": False})
    if "gradient_clip_val" in full_trainer:
        trainer["gradient_clip_val"] = full_trainer["gradient_clip_val"]
    stages = pp * chunks if pp > 1 else 1
    return {"seed_everything": recipe.get("seed_everything", SEED), "trainer": trainer,
            "model": _twin_model(recipe["model"], tp=tp, cp=cp, sp=sp, stages=stages),
            "data": {"path": None, "batch_size": batch, "max_bytes": TWIN_MAX_BYTES}}


def twin_layout_key(twin: dict[str, Any]) -> str:
    """What makes two twins the same layout: their trainer and data sections (the model's shape aside)."""
    return yaml.safe_dump({"trainer": twin["trainer"], "data": twin["data"]}, sort_keys=True)


def twin_yaml(twin: dict[str, Any]) -> str:
    return yaml.safe_dump(copy.deepcopy(twin), sort_keys=False, default_flow_style=False, width=110)


__all__ = ["DEFAULT_NVME_PATH", "TRAINER_KEYS", "cpu_twin", "header", "layout_of", "model_fields", "recipe_dict",
           "recipe_yaml", "twin_layout_key", "twin_yaml", "validate_recipe"]
