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
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

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

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
