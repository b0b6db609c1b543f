"""The kinds every profiling module names: the event ``Category`` (what a row is), the ``Lane`` it runs on
(GPU or CPU) and the ``dim`` of a communication row no rule names (``UNKNOWN_DIM``)."""

from __future__ import annotations

import enum

import numpy as np

from ..base.schema import COMM_CATEGORIES, P2P_CATEGORIES


class Category(str, enum.Enum):
    """Our event categories (``schema.CATEGORIES``); the value is the string stored in the table."""

    COMPUTE = "compute"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    P2P_SEND = "p2p_send"
    P2P_RECV = "p2p_recv"
    BARRIER = "barrier"
    OTHER_COMM = "other_comm"
    MEMCPY_H2D = "memcpy_h2d"
    MEMCPY_D2H = "memcpy_d2h"
    MEMCPY_D2D = "memcpy_d2d"
    MEMSET = "memset"
    SYNC = "sync"
    IDLE = "idle"


class Lane(str, enum.Enum):
    """Lane kind of the events table (``lane`` column), and the kind a rank is attributed on."""

    GPU = "gpu"
    CPU = "cpu"


UNKNOWN_DIM = "unknown"


#: Category strings by code; the per-row work runs on these small int codes, never on per-row strings.
CATEGORY_NAMES = tuple(c.value for c in Category)
CATEGORY_CODE = {name: i for i, name in enumerate(CATEGORY_NAMES)}
NO_CATEGORY = len(CATEGORY_NAMES)  # "": no category from this evidence
COMM_CODES = np.array([name in COMM_CATEGORIES for name in CATEGORY_NAMES] + [False], dtype=bool)
P2P_CODES = np.array([name in P2P_CATEGORIES for name in CATEGORY_NAMES] + [False], dtype=bool)
