"""minidist: distributed training from scratch in NumPy.

Reading order (each module's docstring says what to read next):
    1. runtime/launch.py       one OS process per rank; failure semantics
    2. runtime/shm.py, p2p.py  the wire: shared-memory mailboxes, send/recv
    3. runtime/group.py        process groups; mesh.py: named axes
    4. collectives/            ring, tree, direct, all_to_all; simulated.py is the oracle
    5. autograd/, nn/, optim/  the tiny autograd and the GPT model
    6. baseline.py             single-process training: the ground truth
"""

from minidist.runtime import (CollectiveMismatch, CollectiveTimeout, RankFailure, get_rank,
                              get_world_size, init, new_group, spawn)

__all__ = ["CollectiveMismatch", "CollectiveTimeout", "RankFailure", "get_rank",
           "get_world_size", "init", "new_group", "spawn"]
