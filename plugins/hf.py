"""Hugging Face checkpoints in and out: :func:`from_pretrained` and :func:`save_pretrained`.

A Hugging Face model folder is ``config.json`` plus one ``model.safetensors`` or several shards with their
``model.safetensors.index.json``. Supported architectures (``config.json``'s ``architectures``):
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` (shardline's :class:`~.models.llama.Llama`)
and ``GPT2LMHeadModel`` (:class:`~.models.gpt.GPT`).

Loading builds the model for ``grid``'s layout on the meta device (nothing random is drawn, nothing is
allocated), then gives each parameter this rank's slice only, read lazily from the safetensors file
(``safe_open(...).get_slice``): a rank never holds more of a checkpoint tensor than it keeps. A Hugging Face
tensor is a canonical tensor of the layout-independent checkpoint (:mod:`shardline.plugins.checkpoint`): a rank
reads the canonical boxes of its part and assembles them, and saving writes the canonical tensor of each dense
one, both through the checkpoint's transforms (:mod:`shardline.plugins.checkpoint.boxes`). Every name and kind
(:class:`~shardline.job.family.TensorKind`) lives in one table per architecture (its family's
:meth:`~shardline.job.family.Family.hf_table`, beside its ``config.json`` mapping, in :mod:`shardline.job.gpt` and
:mod:`shardline.job.llama`):

- Llama family: one tensor each; q/k/v stay separate (their per-head shards are plain row slices, also when
  ``tp > n_kv_heads``); the vocabulary is zero-padded to a multiple of tp on load and cut back on save;
- GPT-2: Conv1D weights are stored transposed (``[in, out]``) and ``c_attn`` fuses q, k and v as three blocks of
  columns, where shardline's fused projection interleaves them per head: both are converted by the kinds'
  transforms; the output projection is tied to ``wte``.

Saving streams tensor by tensor: each tensor's shards go to rank 0 (from the tp ranks of the pipeline stage that
hosts it, at dp = cp = 0), which converts it to Hugging Face's layout and writes a safetensors shard file whenever
``max_shard_bytes`` is reached, so rank 0 holds at most one shard file's worth. The folder loads with
``transformers.AutoModelForCausalLM.from_pretrained``; a load-save round trip is exact (names, dtypes, values).

Bad input raises :class:`CheckpointError` naming the folder, file, tensor and numbers, before any weight is used:
no config, an unsupported architecture or option, a config the layout cannot take, a missing, extra or misshapen
tensor, a damaged file, a quantized checkpoint (``quantization_config``, or a weight stored as an integer, boolean
or 8-bit float: :data:`WEIGHT_DTYPES` only). A weight holding NaN or infinite values loads with a RuntimeWarning
naming the file and tensor (once per tensor and rank). Under pp > 1 a rank builds and reads only its own stages.
Under ZeRO-3 (loading inside ``deepspeed.zero.Init``) each rank materialises its TP/PP part, which ZeRO-3 then
partitions over the data-parallel ranks (tested: dp2, tp2, pp2).

Loading and saving are the two directions of the same per-architecture name tables and of the checkpoint's
transforms (fused q/k/v, transposed Conv1D, vocabulary padding): this module holds only the safetensors side.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from shardline.job.families import FAMILIES, HF_ARCHITECTURES, config_from_hf
from shardline.job.family import Source, TensorKind
from shardline.plugins.checkpoint.boxes import Placement, canonical_tensor, full, read_part
from shardline.plugins.checkpoint.names import hf_config_of, rank_placement
from shardline.plugins.errors import CheckpointError, ContractError
from shardline.plugins.layers.roles import RoleKind, role_of
from shardline.plugins.layers.tp_comm import group_rank, group_size
from shardline.plugins.torch_compat import parameter_table

#: Hugging Face ``architectures`` -> family, and -> ``model_type``: the families' own (:mod:`shardline.job.families`).
ARCHITECTURES = HF_ARCHITECTURES
#: Tensors a Hugging Face checkpoint may hold that are not weights (old GPT-2 files keep attention masks).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
#: The safetensors dtypes a weight may be stored in. An integer, boolean or 8-bit float tensor is a quantized
#: checkpoint's (its values mean nothing without scales kept elsewhere): cast to float it would load as wrong
#: weights without a word, so it is refused.
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")
#: Elements checked for NaN/inf at a time (bounds the temporary a slice's check allocates).
FINITE_CHUNK = 1 << 24


# --- the tables ------------------------------------------------------------------------------------------------

def _table(arch: str, config) -> dict[str, Source]:
    """Every shardline parameter name of ``config``'s model -> its Hugging Face source (the family's table,
    :meth:`shardline.job.family.Family.hf_table`)."""
    return FAMILIES[ARCHITECTURES[arch]].hf_table(config)


# --- configs ---------------------------------------------------------------------------------------------------

def read_config(folder: str | os.PathLike) -> tuple[str, dict, object]:
    """``(architecture, config.json as a dict, shardline config)`` of a Hugging Face folder (the family's mapping,
    :meth:`shardline.job.family.Family.config_from_hf`)."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json (a Hugging Face model folder has config.json and "
                              f"*.safetensors)")
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: not readable JSON ({error})") from None
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise CheckpointError(f"{path}: quantization_config (quant_method={method!r}): quantized checkpoints are "
                              "not supported; use the model's float16, bfloat16 or float32 weights")
    try:
        arch, config = config_from_hf(hf)
    except ContractError as error:
        raise CheckpointError(f"{path}: {error}") from None
    return arch, hf, config


def _model_class(arch: str):
    from shardline.plugins.models import model_class

    return model_class(ARCHITECTURES[arch])


# --- reading ---------------------------------------------------------------------------------------------------

class _Files:
    """The folder's safetensors files, opened lazily; tensor name -> file from the index (or the one file)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.folder, self._open, self._handles = folder, safe_open, {}
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as error:
                raise CheckpointError(f"{index}: not a safetensors index ({error!r})") from None
            self.where = {name: folder / file for name, file in weight_map.items()}
        else:
            files = sorted(folder.glob("*.safetensors"))
            pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
            if not files and pickles:
                raise CheckpointError(f"{folder}: its weights are {pickles[:3]}, torch.save pickles, which shardline "
                                      "never loads (unpickling runs code); convert them to safetensors with a tool "
                                      "you trust, or download the model's safetensors files")
            if not files:
                raise CheckpointError(f"{folder}: no *.safetensors file (and no model.safetensors.index.json)")
            self.where = {}
            for file in files:
                for name in self._handle(file).keys():
                    self.where[name] = file

    def _handle(self, file: Path):
        if file not in self._handles:
            if not file.is_file():
                raise CheckpointError(f"{file}: named by the index but missing")
            try:
                self._handles[file] = self._open(str(file), framework="pt")
            except Exception as error:  # safetensors raises its own SafetensorError for damage
                raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from None
        return self._handles[file]

    def slice(self, name: str):
        file = self.where[name]
        try:
            return self._handle(file).get_slice(name)
        except Exception as error:
            raise CheckpointError(f"{file}: tensor {name!r} cannot be read ({error})") from None


def _read(files: _Files, source: Source, placement: Placement, *, what: str, dtype: torch.dtype) -> torch.Tensor:
    """This rank's part (``placement.box`` of the dense tensor) of one parameter: the canonical boxes it covers,
    read from ``source.name`` and assembled (:func:`~shardline.plugins.checkpoint.boxes.read_part`). The
    checkpoint tensor must have exactly the canonical shape (a vocabulary may also keep shardline's padding rows,
    which are then read as they are)."""
    sl = files.slice(source.name)
    shape = tuple(sl.get_shape())
    stored = sl.get_dtype()
    if stored not in WEIGHT_DTYPES:
        raise CheckpointError(f"{files.where[source.name]}: tensor {source.name!r} {list(shape)} is stored as "
                              f"{stored}, not a float dtype ({', '.join(WEIGHT_DTYPES)}): a quantized checkpoint's "
                              "weights, which are not supported (cast to float they would be wrong weights); use "
                              "the model's float16, bfloat16 or float32 weights")
    want = tuple(placement.canonical_shape())
    if placement.kind is TensorKind.VOCAB:
        dense = placement.dense
        ok = len(shape) == len(dense) and shape[1:] == want[1:] and want[0] <= shape[0] <= dense[0]
        placement = dataclasses.replace(placement, vocab=shape[0])
    else:
        ok = shape == want
    if not ok:
        raise CheckpointError(f"{files.where[source.name]}: tensor {source.name!r} has shape {list(shape)}, "
                              f"{what} needs {list(want)}")
    return read_part(placement, lambda box: sl[tuple(slice(a, b) for a, b in box)], dtype=dtype).contiguous()


def from_pretrained(path: str | os.PathLike, *, grid=None, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None, activation_checkpointing: bool = False,
                    chunks: int = 1):
    """The shardline model of the Hugging Face folder ``path`` for ``grid``'s layout (dense when None).

    Built on the meta device, then each parameter is given this rank's slice from the checkpoint (see the module
    docstring); ``dtype`` defaults to torch's default dtype (float32), ``device`` to the CPU;
    ``activation_checkpointing`` recomputes every block in backward; under pp > 1 only this rank's stages of a
    ``pp * chunks`` cut are built and read (the model's per-rank construction). The model keeps the folder's
    ``config.json`` as ``model.hf_config`` for :func:`save_pretrained`.
    """
    folder = Path(path)
    arch, hf, config = read_config(folder)
    if activation_checkpointing:
        config = dataclasses.replace(config, activation_checkpointing=True)
    cls = _model_class(arch)
    if grid is not None:
        problems = cls.layout_problems(config, grid.dims)
        if problems:
            raise CheckpointError(f"{folder / 'config.json'}: the layout {grid.dims._summary()} cannot take this "
                                  f"model: " + "; ".join(problems))
    files = _Files(folder)
    dtype = dtype or torch.get_default_dtype()
    model = cls(config, grid=grid, dtype=dtype, device="meta", chunks=chunks)
    table = _table(arch, config)
    tp_group = grid.group("tp") if grid is not None else None
    tp, tp_rank = group_size(tp_group), group_rank(tp_group)
    params = dict(model.named_parameters())
    missing = sorted(table[name].name for name in params if name in table and table[name].name not in files.where)
    unmapped = sorted(set(params) - set(table))
    if unmapped:
        raise CheckpointError(f"{folder}: shardline parameters with no checkpoint source: {unmapped}")
    if missing:
        raise CheckpointError(f"{folder}: tensors missing from the checkpoint: {missing}")
    used = {s.name for s in table.values()}
    extra = sorted(n for n in files.where if n not in used and not n.endswith(IGNORED_SUFFIXES)
                   and not (n == "lm_head.weight" and config.tie_embeddings))
    if extra:
        raise CheckpointError(f"{folder}: checkpoint tensors shardline has no place for: {extra}")
    device = torch.device(device or "cpu")
    values, warned = {}, set()
    for name, param in params.items():
        source = table[name]
        placement = rank_placement(param, tuple(param.shape), source.kind, tp=tp, tp_rank=tp_rank,
                                   vocab=config.vocab_size, n_head=getattr(config, "n_head", None))
        tensor = _read(files, source, placement, dtype=dtype,
                       what=f"{name} (dense {list(placement.dense)}, this rank's {list(param.shape)})")
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(f"{files.where[source.name]}: tensor {source.name!r} gives {list(tensor.shape)} "
                                  f"for {name}, which needs {list(param.shape)} on this rank")
        values[name] = tensor.to(dtype=dtype, device=device)
        if source.name not in warned and _warn_nonfinite(values[name], files.where[source.name], source.name):
            warned.add(source.name)
    _materialise(model, values)
    model.hf_config = {**hf, "architectures": [arch]}
    return model


def _warn_nonfinite(tensor: torch.Tensor, file: Path, name: str) -> bool:
    """Warn (RuntimeWarning naming the file and tensor) when this rank's slice of a checkpoint tensor, as loaded,
    holds NaN or infinite values (stored so, or beyond the load dtype's range); True when it warned. Checked
    :data:`FINITE_CHUNK` elements at a time."""
    flat = tensor.detach().reshape(-1)
    bad = sum(int((~torch.isfinite(flat[i:i + FINITE_CHUNK])).sum()) for i in range(0, flat.numel(), FINITE_CHUNK))
    if bad:
        warnings.warn(f"{file}: tensor {name!r} holds {bad} NaN or infinite values of {flat.numel()} in this rank's "
                      f"part {list(tensor.shape)} (as {tensor.dtype}); training from it gives a non-finite loss",
                      RuntimeWarning, stacklevel=3)
    return bool(bad)


def _materialise(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Replace every meta parameter by a real one holding ``values[name]``, in every module slot that shares it
    (a tied weight stays one Parameter), keeping its attributes (the declared role)."""
    slots: dict[int, list] = {}
    for module in model.modules():
        for slot, param in parameter_table(module).items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, slot))
    for name, param in list(model.named_parameters()):
        real = torch.nn.Parameter(values.pop(name), requires_grad=param.requires_grad)
        real.__dict__.update(param.__dict__)
        for module, slot in slots[id(param)]:
            parameter_table(module)[slot] = real


# --- writing ---------------------------------------------------------------------------------------------------

def _canonical(source: Source, dense: torch.Tensor, config) -> torch.Tensor:
    """One dense shardline tensor as its canonical (Hugging Face) tensor: the checkpoint's transform of a
    placement over the whole tensor (:func:`~shardline.plugins.checkpoint.boxes.canonical_tensor`)."""
    placement = Placement(source.kind, tuple(dense.shape), full(dense.shape), vocab=config.vocab_size,
                          n_head=getattr(config, "n_head", None))
    return canonical_tensor(placement, dense)


@dataclass
class SafetensorsShards:
    """Safetensors shard files of at most ``limit`` bytes each (one tensor may exceed it alone)."""

    folder: Path
    limit: int
    pending: dict = field(default_factory=dict)
    size: int = 0
    files: list = field(default_factory=list)  # (file name, tensor names) per written file

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.limit:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.size += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.files.append((name, list(self.pending)))
        self.pending, self.size = {}, 0


def finish_folder(folder: Path, writer: SafetensorsShards, hf_config: dict, dtype: torch.dtype) -> None:
    """The last shard file, ``model.safetensors.index.json`` and ``config.json`` (with ``torch_dtype`` and
    ``dtype`` set) of a folder whose tensors went through ``writer``."""
    writer.flush()
    weight_map = {tensor: file for file, names in writer.files for tensor in names}
    total = sum((folder / file).stat().st_size for file, _ in writer.files)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True))
    name = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": name, "dtype": name}, indent=2,
                                                   sort_keys=True))


def save_pretrained(model, path: str | os.PathLike, *, grid=None, max_shard_bytes: int = 2 << 30) -> None:
    """Write ``model`` (this rank's part of ``grid``'s layout; the whole model when None) as a Hugging Face folder.

    Collective when ``grid`` is given: every rank calls it. Rank 0 writes ``config.json``, the safetensors shard
    files and ``model.safetensors.index.json``; tensors reach it one at a time (module docstring)."""
    folder = Path(path)
    arch, hf = hf_config_of(model)
    config = model.config
    table = _table(arch, config)
    written: set[str] = set()
    order = []  # each checkpoint tensor once (a tied head copy is the embedding)
    for name, source in table.items():
        if source.name not in written:
            written.add(source.name)
            order.append(name)
    me = 0 if grid is None else grid.global_rank
    if me == 0:
        folder.mkdir(parents=True, exist_ok=True)
    local = dict(model.named_parameters())
    dtype = next(iter(local.values())).dtype if local else torch.float32
    writer = SafetensorsShards(folder, max_shard_bytes) if me == 0 else None
    if grid is None:
        for name in order:
            writer.add(table[name].name, _canonical(table[name], local[name].detach().cpu(), config))
    else:
        _gather_and_write(grid, local, order, table, writer, config, dtype)
    if me != 0:
        if dist.is_initialized():
            dist.barrier()
        return
    finish_folder(folder, writer, hf, dtype)
    if grid is not None and dist.is_initialized():
        dist.barrier()


def _gather_and_write(grid, local, order, table, writer, config, dtype) -> None:
    """Every tensor, in ``order``: its shards (``dtype``) from the tp ranks (dp = cp = 0) of the stage hosting it,
    to rank 0."""
    me, dims = grid.global_rank, grid.dims
    hosted = [name for name in order if name in local and local[name].device.type != "meta"]
    everyone: list = [None] * dims.world_size
    dist.all_gather_object(everyone, (grid.coords, hosted))
    for name in order:
        holders = [rank for rank, (coords, names) in enumerate(everyone)
                   if name in names and coords["dp"] == 0 and coords["cp"] == 0]
        pp_ranks = sorted({everyone[r][0]["pp"] for r in holders})
        if not pp_ranks:
            raise CheckpointError(f"no rank holds {name} (layout {dims._summary()})")
        stage = [r for r in holders if everyone[r][0]["pp"] == pp_ranks[0]]
        stage.sort(key=lambda r: everyone[r][0]["tp"])
        shards = []
        if me in stage:
            tensor = local[name].detach().contiguous()
            shape = torch.tensor(tensor.shape, dtype=torch.int64)
            role = role_of(local[name])
            meta = torch.tensor([tensor.dim(), role.dim if role.kind is RoleKind.SHARDED else -1], dtype=torch.int64)
            if me != 0:
                dist.send(meta, dst=0)
                dist.send(shape, dst=0)
                dist.send(tensor, dst=0)
            else:
                shards.append((tensor, int(meta[1])))
        if me == 0:
            for src in stage:
                if src == 0:
                    continue
                meta = torch.empty(2, dtype=torch.int64)
                dist.recv(meta, src=src)
                shape = torch.empty(int(meta[0]), dtype=torch.int64)
                dist.recv(shape, src=src)
                tensor = torch.empty(tuple(shape.tolist()), dtype=dtype)
                dist.recv(tensor, src=src)
                shards.append((tensor, int(meta[1])))
            dim = shards[0][1]
            dense = shards[0][0] if dim < 0 else torch.cat([t for t, _ in shards], dim=dim)
            writer.add(table[name].name, _canonical(table[name], dense.cpu(), config))


__all__ = ["from_pretrained", "save_pretrained", "read_config", "finish_folder", "CheckpointError", "ARCHITECTURES",
           "SafetensorsShards"]
