"""Language-modelling data that needs no download: the Python standard library's sources, or the user's own
text; byte-level, or tokenised with a Hugging Face tokenizer (``tokenizer``: a ``tokenizer.json`` or a folder
holding one, e.g. the checkpoint given as ``model.init_from``).

The corpus is one byte string: the files in a fixed order (sorted by their path relative to the root, compared
as POSIX strings), each followed by one ``\\n``, truncated at ``max_bytes``. The vocabulary is the 256 byte
values. The last ``val_fraction`` of the corpus (whole windows) is the validation split, the rest the training
split; the training targets end at the byte where the validation windows begin.

A split of ``n`` bytes holds ``(n - 1) // seq_len`` windows; window ``i`` is

    ids     = corpus[start + i*seq_len     : start + (i+1)*seq_len]
    targets = corpus[start + i*seq_len + 1 : start + (i+1)*seq_len + 1]

(int64 tensors of length ``seq_len``), i.e. every byte after the first is predicted exactly once per epoch. With a
tokenizer the same holds for token ids: the corpus is decoded as UTF-8 (invalid bytes replaced), encoded once
without special tokens, and cut into windows of tokens.
Nothing is random here: shuffling is the sampler's business (Lightning's distributed sampler, seeded).

The training loader is a :class:`ResumableDataLoader`: a checkpoint records its position inside the epoch, and a
run resumed from it (``ckpt_path``) continues with the next batch instead of starting the epoch again.
"""

from __future__ import annotations

import fnmatch
import inspect
import os
import sysconfig
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from shardline.plugins.errors import ContractError
from shardline.plugins.torch_compat import check_index_sampler
from shardline.recipes.schema import RecipeError

VOCAB_SIZE = 256
# Folders under the stdlib root that hold other people's packages, not the standard library.
_NOT_STDLIB = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(path: str | Path | None = None, *, pattern: str | None = None) -> list[Path]:
    """The files of the corpus, in corpus order.

    ``path=None``: the standard library's ``*.py`` files (third-party package folders excluded). A file: that
    file alone. A folder: every file under it whose name matches ``pattern`` (default: every file), skipping
    hidden files and folders. RecipeError (naming ``data.path``) when the path does not exist or holds no file.
    """
    if path is None:
        root, pattern, skip = stdlib_root(), pattern or "*.py", _NOT_STDLIB
    else:
        root, pattern, skip = Path(path).expanduser(), pattern or "*", frozenset()
        if root.is_file():
            return [root]
        if not root.is_dir():
            raise RecipeError(f"data.path={str(path)!r} is neither a file nor a folder")
    files = []
    for folder, subfolders, names in os.walk(root):
        # Pruned while walking: the stdlib root can hold a large site-packages.
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in skip]
        files += [Path(folder, n) for n in names if not n.startswith(".") and fnmatch.fnmatch(n, pattern)]
    if not files:
        raise RecipeError(f"data.path={str(root)!r} holds no file matching data.pattern={pattern!r}")
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def read_corpus(files: list[Path], *, max_bytes: int) -> bytes:
    """The files' bytes, each followed by ``\\n``, concatenated in order and cut at ``max_bytes``."""
    chunks, size = [], 0
    for file in files:
        if size >= max_bytes:
            break
        data = file.read_bytes() + b"\n"
        chunks.append(data)
        size += len(data)
    return b"".join(chunks)[:max_bytes]


def tokenizer_file(path: str | Path | None) -> Path | None:
    """The ``tokenizer.json`` that ``path`` names (the file, or a folder holding one); None when there is none."""
    if not path:
        return None
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".json":
        return path
    candidate = path / "tokenizer.json"
    return candidate if candidate.is_file() else None


def tokenizer_class(path: Path):
    """``tokenizers.Tokenizer``; RecipeError naming ``path`` and the extra to install when it is missing."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise RecipeError(f"{path}: reading a Hugging Face tokenizer needs the tokenizers package: "
                          "pip install 'shardline[hf]'") from None
    return Tokenizer


def tokenize(corpus: bytes, tokenizer: Path) -> torch.Tensor:
    """The corpus's token ids (int32) under the Hugging Face tokenizer at ``tokenizer``."""
    Tokenizer = tokenizer_class(tokenizer)

    try:
        encoder = Tokenizer.from_file(str(tokenizer))
    except Exception as error:  # the tokenizers library raises its own Exception for a bad file
        raise RecipeError(f"data.tokenizer={str(tokenizer)!r} is not a readable tokenizer.json ({error})") from None
    ids = encoder.encode(corpus.decode("utf-8", errors="replace"), add_special_tokens=False).ids
    return torch.tensor(ids, dtype=torch.int32)


class ByteWindows(Dataset):
    """Fixed ``seq_len`` windows over a 1-d tensor of bytes (uint8) or token ids (int32/int64); item ``i`` is
    ``(ids, targets)`` as in the module docstring."""

    def __init__(self, data: torch.Tensor, *, seq_len: int):
        if data.dtype not in (torch.uint8, torch.int32, torch.int64) or data.dim() != 1:
            raise TypeError(f"data must be a 1-d uint8/int32/int64 tensor, got {data.dtype} with shape "
                            f"{tuple(data.shape)}")
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = index * self.seq_len
        chunk = self.data[start:start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


_STATE_KEYS = ("epoch", "batches", "length", "samples", "rng")
#: Since format version 3 of the checkpoint: what maps a position onto another data-parallel size or batch size.
_GLOBAL_KEYS = ("replicas", "batch_size", "order")
_END = object()


@dataclass
class _Pass:
    """One pass over a ResumableDataLoader: its epoch (known at its first draw of indices), the batches skipped
    at its start (a resumed epoch), the batches returned since, and the RNG sources as they were before its first
    draw."""

    epoch: int | None = None
    skipped: int = 0
    returned: int = 0
    rng: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class _Resume:
    """A loaded position, for the next pass: skip ``batches`` batches of ``epoch``, drawn from ``rng``."""

    epoch: int
    batches: int
    rng: dict[str, torch.Tensor]


class _Indices:
    """What torch's iterator draws indices from: the loader's batch sampler (or its sampler, without batching),
    each pass going through ``ResumableDataLoader._draw``."""

    def __init__(self, loader: ResumableDataLoader, indices):
        self._loader, self._indices = loader, indices

    def __len__(self) -> int:
        return len(self._indices)

    def __iter__(self) -> Iterator:
        return self._loader._draw(self._indices)


class _Counting:
    """The loader's iterator: torch's, counting the batches it returns. ``lazy``: torch's iterator is created at
    the first ``next()`` rather than now."""

    def __init__(self, current: _Pass, start: Callable[[], Iterator], *, lazy: bool):
        self._current, self._start = current, start
        self._inner = None if lazy else start()

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        if self._inner is None:
            self._inner = self._start()
        batch = next(self._inner)
        self._current.returned += 1
        return batch


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` (the same arguments) whose position inside the epoch survives a checkpoint.

    It has Lightning's ``_Stateful`` interface, so Lightning saves ``state_dict()`` under
    ``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]`` and passes it to ``load_state_dict`` when
    a run resumes (``ckpt_path``). What this relies on (Lightning 2.6):

    - ``state_dict()`` runs inside ``trainer.save_checkpoint`` (``ModelCheckpoint`` at ``on_train_batch_end`` of
      step s, or at an epoch's end). Lightning's fetcher reads a batch ahead only from a loader without a length;
      this one always has one, so the batches its iterator has *returned* are the batches the training loop
      consumed: that count is the position. Indices drawn are not: with ``num_workers > 0`` torch's iterator
      sends ``prefetch_factor * num_workers`` batches of indices ahead.
    - ``load_state_dict()`` runs in ``FitLoop.setup_data`` of the resumed run, on the loader Lightning iterates
      (re-created from this class's arguments when it injects a ``DistributedSampler``), just before ``iter()``;
      Lightning calls the sampler's ``set_epoch`` only after that ``iter()``.

    ``state_dict()``: ``epoch`` (the sampler's ``epoch`` where it has ``set_epoch``, e.g. a
    ``DistributedSampler``; else this loader's count of passes), ``batches`` (batches of that epoch consumed),
    ``length`` (batches per epoch) and ``samples`` (``len(dataset)``), both checked on load, and ``rng``: the RNG
    sources a sampler may draw from (``torch``: the global CPU RNG; ``generator``: the loader's, when given), as
    they were just before that epoch's first batch of indices was drawn.

    After ``load_state_dict`` the next pass continues the saved epoch. Its torch iterator is created at its first
    ``next()`` (by then Lightning has set the sampler's epoch, and workers start after that). If the sampler's
    epoch is the saved one, the pass skips the batch sampler's first ``batches`` batches (indices only: no sample
    is loaded), drawn from the saved RNG sources, so a ``RandomSampler`` repeats the saved order; a source the
    sampler did not draw from is then put back as it was, one it drew from is left where the uninterrupted run's
    was after that draw. Otherwise (``limit_train_batches`` ended the saved epoch early and Lightning moved on)
    the pass is a whole epoch, as is every later pass. ``batches == length`` is the start of the next epoch.

    RNG draws are a plain DataLoader's: creating an iterator draws one int64 base seed (the workers' seeds) from
    ``generator`` or else the global torch RNG; the sampler draws what it draws (``RandomSampler`` without a
    generator: one int64 seed from the global RNG at each epoch's first batch; ``DistributedSampler``: nothing,
    its order is ``seed + epoch``). ``state_dict`` and ``load_state_dict`` draw nothing. A resumed pass draws its
    base seed afresh (per-sample randomness inside workers is not replayed) at its first ``next()``.

    Another data-parallel size or batch size: ``state_dict()`` also records ``replicas`` (the sampler's
    ``num_replicas``, 1 without a ``DistributedSampler``), ``batch_size`` and ``order`` (the sampler's kind, and a
    ``DistributedSampler``'s ``seed`` and ``shuffle``). A ``DistributedSampler`` orders the whole dataset the same
    way whatever its ``num_replicas`` (a permutation of ``seed + epoch``, padded at its end) and deals it out
    round-robin, so after ``batches`` batches on every rank the epoch's first ``G = batches x batch_size x
    replicas`` samples of that order are consumed: the position in global samples. A loader of another length
    (another dp or batch size) over the same dataset resumes at batch ``G / (its replicas x its batch_size)`` of
    the epoch, exactly the samples the uninterrupted run at its layout would draw next, when both samplers are
    ``DistributedSampler`` samplers of the same seed and shuffle and ``G`` is a whole number of its global batches (the
    global batch kept does it). Otherwise it restarts the epoch, with a warning that says why; a saved position
    at the end of an epoch starts the next one. A dataset of another size is refused.

    Limits: one pass at a time (as Lightning iterates); Lightning saves rank 0's loop state, so every rank replays
    rank 0's RNG sources; a run resumed at an epoch boundary draws the next epoch's ``RandomSampler`` order from
    the RNG as it then is. Map-style datasets only (ContractError for an ``IterableDataset``).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if isinstance(self.dataset, IterableDataset):
            raise ContractError(f"ResumableDataLoader resumes by skipping sampler indices, and the "
                                f"{type(self.dataset).__name__} it was given is an IterableDataset, which has none")
        self._pass: _Pass | None = None
        self._resume: _Resume | None = None
        self._next_epoch = 0  # the next pass's epoch where the sampler has none

    # Lightning re-creates a DataLoader subclass (to inject its DistributedSampler) from the arguments it reads
    # off this signature, so it must be DataLoader's own.
    __init__.__signature__ = inspect.signature(DataLoader.__init__)

    @property
    def _index_sampler(self):
        # torch's iterators (and len()) take indices from this private DataLoader property (see _Indices),
        # checked to exist when this module loads (torch_compat.check_index_sampler).
        return _Indices(self, super()._index_sampler)

    def __iter__(self) -> Iterator:
        self._pass = _Pass()
        return _Counting(self._pass, super().__iter__, lazy=self._resume is not None)

    def state_dict(self) -> dict[str, Any]:
        """The position; see the class docstring."""
        if self._resume is not None:  # loaded, and nothing drawn since
            epoch, batches, rng = self._resume.epoch, self._resume.batches, self._resume.rng
        elif self._pass is None or self._pass.epoch is None:  # this pass has drawn nothing yet
            epoch = self._sampler_epoch()
            epoch, batches, rng = self._next_epoch if epoch is None else epoch, 0, {}
        else:
            epoch, batches, rng = self._pass.epoch, self._pass.skipped + self._pass.returned, self._pass.rng
        return {"epoch": epoch, "batches": batches, "length": len(self), "samples": len(self.dataset),
                "rng": dict(rng), "replicas": self._replicas(), "batch_size": self.batch_size, "order": self._order()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue at ``state_dict``'s position (see the class docstring). RecipeError naming every value that does
        not fit this loader: other keys, another length or dataset size, a position past the epoch's end, RNG
        sources this loader does not draw from."""
        keys = set(state_dict) if isinstance(state_dict, dict) else None
        if keys not in (set(_STATE_KEYS), set(_STATE_KEYS) | set(_GLOBAL_KEYS)):
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise RecipeError(f"the checkpoint's train-loader state has keys {got}, a ResumableDataLoader's has "
                              f"{sorted(_STATE_KEYS + _GLOBAL_KEYS)}")
        epoch, batches, length, samples, rng = (state_dict[key] for key in _STATE_KEYS)
        problems = [f"{name}={value!r} is not an integer >= 0" for name, value in
                    (("epoch", epoch), ("batches", batches), ("length", length), ("samples", samples))
                    if not isinstance(value, int) or isinstance(value, bool) or value < 0]
        moved = False
        if not problems:
            if batches > length:
                problems.append(f"batches={batches} is past the end of an epoch of length={length}")
            elif (length, samples) != (len(self), len(self.dataset)):
                if samples != len(self.dataset) or "order" not in state_dict:
                    problems.append(f"it was saved with length={length} batches per epoch over samples={samples}, "
                                    f"this loader has {len(self)} batches per epoch over {len(self.dataset)} "
                                    "samples (another batch size, dataset or number of data-parallel ranks?)")
                else:  # the same dataset, another dp or batch size: the same global sample where it can be
                    (epoch, batches), moved = self._moved(state_dict), True
            if not problems and 0 < batches < len(self) and (not isinstance(rng, dict)
                                                             or sorted(rng) != self._rng_sources()):
                held = sorted(rng) if isinstance(rng, dict) else type(rng).__name__
                problems.append(f"rng holds {held}, this loader draws from {self._rng_sources()}")
        if problems:
            raise RecipeError("the checkpoint's train-loader state does not fit this loader: " + "; ".join(problems))
        if not moved and batches == length:  # the end of an epoch is the start of the next
            epoch, batches = epoch + 1, 0
        for sampler in self._epoch_samplers():
            # With workers, torch draws indices at iter(), before Lightning's set_epoch: have the right one already.
            sampler.set_epoch(epoch)
        self._next_epoch = epoch
        self._resume = _Resume(epoch, batches, dict(rng) if batches else {})

    def _moved(self, state: dict[str, Any]) -> tuple[int, int]:
        """``(epoch, batches)`` of this loader for the saved position ``state`` of a loader of another length
        over the same dataset (another dp or batch size): the same global sample, or the epoch's start, warned."""
        epoch, batches, length = state["epoch"], state["batches"], state["length"]
        if batches == length:  # the end of an epoch: the next one starts, whatever the layout
            return epoch + 1, 0
        saved, now = state["order"], self._order()
        step = self._replicas() * (self.batch_size or 0)
        consumed = batches * (state["batch_size"] or 0) * state["replicas"]
        why = None
        if not (saved or {}).get("seed_based") or not now.get("seed_based"):
            why = (f"a {(saved or {}).get('sampler')} saved it and this loader has a {now.get('sampler')}: only a "
                   "DistributedSampler orders an epoch by its seed alone, the same for any dp or batch size")
        elif saved != now:
            why = (f"the saved order ({saved}) is not this loader's ({now}), so the same position in samples is "
                   "not the same samples")
        elif not state["batch_size"] or not step:
            why = "a batch sampler of its own gives no batch size to count samples with"
        elif consumed % step:
            why = (f"{consumed} samples of the epoch were consumed ({batches} batches x {state['batch_size']} x "
                   f"{state['replicas']} replicas), not a whole number of this run's global batches "
                   f"({self.batch_size} x {self._replicas()} replicas = {step}; keep the global batch to resume "
                   "exactly)")
        if why is not None:
            warnings.warn(f"resuming the train loader at the start of epoch {epoch}, not where it stopped: {why}",
                          UserWarning, stacklevel=3)
            return epoch, 0
        if consumed // step >= len(self):
            return epoch + 1, 0
        return epoch, consumed // step

    def _replicas(self) -> int:
        found = [s.num_replicas for s in self._epoch_samplers() if isinstance(s, DistributedSampler)]
        return int(found[0]) if found else 1

    def _order(self) -> dict[str, Any]:
        """How the sampler orders an epoch: a ``DistributedSampler``'s permutation depends only on its seed, the
        epoch and whether it shuffles (``seed_based``); any other sampler's is its own business."""
        for sampler in self._epoch_samplers():
            if isinstance(sampler, DistributedSampler):
                return {"sampler": "DistributedSampler", "seed": int(sampler.seed), "shuffle": bool(sampler.shuffle),
                        "seed_based": True}
        return {"sampler": type(self.sampler).__name__, "seed_based": False}

    def _draw(self, indices) -> Iterator:
        """One pass's batches of indices from ``indices``: the rest of the resumed epoch, or a whole epoch. Runs
        (as a generator) from the pass's first draw."""
        current, resume, self._resume = self._pass, self._resume, None
        epoch = self._sampler_epoch()
        current.epoch = self._next_epoch if epoch is None else epoch
        self._next_epoch = current.epoch + 1
        resumed = resume is not None and resume.batches > 0 and resume.epoch == current.epoch
        if resumed:
            current.rng, current.skipped = resume.rng, resume.batches
            before = self._rng_state()
            self._put_rng(resume.rng)
        else:
            current.rng = self._rng_state()
        batches = iter(indices)
        if resumed:
            for done in range(resume.batches):
                if next(batches, _END) is _END:
                    raise RecipeError(f"the checkpoint's train-loader position is batch {resume.batches} of epoch "
                                      f"{resume.epoch}, but this loader's sampler ends that epoch after {done} "
                                      f"batches although len(loader) = {len(self)}")
            for name, state in self._rng_state().items():
                if torch.equal(state, resume.rng[name]):  # the sampler did not draw from it: as it was
                    self._put_rng({name: before[name]})
        yield from batches

    def _epoch_samplers(self) -> list:
        """The samplers Lightning's ``set_epoch`` reaches: the loader's and its batch sampler's, where they have
        ``set_epoch``."""
        found = {}
        for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            if callable(getattr(sampler, "set_epoch", None)):
                found[id(sampler)] = sampler
        return list(found.values())

    def _sampler_epoch(self) -> int | None:
        epochs = [s.epoch for s in self._epoch_samplers() if isinstance(getattr(s, "epoch", None), int)]
        return epochs[0] if epochs else None

    def _rng_sources(self) -> list[str]:
        return ["generator", "torch"] if self.generator is not None else ["torch"]

    def _rng_state(self) -> dict[str, torch.Tensor]:
        state = {"torch": torch.get_rng_state()}
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def _put_rng(self, state: dict[str, torch.Tensor]) -> None:
        if "torch" in state:
            torch.set_rng_state(state["torch"])
        if "generator" in state:
            self.generator.set_state(state["generator"])


check_index_sampler(ResumableDataLoader)


class TextDataModule(pl.LightningDataModule):
    """LM data over the stdlib sources (``path=None``) or a text file/folder; see the module docstring.

    Args:
        path: a text file or a folder; None for the Python standard library's sources.
        pattern: glob for the files of a folder (default ``*.py`` for the stdlib, every file otherwise).
        seq_len: tokens per window; the fit command links it to ``model.seq_len``.
        batch_size: windows per batch on each data-parallel rank (TP/CP/PP ranks of one replica share it).
        val_fraction: share of the corpus, taken from its end, that is the validation split.
        max_bytes: the corpus is cut here (bytes).
        num_workers: DataLoader worker processes.
        tokenizer: a ``tokenizer.json`` or a folder with one; None (or a folder without one) for bytes. The fit
            command links it to ``model.init_from``.
    """

    def __init__(self, path: str | None = None, pattern: str | None = None, seq_len: int = 128,
                 batch_size: int = 8, val_fraction: float = 0.05, max_bytes: int = 4_000_000,
                 num_workers: int = 0, tokenizer: str | None = None):
        super().__init__()
        problems = [f"data.{name}={value!r} must be an integer >= 1" for name, value in
                    (("seq_len", seq_len), ("batch_size", batch_size), ("max_bytes", max_bytes))
                    if not isinstance(value, int) or isinstance(value, bool) or value < 1]
        if not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
            problems.append(f"data.val_fraction={val_fraction!r} must be a number in (0, 1)")
        if problems:
            raise RecipeError("; ".join(problems))
        self.save_hyperparameters()
        self.path, self.pattern = path, pattern
        self.seq_len, self.batch_size, self.num_workers = seq_len, batch_size, num_workers
        self.val_fraction, self.max_bytes = val_fraction, max_bytes
        self.tokenizer = tokenizer_file(tokenizer)
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        corpus = read_corpus(corpus_files(self.path, pattern=self.pattern), max_bytes=self.max_bytes)
        if self.tokenizer is not None:
            data, unit = tokenize(corpus, self.tokenizer), "tokens"
        else:
            data, unit = torch.frombuffer(bytearray(corpus), dtype=torch.uint8), "bytes"
        windows = (len(data) - 1) // self.seq_len
        n_val = max(1, round(windows * self.val_fraction))
        if windows - n_val < 1:
            raise RecipeError(f"the corpus ({len(data)} {unit}) is too small for one training and one validation "
                              f"window of data.seq_len={self.seq_len} (data.val_fraction={self.val_fraction})")
        split = (windows - n_val) * self.seq_len
        # Training windows end at byte split (their last target is data[split]); validation starts there.
        self.train_set = ByteWindows(data[:split + 1], seq_len=self.seq_len)
        self.val_set = ByteWindows(data[split:], seq_len=self.seq_len)

    def train_dataloader(self) -> ResumableDataLoader:
        return ResumableDataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
