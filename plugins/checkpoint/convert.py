"""A shardline checkpoint out of the training layout, in one process: to a Hugging Face folder or to one
consolidated PyTorch state dict. No process group, no DeepSpeed, no training layout is started.

Both read the checkpoint's canonical tensors (:mod:`.files`, every piece CRC-checked, coverage checked) and the
manifest's ``models`` (one entry per shardline decoder model in the LightningModule: where it sits, its
architecture, its ``config.json`` and its shardline config). The dense shardline model is built on the meta
device from that config (nothing allocated, nothing drawn) only to know every parameter's name and dense shape.

:func:`to_hf` writes one decoder model (``model_index``) as a folder ``transformers.AutoModelForCausalLM``
loads: ``config.json`` (the manifest's, with ``torch_dtype``/``dtype`` set), safetensors shard files of at most
``max_shard_bytes`` and ``model.safetensors.index.json``, exactly what :func:`shardline.plugins.hf.save_pretrained`
writes for the same weights (same files, bit for bit). It streams: one canonical tensor is read, cast and handed
to the shard writer at a time, so it holds at most about one shard file of weights (plus the tensor in hand and
the safetensors serialisation of the file being written) whatever the model's size. Canonical tensors *are*
Hugging Face's names and layout, so nothing is converted; a tied head is the embedding, written once.
Optimizer states are never written; LightningModule parameters outside the decoder are not either, and a
warning names them.

:func:`to_state_dict` writes one ``torch.save`` file that is an ordinary Lightning checkpoint of the dense
module: ``state_dict`` maps every LightningModule state-dict key (``lm.blocks.0.qkv.q_weight``; a tied weight
under both of its names, one shared tensor) to the dense tensor in shardline's own layout (canonical tensors
mapped back by :func:`~.boxes.from_canonical` over the whole tensor: tp = 1, no vocabulary padding), and the
trainer's ``epoch``, ``global_step``, ``pytorch-lightning_version`` and hyper-parameters. So
``Module.load_from_checkpoint(path)`` (single process, no strategy) or ``module.load_state_dict(sd["state_dict"])``
on a dense module gives the trained model. Not kept: loops, callbacks, LR schedulers and Lightning's
``optimizer_states`` (resuming training uses the shardline checkpoint itself). The file loads with
``torch.load(path, weights_only=True)``.

With ``optimizer=True`` it also holds ``sd["shardline_optimizer"]``::

    {"state_keys": ["exp_avg", "exp_avg_sq"],       # the manifest's optimizer_state_keys
     "step": 3,                                      # the optimizer's step count
     "param_groups": [{"lr": ..., "betas": ..., ...}],  # hyper-parameters per group, without "params"
     "state": {"lm.blocks.0.qkv.q_weight": {"exp_avg": tensor, "exp_avg_sq": tensor}, ...}}

``state`` is keyed by the module's parameter names (``named_parameters()``: a tied weight once, under its
first name), each state shaped and laid out like the parameter; a parameter without saved states is absent.

:func:`migrate` rewrites a checkpoint of format version 1 or 2, whose trainer and per-rank state files are
``torch.save`` pickles, as a version-3 one whose state files are data (:mod:`.state`). It unpickles those files,
which runs whatever code their author put in them, so it runs only when told to trust them (``trust=True``,
``shardline convert --migrate --trust``): for a checkpoint you or someone you trust wrote, never a downloaded one.
The shard files are hard-linked (copied where the filesystem cannot link) and the tensors left as they are.

Bad input raises :class:`~shardline.plugins.hf.CheckpointError` naming the checkpoint, the tensor and the
numbers before anything is written: no decoder model, a missing or misshapen tensor, a bad ``dtype``, an
output that already exists. Outputs appear atomically (written beside under a temporary name, then renamed).
"""

from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from shardline.job.families import FAMILIES
from shardline.plugins import hf
from shardline.plugins.checkpoint import files, state
from shardline.plugins.checkpoint.boxes import Placement, TensorKind, full
from shardline.plugins.checkpoint.files import MANIFEST, TRAINER_FILE, AtomicSave, resolve
from shardline.plugins.checkpoint.names import STATE
from shardline.plugins.checkpoint.reader import CheckpointReader
from shardline.plugins.errors import CheckpointError
from shardline.plugins.models import model_class

DEFAULT_MAX_SHARD_BYTES = 2 << 30
#: What of the trainer's state (its state file) the consolidated file keeps.
TRAINER_KEYS = ("epoch", "global_step", "pytorch-lightning_version", "hparams_name", "hyper_parameters",
                "datamodule_hparams_name", "datamodule_hyper_parameters")


@dataclass(frozen=True)
class Converted:
    """What a conversion wrote: ``out``, from ``checkpoint`` (the resolved folder), ``tensors`` and their
    ``nbytes``, and the checkpoint's model tensors it left out (``not_written``; optimizer states not listed)."""

    out: Path
    checkpoint: Path
    tensors: int
    nbytes: int
    not_written: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Param:
    """One state-dict entry: ``key`` in the LightningModule, ``name`` canonical; ``weight``: a decoder
    parameter of the Hugging Face table (what :func:`to_hf` writes)."""

    key: str
    name: str
    placement: Placement
    is_param: bool
    weight: bool = False


@dataclass(frozen=True)
class _Decoder:
    prefix: str
    arch: str
    hf_config: dict
    params: tuple[_Param, ...]  # state-dict order; a tied weight under each of its keys
    table_order: tuple[str, ...]  # the table's shardline names, in its order

    def weights(self) -> list[_Param]:
        """The table's canonical tensors, each once, in the table's order (what save_pretrained writes)."""
        by_key = {p.key.removeprefix(self.prefix): p for p in self.params if p.weight}
        seen, out = set(), []
        for key in self.table_order:
            p = by_key[key]
            if p.name not in seen:
                seen.add(p.name)
                out.append(p)
        return out


def parse_dtype(value) -> torch.dtype | None:
    """None, a torch dtype or one of ``hf.DTYPES``'s names (``"bfloat16"``); CheckpointError otherwise."""
    if value is None or isinstance(value, torch.dtype) and value in hf.DTYPES.values():
        return value
    if isinstance(value, str) and value in hf.DTYPES:
        return hf.DTYPES[value]
    raise CheckpointError(f"dtype={value!r} is not supported (one of {sorted(hf.DTYPES)})")


def _decoders(reader: CheckpointReader) -> list[_Decoder]:
    """Every decoder model of the manifest, its dense model built on the meta device from its config."""
    where = reader.folder / MANIFEST
    out = []
    for i, entry in enumerate(reader.manifest.get("models") or []):
        arch = entry.get("architecture")
        if arch not in hf.ARCHITECTURES:
            raise CheckpointError(f"{where}: models[{i}] has architecture {arch!r} (supported: "
                                  f"{sorted(hf.ARCHITECTURES)})")
        family = FAMILIES[hf.ARCHITECTURES[arch]]
        cls = model_class(family.name)
        try:
            config = cls.config_type(**entry["config"])
            model = cls(config, device="meta")
        except (TypeError, ValueError, KeyError) as error:  # ContractError is a TypeError
            raise CheckpointError(f"{where}: models[{i}] ({arch}) has a config shardline cannot build: "
                                  f"{error}") from None
        table = family.hf_table(config)
        n_head, params = getattr(config, "n_head", None), []
        names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        for key, tensor in model.state_dict(keep_vars=True).items():
            source = table.get(key)
            name, kind = (source.name, source.kind) if source else (entry["prefix"] + key, TensorKind.PLAIN)
            placement = Placement(kind=kind, dense=tuple(tensor.shape), box=full(tensor.shape),
                                  vocab=config.vocab_size, n_head=n_head)
            params.append(_Param(entry["prefix"] + key, name, placement, is_param=key in names,
                                 weight=key in names and source is not None))
        unmapped = sorted(set(table) - {p.key.removeprefix(entry["prefix"]) for p in params if p.weight})
        if unmapped:  # a table entry the model does not have: the config and the table disagree
            raise CheckpointError(f"{where}: models[{i}] ({arch}): no parameter for table entries {unmapped}")
        out.append(_Decoder(entry["prefix"], arch, dict(entry["hf_config"]), tuple(params), tuple(table)))
    return out


def _check(reader: CheckpointReader, params: list[_Param]) -> None:
    """Every tensor ``params`` needs is in the checkpoint with the canonical shape its config implies."""
    where = reader.folder / MANIFEST
    for p in params:
        if p.name not in reader.tensors:
            raise CheckpointError(f"{where}: no tensor {p.name!r} (the model's {p.key})")
        want, have = tuple(p.placement.canonical_shape()), reader.shape(p.name)
        if want != have:
            raise CheckpointError(f"{where}: tensor {p.name!r} has shape {list(have)}, the model's config needs "
                                  f"{list(want)} for {p.key}")


def _free(out: Path, *, folder: bool) -> None:
    """Refuse an existing output (an empty folder may stand where a folder goes)."""
    if out.exists() and not (folder and out.is_dir() and not any(out.iterdir())):
        raise CheckpointError(f"{out}: already exists (convert writes a new {'folder' if folder else 'file'}; "
                              "remove it first)")


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _left_out(reader: CheckpointReader, written: set[str]) -> tuple[str, ...]:
    return tuple(n for n in reader.tensors if not n.startswith("optimizer.") and n not in written)


def _warn_left_out(reader: CheckpointReader, names: tuple[str, ...], why: str) -> None:
    if names:
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        warnings.warn(f"{reader.folder}: {len(names)} tensors not written ({why}): {shown}", stacklevel=3)


def to_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, *, dtype=None,
          max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, model_index: int = 0) -> Converted:
    """Write decoder model ``model_index`` of ``checkpoint`` (a checkpoint folder, or a folder of them: its
    newest complete one) as the Hugging Face folder ``out``, streaming (module docstring). ``dtype`` (a torch
    dtype or ``"bfloat16"``/``"float16"``/``"float32"``/``"float64"``) casts every weight; default: as saved."""
    dtype = parse_dtype(dtype)
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes < 1:
        raise CheckpointError(f"max_shard_bytes={max_shard_bytes!r} must be an integer >= 1")
    folder = resolve(checkpoint)
    reader = CheckpointReader(folder)
    decoders = _decoders(reader)
    if not decoders:
        raise CheckpointError(f"{folder / MANIFEST}: the checkpoint holds no shardline decoder model (module "
                              f"{reader.manifest.get('module')!r}), so there is nothing to write as Hugging Face")
    if not 0 <= model_index < len(decoders):
        raise CheckpointError(f"{folder / MANIFEST}: model_index={model_index}, the checkpoint holds "
                              f"{len(decoders)} decoder models (prefixes {[d.prefix for d in decoders]})")
    decoder = decoders[model_index]
    weights = decoder.weights()
    _check(reader, weights)
    out = Path(out)
    _free(out, folder=True)
    written = {p.name for p in weights}
    left_out = _left_out(reader, written)
    _warn_left_out(reader, left_out, f"not weights of the decoder model at {decoder.prefix!r}")
    staging = AtomicSave(out, AtomicSave.new_token()).tmp
    staging.mkdir(parents=True)
    writer, nbytes, first = hf.SafetensorsShards(staging, max_shard_bytes), 0, None
    try:
        for p in weights:  # one canonical tensor in memory at a time, plus the writer's pending shard
            tensor = _cast(reader.read(p.name), dtype)
            first = tensor.dtype if first is None else first
            nbytes += tensor.numel() * tensor.element_size()
            writer.add(p.name, tensor)
            del tensor
        writer.flush()
        hf.finish_folder(staging, writer, decoder.hf_config, dtype or first)
        os.replace(staging, out)
    except _write_errors() as error:
        raise _not_written(out, error) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Converted(out=out, checkpoint=folder, tensors=len(weights), nbytes=nbytes, not_written=left_out)


def _write_errors() -> tuple[type[BaseException], ...]:
    """What a failed write raises: the OS's error, safetensors' (``SafetensorError``: "No space left on device"
    inside) and torch.save's (a RuntimeError from its zip writer)."""
    from safetensors import SafetensorError

    return OSError, SafetensorError, RuntimeError


def _not_written(out: Path, error: BaseException) -> CheckpointError:
    said = " ".join(str(error).split())[:300]
    return CheckpointError(f"{out}: could not be written ({type(error).__name__}: {said}); nothing was written "
                           "(a full disk or an unwritable folder?)")


def _dense(reader: CheckpointReader, name: str, placement: Placement, dtype) -> torch.Tensor:
    """Canonical tensor ``name`` in shardline's dense layout (``placement`` over the whole tensor)."""
    return _cast(reader.read_part(name, placement).contiguous(), dtype)


def to_state_dict(checkpoint: str | os.PathLike, out: str | os.PathLike, *, dtype=None,
                  optimizer: bool = False) -> Converted:
    """Write ``checkpoint`` (a checkpoint folder, or a folder of them) as one consolidated Lightning checkpoint
    file ``out`` of the dense module (module docstring); ``dtype`` casts every floating tensor (optimizer
    states included); default: as saved."""
    dtype = parse_dtype(dtype)
    folder = resolve(checkpoint)
    reader = CheckpointReader(folder)
    decoders = _decoders(reader)
    params = [p for d in decoders for p in d.params]
    _check(reader, params)
    out = Path(out)
    _free(out, folder=False)
    trainer = reader.state_file(TRAINER_FILE)
    claimed = {p.name for p in params}
    # Every other tensor (not an optimizer state) is a LightningModule parameter or buffer outside the
    # decoders: its canonical name is its module path and its canonical layout is its dense one.
    others = [_Param(n, n, Placement(TensorKind.PLAIN, reader.shape(n), full(reader.shape(n))), True)
              for n in _left_out(reader, claimed)]
    values: dict[str, torch.Tensor] = {}
    state_dict = {}
    for p in params + others:
        if p.name not in values:
            values[p.name] = _dense(reader, p.name, p.placement, dtype)
        state_dict[p.key] = values[p.name]  # a tied weight: one tensor under both keys
    result = {k: trainer[k] for k in TRAINER_KEYS if k in trainer}
    result["state_dict"] = state_dict
    result["shardline"] = {"converted_from": str(folder), "module": reader.manifest.get("module"),
                           "models": reader.manifest.get("models") or []}
    if optimizer:
        result["shardline_optimizer"] = _optimizer_states(reader, trainer, params + others, dtype)
    nbytes = sum(t.numel() * t.element_size() for t in values.values())
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = out.parent / f".{out.name}.partial-{AtomicSave.new_token()}"
    try:
        torch.save(result, staged)
        os.replace(staged, out)
    except _write_errors() as error:
        raise _not_written(out, error) from None
    finally:
        staged.unlink(missing_ok=True)
    return Converted(out=out, checkpoint=folder, tensors=len(values), nbytes=nbytes)


def _optimizer_states(reader: CheckpointReader, trainer: dict, params: list[_Param], dtype) -> dict:
    """``shardline_optimizer`` (module docstring): each parameter's saved states in its dense layout."""
    keys = list(reader.manifest.get("optimizer_state_keys") or [])
    saved = trainer.get("shardline_optimizer") or {}
    state, seen = {}, set()
    for p in params:
        if not p.is_param or p.name in seen:
            continue
        seen.add(p.name)
        moments = {key: _dense(reader, STATE.format(key=key, name=p.name), p.placement, dtype) for key in keys
                   if STATE.format(key=key, name=p.name) in reader.tensors}
        if moments:
            state[p.key] = moments
    return {"state_keys": keys, "step": saved.get("step"), "param_groups": saved.get("param_groups", []),
            "state": state}


TRUST = ("unpickling runs whatever code the file's author put in it: migrate only a checkpoint that you, or "
         "someone you trust, wrote (never one you downloaded), and say so with --trust")


def migrate(checkpoint: str | os.PathLike, out: str | os.PathLike, *, trust: bool = False) -> Converted:
    """Rewrite ``checkpoint`` (format version 1 or 2: pickled state files) as the version-3 checkpoint folder
    ``out``, whose state files are data (module docstring). ``trust=True`` is required: it unpickles them."""
    if trust is not True:
        raise CheckpointError(f"{checkpoint}: migrating a checkpoint unpickles its trainer.pt and rank-N.pt, and "
                              + TRUST)
    folder = resolve(checkpoint)
    reader = CheckpointReader(folder)
    if reader.version >= files.DATA_STATE:
        raise CheckpointError(f"{folder / MANIFEST}: already format version {reader.version}, which holds no "
                              "pickle: nothing to migrate")
    out = Path(out)
    _free(out, folder=True)
    staging = AtomicSave(out, AtomicSave.new_token()).tmp
    staging.mkdir(parents=True)
    listed, written, nbytes = {}, [], 0
    try:
        for name, info in reader.manifest["files"].items():
            if not name.endswith(".pt"):  # a shard file: the same bytes (a committed file never changes)
                _link_or_copy(folder / name, staging / name)
                listed[name] = info
                continue
            new = _state_name(name, folder)
            data = state.encode(reader.state_file(new, trust_pickle=True), where=str(folder / name))
            (staging / new).write_bytes(data)
            listed[new] = {"size": len(data), "crc32": reader.checksum.of(data)}
            written.append(staging / new)
            nbytes += len(data)
        manifest = {**reader.manifest, "version": files.VERSION, "checksum": reader.checksum.name,
                    "files": dict(sorted(listed.items()))}
        (staging / MANIFEST).write_text(files._manifest_text(manifest))
        files.fsync_all([*written, staging / MANIFEST])
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Converted(out=out, checkpoint=folder, tensors=len(reader.tensors), nbytes=nbytes)


def _state_name(legacy: str, folder: Path) -> str:
    """The version-3 name of a version 1-2 state file (``trainer.pt``, ``rank-00003.pt``)."""
    if legacy == files.LEGACY_TRAINER_FILE:
        return TRAINER_FILE
    digits = legacy.removeprefix("rank-").removesuffix(".pt")
    if not (legacy.startswith("rank-") and digits.isascii() and digits.isdigit()):
        raise CheckpointError(f"{folder / legacy}: not a file of a shardline checkpoint (trainer.pt, rank-N.pt)")
    return files.rank_file(int(digits))


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


__all__ = ["Converted", "DEFAULT_MAX_SHARD_BYTES", "TRUST", "migrate", "parse_dtype", "to_hf", "to_state_dict"]
