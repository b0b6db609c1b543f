"""The duck-typed "model parallel unit" DeepSpeed reads (``deepspeed.initialize(mpu=grid.mpu)``).

DeepSpeed 0.19 asks an ``mpu`` for these groups (found by reading ``deepspeed/utils/groups.py``,
``runtime/engine.py``, ``runtime/config.py``, ``runtime/utils.py`` and the ZeRO optimizers):

=====================================  ================  ===========================================================
method family                          our axis          what DeepSpeed does with it
=====================================  ================  ===========================================================
``get_data_parallel_*`` (+ ``_ranks``)  ``dp``            batch-size arithmetic (train_batch_size = micro * accum * dp)
``get_sequence_data_parallel_*``        ``dp_cp``         ZeRO partitions and reduces gradients over this group
``get_sequence_parallel_*``             ``cp``            the sequence-parallel degree (gradient averaging)
``get_tensor_model_parallel_*``         ``tp``            de-duplicates replicated params in the gradient norm
``get_slice_parallel_*``                ``tp``            older name of the same
``get_model_parallel_*``                ``mp`` (tp x pp)  gradient-norm and overflow all-reduce; checkpoint naming
``get_pipeline_model_parallel_*``       ``pp``            pipeline degree
``get_pipe_parallel_*``                 ``pp``            older name of the same
=====================================  ================  ===========================================================

So ZeRO shards over the data-parallel ranks only (times cp when the sequence is sharded), never over TP or PP
ranks. The object deliberately has no ``initialize_sequence_parallel``: DeepSpeed takes that attribute as the
sign of its own Ulysses mpu and then ignores ``get_data_parallel_group``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardline.plugins.grid import Grid


class GridMpu:
    """DeepSpeed's ``mpu`` protocol over a :class:`~shardline.plugins.grid.Grid`."""

    def __init__(self, grid: Grid):
        self.grid = grid

    # data parallel (batch arithmetic)
    def get_data_parallel_group(self):
        return self.grid.group("dp")

    def get_data_parallel_rank(self) -> int:
        return self.grid.rank("dp")

    def get_data_parallel_world_size(self) -> int:
        return self.grid.size("dp")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.grid.ranks("dp")

    # ZeRO's partition group
    def get_sequence_data_parallel_group(self):
        return self.grid.group("dp_cp")

    def get_sequence_data_parallel_rank(self) -> int:
        return self.grid.rank("dp_cp")

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.grid.size("dp_cp")

    # sequence / context parallel
    def get_sequence_parallel_group(self):
        return self.grid.group("cp")

    def get_sequence_parallel_rank(self) -> int:
        return self.grid.rank("cp")

    def get_sequence_parallel_world_size(self) -> int:
        return self.grid.size("cp")

    # tensor parallel, under its current and its older name
    def get_tensor_model_parallel_group(self):
        return self.grid.group("tp")

    def get_tensor_model_parallel_rank(self) -> int:
        return self.grid.rank("tp")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.grid.size("tp")

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.grid.ranks("tp")[0]

    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size

    # model parallel = tp x pp: every rank holding a distinct part of one replica's parameters
    def get_model_parallel_group(self):
        return self.grid.group("mp")

    def get_model_parallel_rank(self) -> int:
        return self.grid.rank("mp")

    def get_model_parallel_world_size(self) -> int:
        return self.grid.size("mp")

    # pipeline, under its current and its older name
    def get_pipeline_model_parallel_group(self):
        return self.grid.group("pp")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.grid.rank("pp")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.grid.size("pp")

    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size

    def __repr__(self) -> str:
        return f"GridMpu(rank={self.grid.global_rank}, {self.grid.coords})"
