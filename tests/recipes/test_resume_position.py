"""ResumableDataLoader under a real Trainer: a run resumed from a mid-epoch checkpoint sees exactly the batches the
uninterrupted run saw after that step, into the next epoch (shuffled; with workers; on two DDP ranks with
Lightning's DistributedSampler, an epoch-boundary checkpoint too), and a state that does not fit is refused.

Every comparison here is exact: the batches are lists of sample indices, and the loader states integers and RNG
byte tensors."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, TensorDataset

from shardline.plugins.errors import ContractError
from shardline.plugins.testing import adopt_process_group_in_lightning, run_ranks
from shardline.recipes.data import ResumableDataLoader
from shardline.recipes.schema import RecipeError

BATCH, EVERY = 4, 3  # batch size per rank; ModelCheckpoint(every_n_train_steps=EVERY)
NOT_RESUMABLE = "dataloader is not resumable"  # Lightning's warning for a mid-epoch resume it cannot honour


class _Indexed(Dataset):
    """Item i is ``[i]``: a batch says which samples it holds."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)])


class _Recorder(pl.LightningModule):
    """Records the sample indices of every batch it trains on; draws no random numbers while training, so any
    difference in the data order comes from the loader."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[:, 0].long().tolist())
        return self.layer(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class _Data(pl.LightningDataModule):
    def __init__(self, samples: int, *, batch_size: int = BATCH, num_workers: int = 0):
        super().__init__()
        self.samples, self.batch_size, self.num_workers = samples, batch_size, num_workers

    def train_dataloader(self):
        return ResumableDataLoader(_Indexed(self.samples), batch_size=self.batch_size, shuffle=True,
                                   drop_last=True, num_workers=self.num_workers)


def _fit(data: _Data, *, save_to: Path | None = None, resume: Path | None = None, devices: int = 1,
         strategy: str = "auto", said: list | None = None, **trainer_kwargs) -> list[list[int]]:
    """Two epochs (or ``trainer_kwargs``) from seed 0; the batches seen, in order. ``save_to``: a checkpoint
    every EVERY steps there. ``resume``: the checkpoint to start from; Lightning's not-resumable warning fails."""
    pl.seed_everything(0, verbose=False)
    model = _Recorder()
    callbacks = [ModelCheckpoint(dirpath=save_to, every_n_train_steps=EVERY, save_top_k=-1)] if save_to else []
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                         enable_checkpointing=save_to is not None, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, **{"max_epochs": 2, **trainer_kwargs})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=data, ckpt_path=resume)
    assert not [w for w in caught if NOT_RESUMABLE in str(w.message)]
    if said is not None:  # the warnings' texts, for the caller
        said.extend(str(w.message) for w in caught)
    return model.seen


def _checkpoint(folder: Path, step: int) -> Path:
    (path,) = folder.glob(f"*-step={step}.ckpt")
    return path


def _loader_state(path: Path) -> dict:
    (state,) = torch.load(path, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    return state


def _assert_same_state(a: dict, b: dict) -> None:
    assert {k: v for k, v in a.items() if k != "rng"} == {k: v for k, v in b.items() if k != "rng"}
    assert a["rng"].keys() == b["rng"].keys() and all(torch.equal(a["rng"][k], b["rng"][k]) for k in a["rng"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resumed_run_sees_the_uninterrupted_runs_batches(tmp_path, num_workers):
    # 20 samples, batch 4: 5 batches per epoch, 10 steps; checkpoints at steps 3 (epoch 0, batch 3), 6 (epoch 1,
    # batch 1) and 9. The sampler is a RandomSampler drawing its seed from the global RNG.
    data = _Data(20, num_workers=num_workers)
    full = _fit(data)
    assert len(full) == 10 and sorted(sum(full[:5], [])) == list(range(20)) and full[5:] != full[:5]
    assert _fit(data, save_to=tmp_path / "run") == full  # saving changes nothing
    # The position is the batches the loop consumed; torch's iterator had sent more indices to its workers.
    assert {k: _loader_state(_checkpoint(tmp_path / "run", 3))[k] for k in ("epoch", "batches", "length")} \
        == {"epoch": 0, "batches": 3, "length": 5}
    assert {k: _loader_state(_checkpoint(tmp_path / "run", 6))[k] for k in ("epoch", "batches")} \
        == {"epoch": 1, "batches": 1}
    for step in (3, 6):
        again = tmp_path / f"from{step}"
        assert _fit(data, save_to=again, resume=_checkpoint(tmp_path / "run", step)) == full[step:]
        # A resumed run's own checkpoints hold the uninterrupted run's positions (resuming twice works too).
        _assert_same_state(_loader_state(_checkpoint(again, 9)), _loader_state(_checkpoint(tmp_path / "run", 9)))


def _ddp_fit(rank, world, samples, num_workers, save_to, resume):
    adopt_process_group_in_lightning()
    return _fit(_Data(samples, num_workers=num_workers), save_to=save_to, resume=resume, devices=world,
                strategy="ddp")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_ranks_with_lightnings_distributed_sampler(tmp_path, num_workers):
    # 48 samples over 2 ranks, batch 4: 6 batches per rank and epoch, 12 steps; checkpoints at step 3 (mid epoch
    # 0), 6 (the end of epoch 0: the resumed run starts epoch 1) and 9 (mid epoch 1). Lightning re-creates the
    # loader with a DistributedSampler (order = seed + epoch) and calls set_epoch after iter(): with workers the
    # first indices are drawn before that call.
    saved = tmp_path / "run"
    full = run_ranks(_ddp_fit, 2, 48, num_workers, saved, None, timeout=120)
    assert [len(seen) for seen in full] == [12, 12]
    for epoch in (slice(0, 6), slice(6, 12)):  # each epoch, the two ranks share the samples out
        assert sorted(sum(full[0][epoch] + full[1][epoch], [])) == list(range(48))
    assert full[0][6:] != full[0][:6]
    for step in (3, 6, 9):
        resumed = run_ranks(_ddp_fit, 2, 48, num_workers, None, _checkpoint(saved, step), timeout=120)
        for rank in range(2):
            assert resumed[rank] == full[rank][step:]


def test_resuming_with_another_batch_size_and_a_random_sampler_restarts_the_epoch_saying_why(tmp_path):
    """A RandomSampler's order comes from the RNG, so no position in samples maps onto another batch size: the
    epoch restarts, warned (a DistributedSampler's maps: test_data.py's global-position tests)."""
    _fit(_Data(20), save_to=tmp_path, max_steps=3)
    said: list[str] = []
    seen = _fit(_Data(20, batch_size=5), resume=_checkpoint(tmp_path, 3), max_steps=5, said=said)
    assert any(re.search(r"resuming the train loader at the start of epoch 0, not where it stopped: a RandomSampler "
                         r"saved it .* only a DistributedSampler orders an epoch", text) for text in said), said
    assert len(seen) == 2 and all(len(set(batch)) == 5 for batch in seen)  # steps 3, 4: the new epoch's first


def _loader(**kwargs) -> ResumableDataLoader:
    return ResumableDataLoader(TensorDataset(torch.arange(20)), **{"batch_size": 4, "shuffle": True, **kwargs})


@pytest.mark.parametrize("generator", [False, True])
def test_position_replays_the_epochs_order_whatever_the_rng_did_since(generator):
    torch.manual_seed(0)
    # Epoch 1 of a loader, 2 batches in: its RandomSampler seeded from the global RNG (or the loader's generator).
    loader = _loader(generator=torch.Generator().manual_seed(5) if generator else None)
    list(loader)
    epoch1 = iter(loader)
    head = [next(epoch1)[0].tolist() for _ in range(2)]
    state = loader.state_dict()
    assert {k: state[k] for k in ("epoch", "batches", "length", "samples")} == \
        {"epoch": 1, "batches": 2, "length": 5, "samples": 20}
    rest = [batch[0].tolist() for batch in epoch1]
    after = torch.randint(0, 2**31, (4,))  # the draws that follow the epoch, uninterrupted
    # A fresh loader in a process whose RNG went elsewhere: the rest of epoch 1, the batches of indices skipped
    # without loading their samples, and the RNG left as the uninterrupted run's after the epoch.
    torch.manual_seed(123)
    resumed = _loader(generator=torch.Generator().manual_seed(99) if generator else None)
    resumed.load_state_dict(state)
    assert [batch[0].tolist() for batch in resumed] == rest
    assert sorted(sum(head + rest, [])) == list(range(20))
    if not generator:
        assert torch.equal(torch.randint(0, 2**31, (4,)), after)
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["batches"] == 5
    assert len(list(resumed)) == 5  # the next epoch is whole


def test_distributed_sampler_epoch_and_reinstantiation():
    from lightning_fabric.utilities.data import _update_dataloader

    dataset = TensorDataset(torch.arange(20))
    loader = _update_dataloader(_loader(), DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True))
    assert isinstance(loader, ResumableDataLoader) and len(loader) == 3  # 10 samples on this rank
    loader.sampler.set_epoch(4)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert (state["epoch"], state["batches"]) == (4, 1)  # the sampler's epoch
    twin = _update_dataloader(_loader(), DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True))
    twin.load_state_dict(state)
    assert twin.sampler.epoch == 4  # set before the first draw
    assert [b[0].tolist() for b in twin] == [b[0].tolist() for b in it]
    end = loader.state_dict()
    assert (end["epoch"], end["batches"]) == (4, 3)
    twin.load_state_dict(end)  # the end of epoch 4 is the start of epoch 5, whole
    assert twin.sampler.epoch == 5 and len(list(twin)) == 3


def test_a_sampler_moved_to_another_epoch_gets_a_whole_epoch():
    # limit_train_batches=2 ended epoch 0 after 2 of its 5 batches, so the resumed run starts epoch 1; Lightning
    # calls set_epoch(1) after iter(), and with workers torch would draw the first indices inside iter().
    dataset = TensorDataset(torch.arange(20))

    def make() -> ResumableDataLoader:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True)
        return ResumableDataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2)

    saved = make()
    it = iter(saved)
    next(it), next(it)
    state = saved.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    batches = iter(resumed)
    resumed.sampler.set_epoch(1)
    whole = make()
    whole.sampler.set_epoch(1)
    assert [b[0].tolist() for b in batches] == [b[0].tolist() for b in whole]


def test_states_that_do_not_fit_are_refused():
    loader = _loader()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    cases = [
        (_loader(batch_size=5), {k: v for k, v in state.items() if k not in ("replicas", "batch_size", "order")},
         r"saved with length=5 batches per epoch over samples=20, this loader has 4 "),  # a state of before v3
        (ResumableDataLoader(TensorDataset(torch.arange(21)), batch_size=4, shuffle=True), state,
         r"saved with length=5 batches per epoch over samples=20, this loader has 6 batches per epoch over 21"),
        (_loader(), {**state, "batches": 6}, r"batches=6 is past the end of an epoch of length=5"),
        (_loader(), {**state, "epoch": -1, "batches": "2"}, r"epoch=-1 is not.*; batches='2' is not"),
        (_loader(), {k: v for k, v in state.items() if k != "rng"}, r"keys \['batch_size', 'batches', 'epoch', "),
        (_loader(generator=torch.Generator()), state, r"rng holds \['torch'\], this loader draws from "
                                                      r"\['generator', 'torch'\]"),
    ]
    for target, bad, message in cases:
        with pytest.raises(RecipeError, match=message):
            target.load_state_dict(bad)
        assert target.state_dict()["batches"] == 0  # refused whole: nothing half-loaded

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(ContractError, match="Stream it was given is an IterableDataset"):
        ResumableDataLoader(Stream())


def _distributed(n: int, replicas: int, rank: int, batch: int) -> ResumableDataLoader:
    data = TensorDataset(torch.arange(n))
    return ResumableDataLoader(data, batch_size=batch, drop_last=True,
                               sampler=DistributedSampler(data, num_replicas=replicas, rank=rank, seed=7, shuffle=True))


@pytest.mark.parametrize(("saved", "now"), [((1, 8), (4, 2)), ((4, 2), (2, 4)), ((2, 4), (4, 1)), ((4, 2), (1, 8))],
                         ids=["dp1-to-dp4", "dp4-to-dp2", "dp2-to-dp4-batch1", "dp4-to-dp1"])
def test_a_distributed_position_resumes_at_the_same_global_sample_on_another_dp(saved, now):
    """The reference is DistributedSampler's definition, not its code: epoch e's order is
    ``randperm(n, seed + e)`` dealt round-robin, so rank r's batch j holds order[r + R (j b + t)]. Three saved
    batches on every rank consumed the order's first 3 b R samples; every rank of the new dp continues there."""
    n, epoch, done = 101, 1, 3
    (saved_dp, saved_b), (now_dp, now_b) = saved, now
    loader = _distributed(n, saved_dp, 0, saved_b)
    loader.sampler.set_epoch(epoch)
    it = iter(loader)
    for _ in range(done):
        next(it)
    state = loader.state_dict()
    assert (state["replicas"], state["batch_size"], state["order"]["sampler"]) == (saved_dp, saved_b,
                                                                                  "DistributedSampler")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
    start = done * saved_b * saved_dp
    for rank in range(now_dp):
        resumed = _distributed(n, now_dp, rank, now_b)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an exact move: no restart warning
            resumed.load_state_dict(state)
        got = [batch[0].tolist() for batch in resumed]
        first = start // (now_dp * now_b)
        expected = [[order[(rank + now_dp * (j * now_b + t)) % n] for t in range(now_b)]
                    for j in range(first, len(resumed))]
        assert got == expected, rank
        assert got and got[0][0] == order[start + rank]  # the very next sample of the global order


def test_a_position_that_is_not_a_whole_global_batch_restarts_the_epoch_saying_why():
    loader = _distributed(101, 1, 0, 8)
    it = iter(loader)
    for _ in range(3):
        next(it)
    resumed = _distributed(101, 4, 0, 5)
    with pytest.warns(UserWarning, match=r"start of epoch 0, not where it stopped: 24 samples of the epoch were "
                                         r"consumed \(3 batches x 8 x 1 replicas\), not a whole number of this run's "
                                         r"global batches \(5 x 4 replicas = 20"):
        resumed.load_state_dict(loader.state_dict())
    assert len([batch for batch in resumed]) == len(resumed)  # the whole epoch again
