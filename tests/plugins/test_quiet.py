"""A quiet start (``shardline.plugins.lightning.quiet``): each filter drops only the third-party output it names,
from its own module or logger; a user's own warning or log line with the same text still shows."""

from __future__ import annotations

import logging
import warnings

import pytest

from shardline.plugins.lightning import quiet
from shardline.recipes.fit import requested_accelerator


def _pytree_warnings() -> list[str]:
    """What Lightning's own pytree helper warns when it flattens a leaf (torch 2.13 deprecates LeafSpec)."""
    from pytorch_lightning.utilities._pytree import _tree_flatten

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.install_warning_filters()  # inserted in front of "always": it takes precedence
        _tree_flatten(1.0)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated in my own code", FutureWarning, stacklevel=1)
    return [str(w.message) for w in caught]


def test_the_expected_lightning_warning_is_hidden_and_a_users_own_is_not():
    from pytorch_lightning.utilities._pytree import _tree_flatten

    with warnings.catch_warnings(record=True) as control:  # without the filter, Lightning's warning shows
        warnings.simplefilter("always")
        _tree_flatten(1.0)
    assert any("LeafSpec" in str(w.message) for w in control), "the control must see the warning"
    assert _pytree_warnings() == ["`isinstance(treespec, LeafSpec)` is deprecated in my own code"]


@pytest.fixture
def clean_loggers():
    names = [*quiet.PER_RANK_LINES, *quiet.TIP_LOGGERS]
    saved = {name: list(logging.getLogger(name).filters) for name in names}
    yield
    for name, filters in saved.items():
        logging.getLogger(name).filters[:] = filters


def _kept(logger_name: str, level: int, message: str) -> bool:
    logger = logging.getLogger(logger_name)
    record = logger.makeRecord(logger_name, level, __file__, 1, message, (), None)
    return logger.filter(record)


def test_per_rank_lines_are_dropped_on_other_ranks_only(clean_loggers):
    seed = "lightning_fabric.utilities.seed"
    quiet.quiet_duplicate_logs(rank=0)
    assert _kept(seed, logging.INFO, "[rank: 0] Seed set to 1234")
    quiet.quiet_duplicate_logs(rank=3)
    quiet.quiet_duplicate_logs(rank=3)  # idempotent: one filter
    assert sum(isinstance(f, quiet._DropInfo) for f in logging.getLogger(seed).filters) == 1
    assert not _kept(seed, logging.INFO, "[rank: 3] Seed set to 1234")
    assert not _kept("pytorch_lightning.strategies.deepspeed", logging.INFO,
                     "initializing deepspeed distributed: GLOBAL_RANK: 3, MEMBER: 4/4")
    assert _kept(seed, logging.WARNING, "[rank: 3] Seed set to 1234")  # a warning is never dropped
    assert _kept(seed, logging.INFO, "something else on rank 3")
    assert _kept("my_module", logging.INFO, "initializing deepspeed distributed: mine")


def test_the_hosted_logger_tip_is_dropped_and_other_rank_zero_lines_kept(clean_loggers):
    name = "pytorch_lightning.utilities.rank_zero"
    quiet.without_tips()
    assert not _kept(name, logging.INFO, "💡 Tip: For seamless cloud logging, try installing litlogger")
    assert _kept(name, logging.INFO, "GPU available: False, used: False")


@pytest.mark.parametrize(("typed", "recipes", "expected"), [
    ([], [{"trainer": {"accelerator": "cpu"}}], "cpu"),
    (["--trainer.accelerator", "gpu"], [{"trainer": {"accelerator": "cpu"}}], "gpu"),
    (["--trainer.accelerator=cpu"], [{}], "cpu"),
    ([], [{"trainer": {"accelerator": "cpu"}}, {"trainer": {"accelerator": "cuda"}}], "cuda"),
    ([], [{"model": {}}], None),
])
def test_the_requested_accelerator_is_the_last_word(typed, recipes, expected):
    assert requested_accelerator(typed, recipes) == expected


def test_no_shared_memory_op_is_built_while_the_backend_starts():
    import importlib

    from shardline.plugins.lightning.deepspeed_compat import without_shm_comm_op

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # the attribute deepspeed.comm.torch is torch
    original = ds_torch.build_shm_op
    with without_shm_comm_op():
        assert ds_torch.build_shm_op() is None
    assert ds_torch.build_shm_op is original


def test_the_whole_model_summary_replaces_the_trainers_at_its_depth_and_only_where_there_is_one():
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelSummary

    from shardline.plugins.lightning.callbacks import WholeModelSummary
    from shardline.recipes.lit_lm import LanguageModule

    module = LanguageModule(n_layer=1, d_model=32, n_head=2, seq_len=16)
    common = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    module.trainer = pl.Trainer(enable_model_summary=False, **common)
    assert module.configure_callbacks() == []  # the user turned the summary off: it stays off
    module.trainer = pl.Trainer(callbacks=[ModelSummary(max_depth=3)], **common)
    (summary,) = module.configure_callbacks()
    assert isinstance(summary, WholeModelSummary) and summary._max_depth == 3
    # GPT with a tied head: embedding 256 x 32 + positions 16 x 32, one block, the final LayerNorm (by hand)
    block = 2 * 32 + (3 * 32 * 32 + 3 * 32) + (32 * 32 + 32) + 2 * 32 + (4 * 32 * 32 + 4 * 32) + (4 * 32 * 32 + 32)
    assert summary.whole_parameters == 256 * 32 + 16 * 32 + block + 2 * 32
