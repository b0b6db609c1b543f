"""Every access to torch's private state that shardline makes, in one file, behind one version check.

Each private is a function (or a checked name) here, named after what it does for us, with what happens on a
torch release that moved it.

torch.distributed, for the fault machinery (:mod:`shardline.plugins.faults`):

- the c10d store every rank reaches, the default group, and every group that exists now with its c10d name
  (``distributed_c10d._get_default_store``, ``_get_default_group``, ``_world.pg_names``):
  :func:`default_store`, :func:`default_group`, :func:`process_groups`. The watchdog cannot work without them:
  :class:`TorchPrivateMissing`, naming the private and the torch version;
- a group's backend timeout (``distributed_c10d._set_pg_timeout``): :func:`set_group_timeout`. Without it the
  groups keep their own timeout (one warning): hangs are still noticed at the collective timeout, but a main
  thread waits in its collective until the backend gives up or the watchdog's exit guard ends the process;
- aborting the NCCL communicators (``distributed_c10d._abort_process_group``): :func:`abort_groups`. Without it
  nothing is aborted (one warning) and the exit guard ends a stuck rank, as on gloo;
- PyTorch's flight recorder (``torch._C._distributed_c10d._dump_fr_trace``): :func:`dump_flight_recorder`.
  Without it :func:`flight_recorder_available` is false, ``record="auto"`` falls back to our own record of the
  calls and ``record="flight_recorder"`` is refused at construction (:func:`require_flight_recorder`);
- a group's collective sequence number (``ProcessGroup._get_sequence_number_for_group``), for the test hook
  only: :func:`sequence_number_reader`, refused at construction without it.

nn.Module, Tensor and DataLoader internals, for the training side:

- a module's own parameter, buffer and child tables (``_parameters``, ``_buffers``,
  ``_non_persistent_buffers_set``, ``_modules``), which the pipeline's stage host shares rather than copies
  (:func:`share_module_tables`) and which are read or replaced slot by slot where a parameter must change
  identity without ``nn.Module.__setattr__``'s checks (:func:`parameter_table`, :func:`buffer_table`,
  :func:`non_persistent_buffers`);
- whether a tensor is a view of another (``Tensor._base``): :func:`is_view`;
- the dispatch-mode base class and pytree flattening (``torch.utils._python_dispatch.TorchDispatchMode``,
  ``torch.utils._pytree.tree_flatten``) for the sequence-parallel memory probe: :data:`TorchDispatchMode`,
  :func:`tree_flatten`;
- the DataLoader property its iterators take indices from (``DataLoader._index_sampler``), which the resumable
  loader overrides: :func:`check_index_sampler` refuses a torch without it (the override would silently not
  apply and a resume would restart the epoch).

``TESTED`` is the torch range these were checked against (the suite runs them); another version gets one
warning, since a private name may have moved.
"""

from __future__ import annotations

import datetime
import pickle
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardline.plugins.errors import ShardlineError

#: torch versions whose private state this file was checked against (the package admits torch >= 2.13).
TESTED = ((2, 13), (2, 14))
_warned: set[str] = set()


class TorchPrivateMissing(ShardlineError, RuntimeError):
    """The installed torch lacks a private shardline needs; the message names it and the version."""


def _tested() -> str:
    return f"{'.'.join(map(str, TESTED[0]))} up to {'.'.join(map(str, TESTED[1]))}"


def check_version() -> None:
    """Warn once when the installed torch is outside ``TESTED``."""
    parts = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:3] if p.isdigit())
    if "version" not in _warned and not TESTED[0] <= parts < TESTED[1]:
        _warned.add("version")
        warnings.warn(f"torch {torch.__version__} is outside the versions shardline's use of torch privates was "
                      f"tested with ({_tested()}); see shardline.plugins.torch_compat", stacklevel=2)


def _missing(name: str, used_for: str) -> TorchPrivateMissing:
    return TorchPrivateMissing(f"torch {torch.__version__} has no {name} ({used_for}); shardline's use of "
                               f"torch privates was tested with torch {_tested()}: see "
                               "shardline.plugins.torch_compat")


def _warn_missing(name: str, consequence: str) -> None:
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"torch {torch.__version__} has no {name}: {consequence} (shardline's use of torch "
                      f"privates was tested with torch {_tested()}; see shardline.plugins.torch_compat)",
                      stacklevel=3)


def _c10d(name: str, used_for: str):
    value = getattr(dist.distributed_c10d, name, None)
    if value is None:
        raise _missing(f"torch.distributed.distributed_c10d.{name}", used_for)
    return value


# --- the store and the groups -----------------------------------------------------------------------------------

def default_store() -> dist.Store:
    """The c10d store of the default group (every rank reaches it; it keeps working when collectives fail)."""
    return _c10d("_get_default_store", "the store the watchdog's ranks talk through")()


def store_client(store: dist.Store) -> dist.Store:
    """A connection of its own to ``store`` (``Store.clone``), so that a call of the watchdog's that never comes
    back (the store's host stopped) does not hold the connection torch's own calls use; ``store`` itself where it
    cannot be cloned."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):
        return store


def store_host() -> str | None:
    """``"host:port"`` of the TCPStore under the default store (it lives in rank 0's process: launchers start
    its server there); None for any other store (a file store has no host) or if it cannot be told."""
    try:
        store = default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        if isinstance(store, dist.TCPStore):
            return f"{store.host}:{store.port}"
    except (AttributeError, RuntimeError, TorchPrivateMissing):
        pass
    return None


def default_group() -> dist.ProcessGroup:
    """The default (world) process group."""
    return _c10d("_get_default_group", "the default process group")()


def process_groups() -> list[tuple[dist.ProcessGroup, str]]:
    """Every process group that exists now, with its c10d group name (a snapshot: groups made later are not in
    it)."""
    world = _c10d("_world", "the table of every process group")
    names = getattr(world, "pg_names", None)
    if names is None:
        raise _missing("torch.distributed.distributed_c10d._world.pg_names", "the table of every process group")
    return list(names.items())


def set_group_timeout(group: dist.ProcessGroup, timeout: datetime.timedelta) -> bool:
    """Set ``group``'s backend timeout to ``timeout``; False (one warning) where this torch cannot. The backend's
    own refusals (ValueError, RuntimeError, AssertionError) propagate."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        _warn_missing("torch.distributed.distributed_c10d._set_pg_timeout",
                      "the process groups keep their own collective timeouts")
        return False
    setter(timeout, group)
    return True


def abort_groups() -> bool:
    """Abort the default group's communicators (NCCL can abort a blocked one; gloo cannot); False (one warning)
    where this torch cannot, so that only the watchdog's exit guard ends a stuck rank."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        _warn_missing("torch.distributed.distributed_c10d._abort_process_group",
                      "blocked NCCL communicators are not aborted; the watchdog's exit guard ends a stuck rank")
        return False
    abort()
    return True


# --- the flight recorder ----------------------------------------------------------------------------------------

_FR_DUMP = "torch._C._distributed_c10d._dump_fr_trace"


def _fr_dump() -> Callable | None:
    return getattr(getattr(torch._C, "_distributed_c10d", None), "_dump_fr_trace", None)


def flight_recorder_available() -> bool:
    """Whether this torch can dump its flight recorder (whether the recorder is on is another matter)."""
    return _fr_dump() is not None


def require_flight_recorder() -> None:
    """TorchPrivateMissing where this torch cannot dump its flight recorder."""
    if _fr_dump() is None:
        raise _missing(_FR_DUMP, "the flight recorder asked for by record='flight_recorder'; record='auto' "
                                 "falls back to shardline's own record of the calls")


def dump_flight_recorder(*, entries: bool) -> dict:
    """The flight recorder's dump: always ``pg_status`` (per group, the last op ids enqueued, started and
    completed), and every entry when ``entries``; stack traces never."""
    dump = _fr_dump()
    if dump is None:
        require_flight_recorder()
    raw = dump(includeCollectives=entries, includeStackTraces=False, onlyActive=False)
    return pickle.loads(raw)  # torch's own bytes, made in this process just now: never a file a user hands us


# --- the test hook ----------------------------------------------------------------------------------------------

def sequence_number_reader(group: dist.ProcessGroup) -> Callable[[], int]:
    """A function returning ``group``'s collective sequence number (the same on every member): the number of
    collectives issued on it so far."""
    read = getattr(group, "_get_sequence_number_for_group", None)
    if read is None:
        raise _missing("ProcessGroup._get_sequence_number_for_group",
                       "the collective sequence number the injected-hang test hook counts")
    return read


# --- nn.Module, Tensor and DataLoader internals ------------------------------------------------------------------

def share_module_tables(host: nn.Module, module: nn.Module) -> None:
    """Make ``host`` a second view of ``module``'s tree: the same parameter, buffer and child tables (the
    objects, not copies), so that both see every later change."""
    host._parameters = module._parameters
    host._buffers = module._buffers
    host._non_persistent_buffers_set = module._non_persistent_buffers_set
    host._modules = module._modules


def parameter_table(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameters by attribute name (not its children's): the live table, so that deleting or
    assigning an entry bypasses ``nn.Module.__setattr__`` (a parameter replaced by a plain tensor, say)."""
    return module._parameters


def buffer_table(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffers by attribute name: the live table (see :func:`parameter_table`)."""
    return module._buffers


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of ``module``'s own buffers registered with ``persistent=False`` (left out of its state dict)."""
    return module._non_persistent_buffers_set


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor's storage."""
    return tensor._base is not None


def check_index_sampler(loader_class: type) -> None:
    """Refuse a torch whose ``DataLoader`` no longer takes its iterators' indices from ``_index_sampler``,
    which ``loader_class`` overrides to resume mid-epoch: the override would be silently ignored."""
    from torch.utils.data import DataLoader

    if not isinstance(getattr(DataLoader, "_index_sampler", None), property):
        raise _missing("torch.utils.data.DataLoader._index_sampler",
                       f"where {loader_class.__name__} skips the samples already drawn")


__all__ = ["TESTED", "TorchPrivateMissing", "abort_groups", "check_version", "default_group", "default_store",
           "dump_flight_recorder", "flight_recorder_available", "process_groups", "require_flight_recorder",
           "sequence_number_reader", "set_group_timeout", "store_client", "store_host",
           "TorchDispatchMode", "buffer_table", "check_index_sampler", "is_view", "non_persistent_buffers",
           "parameter_table", "share_module_tables", "tree_flatten"]


# --- grouped matmul, for the MoE experts --------------------------------------------------------------------------

def grouped_mm() -> Callable | None:
    """torch's grouped matmul (``torch.nn.functional.grouped_mm`` in the torch versions of ``TESTED``; else the
    private ``torch._grouped_mm`` it wraps), or None where this torch has neither: the MoE experts then multiply one
    expert at a time (:func:`shardline.plugins.layers.moe.grouped_matmul`). Called as ``fn(a, b, offs=offs)``
    with ``a: [rows, k]`` grouped by expert, ``b: [experts, k, n]`` and ``offs`` the int32 end row of each group;
    its kernels want bfloat16 on CUDA (SM >= 80) and rows of 16-byte multiples."""
    import torch.nn.functional as F

    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


__all__ += ["grouped_mm"]
