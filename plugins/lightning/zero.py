"""The DeepSpeed config a :class:`~shardline.plugins.lightning.strategy.HybridParallelStrategy` derives from its
arguments.

ZeRO-1 shards optimizer states, ZeRO-2 also gradients, ZeRO-3 also parameters, each over the data-parallel group
(``grid.mpu``'s ``dp_cp`` group). Offload moves optimizer states (stage >= 1) and parameters (stage 3 only) to
CPU memory or to NVMe through DeepSpeed's swapper. A user's ``deepspeed_config`` (dict or JSON path) is merged
over the derived one key by key, recursively, so one option can be changed without restating the rest.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from shardline.plugins.errors import ContractError
from shardline.plugins.layout import Offload


def load_user_config(config: dict | str | Path | None) -> dict:
    """A user's DeepSpeed config as a dict (a JSON file is read; its path is named in any error)."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config)
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        raise ContractError(f"deepspeed_config file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ContractError(f"deepspeed_config file {str(path)!r} is not valid JSON: line {exc.lineno}: "
                            f"{exc.msg}") from None
    if not isinstance(loaded, dict):
        raise ContractError(f"deepspeed_config file {str(path)!r} holds a {type(loaded).__name__}, not an object")
    return loaded


def merge(base: dict, override: dict) -> dict:
    """``base`` with ``override`` merged in: nested dicts merge, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def derive_config(*, zero_stage: int, offload_optimizer: Offload = Offload.NONE,
                  offload_params: Offload = Offload.NONE, nvme_path: str | None = None,
                  user_config: dict | None = None) -> dict[str, Any]:
    """The ``zero_optimization`` part of the DeepSpeed config, with the user's config merged over it.

    Batch size, accumulation, clipping and precision are filled in later from the Trainer (as Lightning does).
    """
    problems = []
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        problems.append(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    if offload_optimizer is not Offload.NONE and zero_stage == 0:
        problems.append(f"offload_optimizer={offload_optimizer.value!r} needs zero_stage >= 1 (zero_stage=0)")
    if offload_params is not Offload.NONE and zero_stage != 3:
        problems.append(f"offload_params={offload_params.value!r} needs zero_stage=3 (zero_stage={zero_stage})")
    if offload_optimizer is Offload.NVME and zero_stage != 3:
        # DeepSpeed swaps optimizer states to NVMe only under ZeRO-3 (ZeRO-Infinity); at stage 1/2 it would
        # silently keep them in CPU memory instead.
        problems.append(f"offload_optimizer='nvme' needs zero_stage=3 (zero_stage={zero_stage}); use 'cpu'")
    if Offload.NVME in (offload_optimizer, offload_params) and not nvme_path:
        problems.append("offload to 'nvme' needs nvme_path (a directory on a fast local disk)")
    if problems:
        raise ContractError("invalid ZeRO settings: " + "; ".join(problems))
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage >= 1:
        # Reduce into contiguous buckets and overlap the reduction with the backward pass, as on a GPU.
        zero.update(contiguous_gradients=True, overlap_comm=zero_stage >= 2)
    for key, target in (("offload_optimizer", offload_optimizer), ("offload_param", offload_params)):
        if target is not Offload.NONE:
            entry: dict[str, Any] = {"device": target.value}
            if target is Offload.NVME:
                entry["nvme_path"] = str(nvme_path)
            zero[key] = entry
    config: dict[str, Any] = {"zero_optimization": zero, "zero_allow_untested_optimizer": True,
                              "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
    if offload_optimizer is not Offload.NONE:
        # Lightning users build their optimizer in configure_optimizers (often torch's AdamW); DeepSpeed would
        # refuse it under offload. It runs correctly on the CPU partitions; DeepSpeedCPUAdam is the fast choice.
        config["zero_force_ds_cpu_optimizer"] = False
    user = user_config or {}
    for forbidden in ("gradient_accumulation_steps", "train_batch_size"):
        if forbidden in user:
            raise ContractError(f"deepspeed_config sets {forbidden!r}={user[forbidden]!r}: the Trainer owns it "
                                "(use Trainer(accumulate_grad_batches=...) and the DataLoader's batch_size)")
    merged = merge(config, user)
    _check_user_agrees(merged["zero_optimization"], zero=zero)
    return merged


def _check_user_agrees(merged: dict, *, zero: dict) -> None:
    """The user's config may add DeepSpeed options, not contradict the strategy's own arguments: the strategy
    acts on its ``zero_stage`` and offload targets (pipeline handling, checks, the checkpoint's layout record)."""
    clashes = []
    if merged.get("stage") != zero["stage"]:
        clashes.append(f"zero_optimization.stage={merged.get('stage')!r} vs zero_stage={zero['stage']}")
    for key, arg in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_params")):
        mine = zero.get(key, {}).get("device", "none")
        theirs = (merged.get(key) or {}).get("device", "none")
        if theirs != mine:
            clashes.append(f"zero_optimization.{key}.device={theirs!r} vs {arg}={mine!r}")
    if clashes:
        raise ContractError("deepspeed_config contradicts the strategy's arguments (set them on the strategy "
                            "instead): " + "; ".join(clashes))
