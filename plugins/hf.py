"""Hugging Face checkpoints in and out: :func:`from_pretrained` and :func:`save_pretrained`.

A Hugging Face model folder is ``config.json`` plus one ``model.safetensors`` or several shards with their
``model.safetensors.index.json``. Supported architectures (``config.json``'s ``architectures``):
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` (shardline's :class:`~.models.llama.Llama`)
and ``GPT2LMHeadModel`` (:class:`~.models.gpt.GPT`).

Loading builds the model for ``grid``'s layout on the meta device (nothing random is drawn, nothing is
allocated), then gives each parameter this rank's slice only, read lazily from the safetensors file
(``safe_open(...).get_slice``): a rank never holds more of a checkpoint tensor than it keeps. Every name,
fused tensor and padding lives in one table per architecture (its family's
:meth:`~shardline.job.family.Family.hf_table`, beside its ``config.json`` mapping, in :mod:`shardline.job.gpt` and
:mod:`shardline.job.llama`):

- Llama family: one tensor each; q/k/v stay separate (their per-head shards are plain row slices, also when
  ``tp > n_kv_heads``); the vocabulary is zero-padded to a multiple of tp on load and cut back on save;
- GPT-2: Conv1D weights are stored transposed (``[in, out]``) and ``c_attn`` fuses q, k and v as three blocks of
  columns, where shardline's fused projection interleaves them per head: both are converted here; the output
  projection is tied to ``wte``.

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

One file: loading and saving are the two directions of the same per-architecture name tables and conversions
(fused q/k/v, transposed Conv1D, vocabulary padding), which must change together.
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

from shardline.job.families import FAMILIES, HF_ARCHITECTURES, config_from_hf, family_of_config
from shardline.job.family import Source
from shardline.plugins.errors import CheckpointError, ContractError
from shardline.plugins.layers.roles import RoleKind, role_of
from shardline.plugins.layers.tp_comm import group_rank, group_size

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

def _table(arch: str, config, hf: dict | None = None) -> dict[str, Source]:
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


def _read(files: _Files, source: Source, dense_shape: tuple[int, ...], shard: tuple[int | None, int, int], *,
          n_head: int | None, padding: int, what: str) -> torch.Tensor:
    """This rank's part of one parameter: ``shard`` = (dim, start, stop) of the dense tensor of ``dense_shape``
    (dim None: all of it). The checkpoint tensor must have exactly the dense shape in its own layout (a
    vocabulary may be up to ``padding`` rows shorter: shardline's zero rows)."""
    sl = files.slice(source.name)
    shape = tuple(sl.get_shape())
    stored = sl.get_dtype()
    if stored not in WEIGHT_DTYPES:
        raise CheckpointError(f"{files.where[source.name]}: tensor {source.name!r} {list(shape)} is stored as "
                              f"{stored}, not a float dtype ({', '.join(WEIGHT_DTYPES)}): a quantized checkpoint's "
                              "weights, which are not supported (cast to float they would be wrong weights); use "
                              "the model's float16, bfloat16 or float32 weights")
    dim, start, stop = shard
    if dim is None:
        dim, start, stop = 0, 0, dense_shape[0]
    if source.kind == "vocab":
        want = (dense_shape[0] - padding, *dense_shape[1:])
        ok = len(shape) == len(dense_shape) and shape[1:] == dense_shape[1:] and want[0] <= shape[0] <= dense_shape[0]
    elif source.kind == "conv1d":
        want = (dense_shape[1], dense_shape[0])
    elif source.kind == "gpt2_qkv":  # ours [3d, d] (head-interleaved); theirs [d, 3d] (q|k|v blocks)
        want = (dense_shape[1], dense_shape[0])
    else:  # plain, and gpt2_qkv_bias ([3d] on both sides)
        want = dense_shape
    if source.kind != "vocab":
        ok = shape == tuple(want)
    if not ok:
        raise CheckpointError(f"{files.where[source.name]}: tensor {source.name!r} has shape {list(shape)}, "
                              f"{what} needs {list(want)}")
    index = [slice(None)] * len(shape)
    if source.kind in ("plain", "vocab"):
        index[dim] = slice(min(start, shape[dim]), min(stop, shape[dim]))
        part = sl[tuple(index)]
        pad = (stop - start) - part.shape[dim]
        return torch.cat([part, part.new_zeros((pad, *part.shape[1:]))]) if pad else part
    if source.kind == "conv1d":
        index[1 - dim] = slice(start, stop)
        return sl[tuple(index)].t().contiguous()
    # GPT-2's c_attn: ours rows ordered (head, q|k|v, head_dim); theirs columns ordered (q|k|v, head, head_dim)
    bias = source.kind == "gpt2_qkv_bias"
    d_model = dense_shape[0] // 3
    head_dim = d_model // n_head
    h0, h1 = start // (3 * head_dim), stop // (3 * head_dim)
    parts = []
    for j in range(3):
        cols = slice(j * d_model + h0 * head_dim, j * d_model + h1 * head_dim)
        block = sl[cols] if bias else sl[:, cols].t()
        parts.append(block.reshape(h1 - h0, head_dim, *block.shape[1:]))
    return torch.stack(parts, dim=1).reshape(3 * (h1 - h0) * head_dim, *parts[0].shape[2:]).contiguous()


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
    table = _table(arch, config, hf)
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
        role = role_of(param)
        dense, shard = list(param.shape), (None, 0, 0)
        if role.kind is RoleKind.SHARDED:
            length = param.shape[role.dim]
            dense[role.dim] = length * tp
            shard = (role.dim, tp_rank * length, (tp_rank + 1) * length)
        padding = dense[0] - config.vocab_size if source.kind == "vocab" else 0
        tensor = _read(files, source, tuple(dense), shard, n_head=getattr(config, "n_head", None),
                       padding=padding, what=f"{name} (dense {dense}, this rank's {list(param.shape)})")
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
        for slot, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, slot))
    for name, param in list(model.named_parameters()):
        real = torch.nn.Parameter(values.pop(name), requires_grad=param.requires_grad)
        real.__dict__.update(param.__dict__)
        for module, slot in slots[id(param)]:
            module._parameters[slot] = real


# --- writing ---------------------------------------------------------------------------------------------------

def _hf_config_of(model) -> tuple[str, dict]:
    """``(architecture, config.json)`` for ``model``: the loaded folder's, else derived from its config."""
    config = model.config
    if getattr(model, "hf_config", None):
        hf = dict(model.hf_config)
        return hf["architectures"][0], hf
    return family_of_config(config).config_to_hf(config)


def _to_hf(source: Source, dense: torch.Tensor, *, vocab: int, n_head: int) -> torch.Tensor:
    """One dense shardline tensor in the checkpoint's layout (the inverse of :func:`_read` on a whole tensor)."""
    if source.kind == "vocab":
        return dense[:vocab]
    if source.kind == "conv1d":
        return dense.t()
    if source.kind in ("gpt2_qkv", "gpt2_qkv_bias"):
        d_model = dense.shape[0] // 3
        head_dim = d_model // n_head
        grouped = dense.reshape(n_head, 3, head_dim, *dense.shape[1:]).transpose(0, 1)  # (3, heads, hd, ...)
        flat = grouped.reshape(3 * d_model, *dense.shape[1:])
        return flat if source.kind == "gpt2_qkv_bias" else flat.t()
    return dense


@dataclass
class _Writer:
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


def finish_folder(folder: Path, writer: _Writer, hf_config: dict, dtype: torch.dtype) -> None:
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
    arch, hf = _hf_config_of(model)
    config = model.config
    table = _table(arch, config, hf)
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
    writer = _Writer(folder, max_shard_bytes) if me == 0 else None
    n_head = getattr(config, "n_head", 1)
    if grid is None:
        for name in order:
            writer.add(table[name].name, _to_hf(table[name], local[name].detach().cpu(), vocab=config.vocab_size,
                                                n_head=n_head))
    else:
        _gather_and_write(grid, local, order, table, writer, config, n_head, dtype)
    if me != 0:
        if dist.is_initialized():
            dist.barrier()
        return
    finish_folder(folder, writer, hf, dtype)
    if grid is not None and dist.is_initialized():
        dist.barrier()


def _gather_and_write(grid, local, order, table, writer, config, n_head, dtype) -> None:
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
            writer.add(table[name].name, _to_hf(table[name], dense.cpu(), vocab=config.vocab_size, n_head=n_head))


__all__ = ["from_pretrained", "save_pretrained", "read_config", "CheckpointError", "ARCHITECTURES"]
