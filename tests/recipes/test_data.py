"""TextDataModule: exact byte windows against the raw files, the stdlib default, clear errors, and a training
loader that resumes inside the epoch (the Trainer-level checks are in test_resume_position.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from shardline.recipes.data import ResumableDataLoader, TextDataModule, corpus_files, read_corpus, stdlib_root
from shardline.recipes.schema import RecipeError


@pytest.fixture
def text_folder(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".hidden").mkdir()
    files = {"b/z.txt": "ZZZ zzz\n" * 7, "a.txt": "hello, world! " * 5, "b/c.txt": "ünïcode bytes ✓",
             ".hidden/x.txt": "never read", ".dot.txt": "never read"}
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def test_folder_order_and_hidden_files(text_folder):
    names = [f.relative_to(text_folder).as_posix() for f in corpus_files(text_folder)]
    assert names == ["a.txt", "b/c.txt", "b/z.txt"]
    assert [f.name for f in corpus_files(text_folder, pattern="z*")] == ["z.txt"]


def test_windows_are_the_raw_bytes_shifted_by_one(text_folder):
    raw = b"".join((text_folder / n).read_bytes() + b"\n" for n in ("a.txt", "b/c.txt", "b/z.txt"))
    seq = 8
    dm = TextDataModule(path=str(text_folder), seq_len=seq, batch_size=2, val_fraction=0.25)
    dm.setup("fit")
    windows = (len(raw) - 1) // seq
    n_val = round(windows * 0.25)
    assert (len(dm.train_set), len(dm.val_set)) == (windows - n_val, n_val)
    # Every window, train then validation, is the next seq_len bytes of the corpus; targets one byte later.
    for k, (ids, targets) in enumerate([*dm.train_set, *dm.val_set]):
        start = k * seq
        assert ids.dtype == torch.int64 and ids.shape == (seq,)
        assert bytes(ids.tolist()) == raw[start:start + seq]
        assert bytes(targets.tolist()) == raw[start + 1:start + seq + 1]
    ids, targets = next(iter(dm.val_dataloader()))
    assert ids.shape == (2, seq) and torch.equal(ids[0, 1:], targets[0, :-1])
    assert all(ids.shape == (2, seq) for ids, _ in dm.train_dataloader())  # drop_last: full batches only


def test_single_file_and_max_bytes(text_folder):
    path = text_folder / "b" / "z.txt"
    assert corpus_files(path) == [path]
    dm = TextDataModule(path=str(path), seq_len=4, max_bytes=21, val_fraction=0.2)
    dm.setup()
    data = (path.read_bytes() + b"\n")[:21]
    assert len(dm.train_set) + len(dm.val_set) == 5  # (21 - 1) // 4
    last_ids, last_targets = dm.val_set[len(dm.val_set) - 1]
    assert bytes(last_targets.tolist()) == data[17:21] and bytes(last_ids.tolist()) == data[16:20]


def test_stdlib_default_is_deterministic_python_source():
    files = corpus_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    root = stdlib_root()
    assert not any({"site-packages", "dist-packages"} & set(f.relative_to(root).parts) for f in files)
    assert files == corpus_files()
    corpus = read_corpus(files, max_bytes=100_000)
    assert len(corpus) == 100_000 and corpus.startswith(files[0].read_bytes())
    dm = TextDataModule(seq_len=64, max_bytes=100_000)
    dm.setup()
    ids, targets = dm.train_set[3]
    assert bytes(ids.tolist()) == corpus[192:256] and bytes(targets.tolist()) == corpus[193:257]


@pytest.mark.parametrize(("kwargs", "fragment"), [
    (dict(seq_len=0), "data.seq_len=0"),
    (dict(batch_size=2.5), "data.batch_size=2.5"),
    (dict(val_fraction=1.0), "data.val_fraction=1.0"),
    (dict(max_bytes=-1), "data.max_bytes=-1"),
])
def test_bad_arguments_name_the_field(kwargs, fragment):
    with pytest.raises(RecipeError, match=fragment.replace(".", r"\.")):
        TextDataModule(**kwargs)


def test_missing_or_empty_or_tiny_corpus(tmp_path):
    with pytest.raises(RecipeError, match="data.path=.*nowhere.*neither a file nor a folder"):
        corpus_files(tmp_path / "nowhere")
    with pytest.raises(RecipeError, match=r"holds no file matching data.pattern='\*.md'"):
        corpus_files(tmp_path, pattern="*.md")
    (tmp_path / "small.txt").write_text("abc")
    dm = TextDataModule(path=str(tmp_path / "small.txt"), seq_len=8)
    with pytest.raises(RecipeError, match="too small for one training and one validation window"):
        dm.setup()


def test_training_loader_resumes_inside_the_epoch(text_folder):
    dm = TextDataModule(path=str(text_folder), seq_len=4, batch_size=2, val_fraction=0.25)
    dm.setup()
    train = dm.train_dataloader()
    assert isinstance(train, ResumableDataLoader) and type(dm.val_dataloader()) is DataLoader
    torch.manual_seed(0)
    batches = iter(train)
    next(batches)
    state = train.state_dict()
    rest = [ids for ids, _ in batches]
    torch.manual_seed(1)  # another process's RNG: the saved epoch's order is replayed all the same
    again = dm.train_dataloader()
    again.load_state_dict(state)
    resumed = [ids for ids, _ in again]
    assert len(rest) == len(train) - 1 and len(resumed) == len(rest)
    assert all(torch.equal(a, b) for a, b in zip(resumed, rest))  # exact: the same windows
