"""``HybridParallelStrategy``: DeepSpeed ZeRO x tensor/sequence parallel (x pipeline) as a Lightning strategy.

What it changes relative to Lightning's own ``DeepSpeedStrategy`` (which it extends for checkpointing,
precision and the optimizer/backward plumbing):

* it runs on CPU with gloo (DeepSpeed's CPU accelerator) as well as on CUDA with NCCL;
* it builds a :class:`~shardline.plugins.grid.Grid` for ``tp x cp x dp x pp`` right after the process group
  exists, and validates the layout before any process group is created (in the launcher, and again per rank);
* it passes ``mpu=grid.mpu`` to ``deepspeed.initialize``, so ZeRO shards over the data-parallel group (``dp x cp``)
  only, never over TP ranks;
* the distributed sampler uses the data-parallel rank and size, so every TP/CP/PP rank of one replica sees the
  same samples; with ``cp > 1`` each CP rank then keeps its load-balanced sequence shard of every batch tensor.

The LightningModule contract: build the model in ``configure_model()`` (``self.trainer.strategy.grid`` is
ready by then) from shardline's layers or ``shardline.plugins.models.gpt.GPT``, and return the (replica-global) mean
loss from ``training_step``. Gradient synchronisations are the strategy's: at setup it installs every one the
parameters' declared roles imply (:mod:`shardline.plugins.layers.roles`), so the module adds none itself.

One file: it is one class whose methods override Lightning's ``DeepSpeedStrategy`` hooks, which Lightning calls in
a fixed order on one object (setup, the launcher, the optimizer and backward plumbing, teardown); the parts that
stand alone already live beside it (:mod:`.checkpointing`, :mod:`.launcher`, :mod:`.lightning_compat`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import enum
import logging
import math
import os
import tempfile
import time
import warnings
from collections.abc import Mapping
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.seed import reset_seed
from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy

from shardline.plugins.errors import (
    ContractError,
    ErrorReport,
    LayoutError,
    NonFiniteLossError,
    attach_report,
)
from shardline.plugins.faults.watchdog import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    CollectiveWatchdog,
    collective_timeout_seconds,
)
from shardline.plugins.grid import Grid, ParallelDims, SPMode
from shardline.plugins.layers.roles import sum_sequence_parallel_gradients
from shardline.plugins.layout import Layout, Offload, PipelineSpec, ZeroSpec
from shardline.plugins.lightning.checkpointing import Checkpointer
from shardline.plugins.lightning.deepspeed_compat import set_norm_flags, without_shm_comm_op
from shardline.plugins.lightning.launcher import ShardlineLauncher, arm_worker
from shardline.plugins.lightning.lightning_compat import SubprocessScriptLauncher, check_strategy
from shardline.plugins.lightning.quiet import install_warning_filters, quiet_duplicate_logs
from shardline.plugins.lightning.stage_host import PipelineOptimizer, StageHost
from shardline.plugins.lightning.zero import derive_config, load_user_config

log = logging.getLogger(__name__)
install_warning_filters()  # third-party warnings expected on every run (quiet.EXPECTED_WARNINGS), by module


class NonFiniteLoss(str, enum.Enum):
    """What a training step whose loss is NaN or infinite on any rank does (``nonfinite_loss``)."""

    RAISE = "raise"  # stop the run: NonFiniteLossError on every rank, naming the step and the ranks
    SKIP = "skip"  # warn, and leave out that batch's backward and optimizer step on every rank
    OFF = "off"  # no check (and no collective): the loss goes to backward whatever it is


class HybridParallelStrategy(DeepSpeedStrategy):
    """ZeRO stage 0-3 (with CPU/NVMe offload) composed with TP/SP and pipeline parallelism.

    Degrees not given are 1; the data-parallel degree is what is left of the world:
    ``dp = world_size / (tp * cp * pp)``.

    ``collective_timeout`` (seconds or a timedelta; default 10 min, NCCL's own default: longer than any
    legitimate wait between healthy ranks, such as the slowest rank's sharded checkpoint write, and a third of
    gloo's 30 min) is how long a collective may wait before its rank counts as hung. It governs every process
    group once the grid exists (Lightning's ``timeout`` still governs the rendezvous), and
    :class:`~shardline.plugins.faults.watchdog.CollectiveWatchdog` enforces it: when a rank dies or hangs,
    every rank stops within ``collective_timeout + 15 s`` with one
    :class:`~shardline.plugins.errors.CollectiveError` naming the rank(s), the groups and the last collective
    each rank entered and completed; each rank dumps its record to ``collective_dump_dir`` (default: a fresh
    folder per run under the system's temp dir, so failing test runs leave nothing in the working tree; the
    message names it).

    ``async_checkpoint=True``: a checkpoint saved during training (from ``on_train_start`` to ``on_train_end``)
    costs the training loop only a copy of this rank's pieces (in memory, once); a thread writes and fsyncs them
    while training goes on, and the commit (manifest, rename, ``latest``) follows at the first batch that finds
    every rank's writes done, at the next save or load, or at ``on_train_end``. Rank 0 reserves the name at once
    with a placeholder folder, so Lightning's versioning and ``save_last="link"`` see it. Atomicity and checks
    are a synchronous save's; a save made while one is pending waits for it (with ``ModelCheckpoint(save_last=
    ...)`` use ``save_last="link"``, or the ``last.ckpt`` save right after a top-k one waits); a run that fails
    leaves a pending save uncommitted (teardown runs no collective), and its placeholder loads the latest
    complete checkpoint beside it, with a warning.

    ``nonfinite_loss`` (default ``"raise"``): after every ``training_step`` each rank puts its loss (the
    tensor the step returned, or its ``"loss"``) into one all-reduce of ``world_size`` float64 values, so every
    rank sees every rank's loss and all decide alike, pipeline stages included. When any is NaN or infinite:
    ``"raise"`` stops the run on every rank with one :class:`NonFiniteLossError` naming the global step, the
    batch and the ranks with their losses (never training on with NaN weights); ``"skip"`` warns with the same
    facts and leaves out that batch's backward and optimizer step on every rank (weights and optimizer state
    unchanged; the step still counts, so the learning-rate schedule advances); it needs ``pp = 1`` (the
    pipeline runs the backwards inside ``training_step``, before the batch loss is known) and automatic
    optimization. ``"off"``: no check and no collective (a host sync per step saved).
    """

    strategy_name = "shardline"

    def __init__(self, *, tp: int = 1, pp: int = 1, cp: int = 1, sp: str | SPMode = "none", zero_stage: int = 1,
                 offload_optimizer: str | None = None, offload_params: str | None = None,
                 nvme_path: str | None = None, micro_batches: int | None = None, schedule: str = "1f1b",
                 chunks: int = 1, activation_checkpointing: bool = False, pipeline_annotations: str = "when_profiling",
                 deepspeed_config: dict | str | None = None, gpus_per_node: int | None = None,
                 collective_timeout: float | datetime.timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
                 collective_dump_dir: str | None = None, async_checkpoint: bool = False,
                 nonfinite_loss: str | NonFiniteLoss = "raise", **lightning_kwargs: Any):
        # The one layout value, validated now (the world size still unknown) and bound once at setup.
        self.layout = Layout(tp=tp, pp=pp, cp=cp, sp=sp, gpus_per_node=gpus_per_node,
                             pipeline=PipelineSpec(schedule=schedule, chunks=chunks, micro_batches=micro_batches),
                             zero=ZeroSpec(stage=zero_stage, offload_optimizer=offload_optimizer,
                                           offload_params=offload_params, nvme_path=nvme_path))
        from shardline.plugins.pipeline.engine import Annotations

        try:
            self.pipeline_annotations = Annotations(pipeline_annotations)
        except ValueError:
            raise ContractError(f"pipeline_annotations={pipeline_annotations!r} must be one of "
                                f"{[a.value for a in Annotations]}") from None
        self.activation_checkpointing = activation_checkpointing
        self.nonfinite_loss = _nonfinite_mode(nonfinite_loss, pp=self.layout.pp)
        self._skip_step = False  # nonfinite_loss='skip': this batch's loss is non-finite somewhere
        zero = self.layout.zero
        config = derive_config(zero_stage=zero.stage, offload_optimizer=zero.offload_optimizer,
                               offload_params=zero.offload_params, nvme_path=zero.nvme_path,
                               user_config=load_user_config(deepspeed_config))
        lightning_kwargs.setdefault("logging_level", logging.WARNING)
        super().__init__(config=config, **lightning_kwargs)
        self.grid: Grid | None = None
        self.pipeline_driver = None  # a PipelineDriver when pp > 1, built at setup
        self._pipeline_runs = 0  # strategy.pipeline() calls in the current step (exactly one under pp > 1)
        self.pipeline_meta_group = None
        # gloo over the whole world where the grid's groups are NCCL's: the checkpoint's few-word CPU collectives
        # (a CPU tensor has no backend on an NCCL-only group); None (the default group) where that is gloo
        self.control_group = None
        self.collective_timeout = collective_timeout_seconds(collective_timeout)  # seconds, validated now
        self.collective_dump_dir = collective_dump_dir
        self.watchdog: CollectiveWatchdog | None = None  # from setup_distributed to teardown
        if not isinstance(async_checkpoint, bool):
            raise ContractError(f"async_checkpoint={async_checkpoint!r} must be True or False")
        self.async_checkpoint = async_checkpoint
        # the save and load, and their state (the pending async save, its window, the RNG states a load leaves)
        self.checkpointer = Checkpointer(self)

    # --- layout ------------------------------------------------------------------------------------------------

    # Read-only views of the one layout (kept for callers; nothing here is a second copy).
    @property
    def degrees(self) -> dict[str, int]:
        return {"tp": self.layout.tp, "pp": self.layout.pp, "cp": self.layout.cp}

    @property
    def dims(self) -> ParallelDims | None:
        return self.layout.dims if self.layout.bound else None

    @property
    def zero_stage(self) -> int:
        return self.layout.zero.stage

    def layout_for(self, world_size: int) -> ParallelDims:
        """The ParallelDims for ``world_size`` ranks (raises LayoutError naming every number if impossible)."""
        return self.layout.for_world(world_size)

    def _configure_launcher(self) -> None:
        # Runs in the launching process, before any worker or process group exists: fail here, not in N copies.
        self.layout_for(self.num_nodes * self.num_processes)
        if self.parallel_devices and self.parallel_devices[0].type == "cpu":  # so the workers' DeepSpeed does not
            # warn that it found no GPU: this run asked for none
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        super()._configure_launcher()
        if type(self._launcher) is SubprocessScriptLauncher:  # ours ends every worker it started (launcher.py)
            self._launcher = ShardlineLauncher.replacing(self._launcher, self)
        arm_worker()  # a worker that launcher started dies with it

    def setup_environment(self) -> None:
        # DeepSpeedStrategy refuses anything but CUDA here; DeepSpeed itself runs on CPU (gloo), so we skip it.
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self.layout = self.layout.bind(self.world_size)
        quiet_duplicate_logs(self.global_rank)
        with without_shm_comm_op() if self.root_device.type == "cpu" else contextlib.nullcontext():
            self._init_deepspeed_distributed()
        self.grid = Grid.build(self.dims)
        if self.grid.backend != "gloo":
            import torch.distributed as dist

            if self.dims.pp > 1:
                # NCCL ignores message tags: the pipeline's shape headers travel on a gloo twin of the pp group.
                for ranks in self.dims.group_ranks("pp"):
                    group = dist.new_group(ranks, backend="gloo")
                    if self.global_rank in ranks:
                        self.pipeline_meta_group = group
            # also for one rank: the checkpoint's collectives still need a CPU backend
            self.control_group = dist.new_group(backend="gloo", group_desc="shardline_control")
        if self.world_size > 1:
            self.watchdog = CollectiveWatchdog.start(self.grid, timeout=self.collective_timeout,
                                                     dump_dir=self.collective_dump_dir)
            if isinstance(self._launcher, ShardlineLauncher):
                self.watchdog.before_exit = self._launcher.end_workers
        if self.global_rank == 0:
            log.info("shardline layout:\n%s", self.dims.describe())

    # --- dead and hung ranks ----------------------------------------------------------------------------------

    def on_exception(self, exception: BaseException) -> None:
        # The watchdog names the dead or hung rank (it waits, bounded, for the verdict); teardown raises it.
        if self.watchdog is not None:
            self.watchdog.on_exception(exception)
        attach_report(exception, self._error_report(self.watchdog))
        super().on_exception(exception)

    def _error_report(self, watchdog: CollectiveWatchdog | None) -> ErrorReport:
        """Who prints this run's error (the verdict's speaker; every rank without a watchdog) and where the
        tracebacks go (beside the watchdog's records; a fresh temporary folder without one)."""
        verdict = None if watchdog is None else watchdog.verdict
        if watchdog is not None:
            log_dir = str(watchdog.dump_dir)
        else:
            log_dir = os.path.join(tempfile.gettempdir(), "shardline_errors",
                                   f"{time.strftime('%Y%m%d-%H%M%S')}-pid{os.getpid()}")
        return ErrorReport(rank=self.global_rank, speaks=verdict is None or verdict.speaks(self.global_rank),
                           log_dir=log_dir)

    def teardown(self) -> None:
        """Lightning's teardown, then the watchdog's: after a failure it raises the one CollectiveError (from
        the exception that interrupted the run), except on a rank whose own code raised something other than a
        collective error (that rank keeps its exception). An ``async_checkpoint`` save still pending here (the
        fit failed or was interrupted before ``on_train_end``) is left uncommitted once its writes end: no
        collective runs in teardown, where the ranks may not all have arrived."""
        self.checkpointer.abandon()
        try:
            super().teardown()
        finally:
            watchdog, self.watchdog = self.watchdog, None
            error = watchdog.stop() if watchdog is not None else None
        if error is not None:
            attach_report(error, self._error_report(watchdog))
            raise error from watchdog.cause

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # All TP/CP/PP ranks of one replica must read the same samples: shard the data over dp only.
        if self.grid is None:
            dims = self.layout_for(self.num_nodes * self.num_processes)
            coords = dims.coords(self.global_rank)
            return {"num_replicas": dims.dp, "rank": coords["dp"]}
        return {"num_replicas": self.grid.size("dp"), "rank": self.grid.rank("dp")}

    def setup(self, trainer) -> None:
        self._check_one_seed()
        self._remove_checkpoint_leftovers(trainer)
        self._install_gradient_syncs()
        if self.layout.pp > 1:
            from shardline.plugins.lightning.pipeline_driver import PipelineDriver

            # Backward only accumulates; Lightning's one optimizer step per batch is DeepSpeed's boundary.
            self._check_pipeline_training(trainer)
            self.config["managed_gradient_accumulation"] = False
            driver = self.pipeline_driver
            if driver is not None and driver.module is self.lightning_module:
                driver.rebind()  # e.g. validate() after fit(): the module is already cut into this rank's stages
            else:
                self.pipeline_driver = PipelineDriver(self, self.lightning_module)
        super().setup(trainer)

    def _remove_checkpoint_leftovers(self, trainer) -> None:
        """Rank 0, before the fit's first save: the placeholders of asynchronous saves never committed in each
        ``ModelCheckpoint``'s folder, which would make Lightning name this run's save of the same step ``-v1``,
        removed (:func:`~shardline.plugins.checkpoint.files.remove_leftovers`; partial folders go at the next
        commit). Saves from this run are all still to come, so every placeholder there now is another run's."""
        import time

        from shardline.plugins.checkpoint.files import remove_leftovers

        if not self.is_global_zero or trainer is None:
            return
        now = time.time()
        for callback in getattr(trainer, "checkpoint_callbacks", []):
            folder = getattr(callback, "dirpath", None)
            removed = remove_leftovers(folder, before=now, partials=False) if folder else []
            if removed:
                log.info("removed what interrupted saves left in %s: %s", folder, ", ".join(removed))

    def _check_one_seed(self) -> None:
        """Every rank must be seeded alike: Lightning seeds the DistributedSampler's shuffle with the process's
        seed (``PL_GLOBAL_SEED``), so ranks seeded apart would read overlapping batches (and the TP ranks of one
        replica different ones), and TP ranks must draw the same dropout masks on replicated activations."""
        import os

        import torch.distributed as dist

        seeds: list = [None] * dist.get_world_size()
        dist.all_gather_object(seeds, os.environ.get("PL_GLOBAL_SEED"))
        if len(set(seeds)) > 1:
            listed = ", ".join(f"rank {r}: {s}" for r, s in enumerate(seeds))
            raise ContractError(f"ranks are seeded differently ({listed}): Lightning seeds the DistributedSampler's "
                                "shuffle with this seed, so ranks would read overlapping batches and TP ranks "
                                "different ones; call seed_everything with the same seed on every rank")

    def _install_gradient_syncs(self) -> None:
        """Every gradient synchronisation the parameters' declared roles imply (``layers.roles``), so any module
        built from shardline's layers is correct by construction: Megatron-SP's sum over TP of
        sequence-replicated gradients (a hook, during backward, before ZeRO reduces over DP) and DeepSpeed's
        gradient-norm flags. Under pp > 1 the pipeline driver sets the norm flags of the stages it keeps and
        installs the tied-weight sum."""
        module = self.lightning_module
        sum_sequence_parallel_gradients(module, group=self.grid.group("tp"))
        if self.layout.pp == 1:
            set_norm_flags(list(module.parameters()), tp_rank=self.grid.rank("tp"), first_stage=True)

    @contextlib.contextmanager
    def model_sharded_context(self):
        """ZeRO-3 partitions parameters as ``configure_model`` creates them: over ``dp x cp`` only.

        Lightning's DeepSpeedStrategy opens ``deepspeed.zero.Init`` without a group, i.e. over the whole world,
        which would split a TP shard or a pipeline stage across ranks holding different parameters.
        """
        import deepspeed

        self._init_config_if_needed()
        group = self.grid.group("dp_cp") if self.grid is not None else None
        with deepspeed.zero.Init(enabled=self.zero_stage_3, remote_device=self.remote_device,
                                 config_dict_or_path=self.config, data_parallel_group=group):
            yield

    def _initialize_deepspeed_inference(self, model) -> None:
        """validate/test/predict outside ``fit``: Lightning's version passes no ``mpu`` (so DeepSpeed would
        broadcast rank 0's parameters, TP shards included, over the whole world) and a CPU device has no index."""
        import deepspeed
        from pytorch_lightning.strategies.deepspeed import remove_module_hooks

        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                config[key] = self.config[key]
        if self.zero_stage_3:
            config["zero_allow_untested_optimizer"] = True
            config["zero_optimization"] = self.config["zero_optimization"]
        remove_module_hooks(model)
        if self.pipeline_driver is not None:
            model = StageHost(model, self.pipeline_driver.local)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()), config=config, model=model, optimizer=None,
            lr_scheduler=None, model_parameters=[], dist_init_required=False, mpu=self.grid.mpu)

    def _check_pipeline_training(self, trainer) -> None:
        p = self.layout.pp
        if trainer.accumulate_grad_batches > 1:
            # Every optimizer step is DeepSpeed's reduction boundary under the pipeline (unmanaged accumulation).
            raise ContractError(f"accumulate_grad_batches={trainer.accumulate_grad_batches} with pp={p}: the "
                                "pipeline already accumulates over its micro-batches; raise micro_batches or the "
                                "batch size instead")
        hooked = [type(self.lightning_module).__name__] if type(self.lightning_module).on_before_backward \
            is not pl.LightningModule.on_before_backward else []
        hooked += [type(cb).__name__ for cb in trainer.callbacks
                   if type(cb).on_before_backward is not pl.Callback.on_before_backward]
        if hooked:
            raise ContractError(f"on_before_backward of {', '.join(hooked)} cannot run with pp={p}: each "
                                "micro-batch's backward runs inside self.trainer.strategy.pipeline(batch), "
                                "interleaved with the forwards, so there is no moment before 'the' backward; "
                                "on_after_backward runs as Lightning documents (after it, before the step)")
        if str(self.precision_plugin.precision).startswith("16"):
            raise ContractError(f"precision={self.precision_plugin.precision!r} with pp={p}: fp16 loss scaling "
                                "would apply twice on every stage but the last; use precision='bf16-mixed'")

    # --- DeepSpeed --------------------------------------------------------------------------------------------

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import deepspeed

        if self.grid is None:
            raise ContractError("the process grid does not exist yet: setup_environment() must run first")
        parameters = [p for p in model.parameters() if p.requires_grad]
        if self.pipeline_driver is not None:
            model = StageHost(model, self.pipeline_driver.local)
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()), config=self.config, model=model,
            model_parameters=parameters, optimizer=optimizer, lr_scheduler=lr_scheduler,
            dist_init_required=False, mpu=self.grid.mpu)
        if self.pipeline_driver is not None:
            ds_optimizer = PipelineOptimizer(ds_optimizer)
        return engine, ds_optimizer

    def _device_rank(self) -> int:
        # A CPU device has no index; DeepSpeed's CPU accelerator only needs a number.
        index = self.root_device.index
        return self.local_rank if index is None else index

    # --- checkpoints ------------------------------------------------------------------------------------------

    def layout_record(self) -> dict[str, Any]:
        """The layout as saved in a checkpoint's manifest (the degrees, the world and the ZeRO stage)."""
        record = self.layout.record()
        return {k: record[k] for k in ("world_size", "tp", "pp", "cp", "dp", "sp", "zero_stage", "chunks")}

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any = None) -> None:
        """A layout-independent checkpoint folder at ``filepath``, written atomically by every rank
        (:mod:`shardline.plugins.lightning.checkpointing`); any layout loads it."""
        if storage_options is not None:
            raise ContractError(f"storage_options={storage_options!r}: shardline checkpoints take none")
        self.checkpointer.save(checkpoint, filepath)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint written by any layout into this one (a folder of checkpoints: its newest); see
        :mod:`shardline.plugins.lightning.checkpointing`. Nothing in it is unpickled; ``weights_only=False``
        (Lightning's, explicit) alone lets an old (version 1-2) checkpoint's pickled state files load."""
        return self.checkpointer.load(checkpoint_path, weights_only=weights_only)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing: :meth:`save_checkpoint` writes the module's tensors itself, piece by piece (Lightning would
        otherwise build a state dict of every parameter only for it to be dropped)."""
        return {}

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Nothing, for the same reason: the optimizer's moments are written by :meth:`save_checkpoint`."""
        return {}

    def remove_checkpoint(self, filepath) -> None:
        """Rank 0 removes the checkpoint folder; while an ``async_checkpoint`` save is pending, only once that
        one is committed (``save_top_k`` rotation never leaves fewer complete checkpoints than it keeps)."""
        self.checkpointer.remove(filepath)

    @property
    def pending_save(self):
        """The ``async_checkpoint`` save being written, not yet committed (the checkpointer's); None otherwise."""
        return self.checkpointer.pending

    # --- the batch --------------------------------------------------------------------------------------------

    def shard_batch(self, batch: Any) -> Any:
        """With ``cp > 1``: this CP rank's load-balanced share of the batch's sequence. Identity otherwise.

        A LightningModule that defines ``cp_shard_batch(batch, shard)`` decides itself: ``shard(tensor, dim=1)``
        returns this rank's tokens of ``tensor`` along ``dim``, and the method returns the batch to use.
        Otherwise every tensor of two or more dims (in nested dicts, lists, tuples) is cut along dim 1, which
        must then be the sequence for all of them: tensors whose dim 1 differ raise LayoutError naming each
        one, since cutting a ``[b, classes]`` label next to ``[b, S]`` ids would be silently wrong.
        """
        if self.grid is None or self.grid.size("cp") == 1:
            return batch
        from shardline.plugins.layers.sequence_parallel import shard_sequence

        group = self.grid.group("cp")

        def cut(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
            return shard_sequence(tensor, group=group, dim=dim)

        hook = getattr(getattr(self, "lightning_module", None), "cp_shard_batch", None)
        if callable(hook):
            return hook(batch, cut)
        found = []
        _map_sequence_tensors(batch, lambda tensor, path: found.append((path, tuple(tensor.shape))) or tensor)
        if len({shape[1] for _, shape in found}) > 1:
            listed = ", ".join(f"{path} {list(shape)}" for path, shape in found)
            raise LayoutError(f"cp={self.grid.size('cp')} cuts every tensor of 2+ dims along dim 1 (the sequence), "
                              f"but their dim 1 differ: {listed}; define cp_shard_batch(batch, shard) on the "
                              "LightningModule to say which tensors carry the sequence")
        return _map_sequence_tensors(batch, lambda tensor, path: cut(tensor))

    def on_train_start(self) -> None:
        super().on_train_start()
        self.checkpointer.open_window()

    def on_train_end(self) -> None:
        """Commits a pending ``async_checkpoint`` save (collective: every rank ends training here, after the
        callbacks' ``on_train_end``); saves from here on are synchronous."""
        self.checkpointer.close_window()
        super().on_train_end()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.checkpointer.settle(poll=True)  # commit an async_checkpoint save once every rank has written it

    def training_step(self, *args: Any, **kwargs: Any):
        self.checkpointer.restore_rng()  # a loaded checkpoint's, where the uninterrupted run drew next
        if args:
            args = (self.shard_batch(args[0]), *args[1:])
        self._skip_step = False
        if self.pipeline_driver is None:
            out = super().training_step(*args, **kwargs)
        else:
            with self.precision_plugin.train_step_context():
                out = self._user_step("training_step", *args, **kwargs)
        if self.nonfinite_loss is not NonFiniteLoss.OFF:
            self._check_loss(out, args[1] if len(args) > 1 else kwargs.get("batch_idx"))
        return out

    # --- non-finite losses (nonfinite_loss) --------------------------------------------------------------------

    def _check_loss(self, output: Any, batch_idx: Any) -> None:
        """One all-reduce of every rank's loss (0 where a rank has none); raise or mark the step skipped on every
        rank alike when any is NaN or infinite (see the class docstring)."""
        import torch.distributed as dist

        loss = output.get("loss") if isinstance(output, Mapping) else output
        loss = loss.detach() if isinstance(loss, torch.Tensor) else None
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        device = loss.device if loss is not None else self.root_device
        values = torch.zeros(world, dtype=torch.float64, device=device)
        if loss is not None:
            values[dist.get_rank() if world > 1 else 0] = loss.double().sum()
        if world > 1:
            dist.all_reduce(values)
        bad = [(rank, value) for rank, value in enumerate(values.tolist()) if not math.isfinite(value)]
        if not bad:
            return
        trainer = self.lightning_module.trainer
        listed = ", ".join(f"rank {rank}: {value}" for rank, value in bad[:8])
        more = f" and {len(bad) - 8} more ranks" if len(bad) > 8 else ""
        where = (f"non-finite training loss at global step {trainer.global_step} (epoch {trainer.current_epoch}, "
                 f"batch {batch_idx}): {listed}{more}")
        if self.nonfinite_loss is NonFiniteLoss.RAISE:
            raise NonFiniteLossError(f"{where}; stopped before its optimizer step (lower the learning rate, check "
                                     "the data and the weights; nonfinite_loss='skip' leaves such steps out)")
        if not self.lightning_module.automatic_optimization:
            raise ContractError(f"{where}: nonfinite_loss='skip' needs automatic optimization (this module steps "
                                "its optimizers itself, inside training_step)")
        warnings.warn(f"{where}; skipped: no backward and no optimizer step for this batch (nonfinite_loss='skip')",
                      RuntimeWarning, stacklevel=2)
        self._skip_step = True

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any):
        """Lightning's, except for a batch ``nonfinite_loss='skip'`` leaves out: its closure (the step, which
        marks it) runs, its backward and optimizer step do not (:meth:`backward` sees the mark)."""
        if self.nonfinite_loss is not NonFiniteLoss.SKIP:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        result = closure()
        if self._skip_step:
            self._skip_step = False
            return result
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        if args:
            args = (self.shard_batch(args[0]), *args[1:])
        if self.pipeline_driver is None:
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self._user_step("validation_step", *args, **kwargs)

    def _user_step(self, name: str, *args: Any, **kwargs: Any):
        """Under pp > 1: the user's own step, called once per batch (its metrics, logging and hooks run as
        at pp = 1); it must run the pipeline once through :meth:`pipeline`. The stages' forwards go through
        the DeepSpeed engine from there, so the step itself is not redirected through it."""
        module = self.lightning_module
        self._pipeline_runs = 0
        out = getattr(module, name)(*args, **kwargs)
        if self._pipeline_runs != 1:
            raise ContractError(f"{type(module).__name__}.{name} called self.trainer.strategy.pipeline(batch) "
                                f"{self._pipeline_runs} times in one batch with pp={self.layout.pp}: with "
                                "pp > 1 the step must run the pipeline exactly once (its loss is the batch loss)")
        return out

    def pipeline(self, batch: Any, *, outputs: bool = False) -> torch.Tensor | tuple[torch.Tensor, list | None]:
        """Run the model's pipeline on ``batch`` (an ``(inputs, targets)`` pair; this CP rank's share) and
        return the batch loss: the mean of the micro-batch losses, the same float64 value on every rank of the
        pipeline. In training (``trainer.training``) the micro-batches' backwards run inside it, following the
        configured schedule; in evaluation it runs the forward-only schedule.

        Call it once from ``training_step``/``validation_step``. With pp = 1 it runs the module's
        ``pipeline_layers()`` in order and returns ``pipeline_loss`` with its graph (Lightning then runs the
        backward), so one step body serves every layout. ``outputs=True`` returns ``(loss, outputs)``: the last
        stage's output of every micro-batch, in order and detached (what ``pipeline_loss`` received), on the
        rank holding the last stage, and None on the others (with pp = 1, one output: the whole batch's).
        The per-micro-batch losses are in ``pipeline_driver.micro_losses`` there.
        """
        inputs, targets = self._pipeline_batch(batch)
        module = self.lightning_module
        if self.pipeline_driver is None:
            x = inputs
            for layer in module.pipeline_layers():
                x = layer(x)
            loss = module.pipeline_loss(x, targets)
            return (loss, [x.detach()]) if outputs else loss
        self._pipeline_runs += 1
        driver = self.pipeline_driver
        run = driver.train_batch if module.trainer.training else driver.eval_batch
        loss = run(inputs, targets, outputs=outputs)
        if not outputs:
            return loss
        return loss, (driver.micro_outputs if self.grid.is_last_stage else None)

    def backward(self, closure_loss, optimizer, *args: Any, **kwargs: Any):
        # With pp > 1 the pipeline engine already ran every micro-batch's backward inside training_step: only
        # the hooks that follow a backward run (on_after_backward, for callbacks and the module).
        if self._skip_step:  # nonfinite_loss='skip' leaves this batch out (pp = 1 only)
            return closure_loss
        if self.pipeline_driver is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @staticmethod
    def _pipeline_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
            raise ContractError(f"with pp > 1 a batch must be an (inputs, targets) pair, got "
                                f"{type(batch).__name__} of length {len(batch) if hasattr(batch, '__len__') else '?'}")
        return batch[0], batch[1]

    def describe(self) -> dict[str, Any]:
        """The layout as plain values (for hparams, checkpoints and logs)."""
        record = self.layout.record()
        record.pop("world_size")
        return record


check_strategy()  # the protected members of DeepSpeedStrategy overridden and called above exist


def _nonfinite_mode(value: Any, *, pp: int) -> NonFiniteLoss:
    """``nonfinite_loss`` as a :class:`NonFiniteLoss`; ContractError naming it when unknown, or 'skip' with pp > 1."""
    try:
        mode = NonFiniteLoss(value)
    except (ValueError, TypeError):
        raise ContractError(f"nonfinite_loss={value!r} must be one of {[m.value for m in NonFiniteLoss]}") from None
    if mode is NonFiniteLoss.SKIP and pp > 1:
        raise ContractError(f"nonfinite_loss='skip' with pp={pp}: the pipeline runs every micro-batch's backward "
                            "inside training_step, before the batch loss is known, so a step cannot be left out; "
                            "use 'raise'")
    return mode


def _map_sequence_tensors(value: Any, fn, path: str = "batch") -> Any:
    """``value`` with every tensor of two or more dims (in nested dicts, lists, tuples) replaced by
    ``fn(tensor, path)``; ``path`` names where it sits (``batch[0]['ids']``)."""
    if isinstance(value, torch.Tensor):
        return fn(value, path) if value.dim() >= 2 else value
    if isinstance(value, dict):
        return {key: _map_sequence_tensors(item, fn, f"{path}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_sequence_tensors(item, fn, f"{path}[{i}]") for i, item in enumerate(value))
    return value


__all__ = ["HybridParallelStrategy", "NonFiniteLoss", "NonFiniteLossError", "Offload"]

