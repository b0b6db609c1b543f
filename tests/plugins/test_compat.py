"""The private members of torch and Lightning that shardline relies on are checked where they are used: a release
that renamed one fails at import naming it, instead of an override silently never running."""

from __future__ import annotations

import pytest
import torch
from pytorch_lightning.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader

from shardline.plugins import torch_compat
from shardline.plugins.lightning import lightning_compat
from shardline.plugins.lightning.strategy import HybridParallelStrategy


def test_this_lightning_has_every_protected_member_the_strategy_overrides_or_calls():
    lightning_compat.check_strategy()
    for name in lightning_compat.OVERRIDDEN:
        assert name in vars(HybridParallelStrategy), f"{name} is listed as overridden but is not"


def test_a_lightning_without_one_is_refused_naming_it():
    class Renamed(DeepSpeedStrategy):
        _setup_model_and_optimizer = None

    with pytest.raises(lightning_compat.LightningPrivateMissing,
                       match=r"Renamed\._setup_model_and_optimizer is gone; HybridParallelStrategy overrides it"):
        lightning_compat.check_strategy(Renamed)


def test_a_torch_without_the_dataloaders_index_sampler_is_refused(monkeypatch):
    torch_compat.check_index_sampler(DataLoader)
    monkeypatch.delattr(DataLoader, "_index_sampler")
    with pytest.raises(torch_compat.TorchPrivateMissing, match=r"DataLoader\._index_sampler \(where Mine skips"):
        torch_compat.check_index_sampler(type("Mine", (DataLoader,), {}))


def test_the_module_tables_are_shared_not_copied():
    module, host = torch.nn.Linear(2, 2), torch.nn.Module()
    torch_compat.share_module_tables(host, module)
    assert torch_compat.parameter_table(host) is torch_compat.parameter_table(module)
    module.extra = torch.nn.Parameter(torch.zeros(1))
    assert host.extra is module.extra and dict(host.named_parameters()).keys() == {"weight", "bias", "extra"}
    base = torch.zeros(4)
    assert torch_compat.is_view(base[:2]) and not torch_compat.is_view(base)
