"""minidist: distributed training from scratch in NumPy.

Reading order (each module's docstring says what to read next):
    1. runtime/launch.py       one OS process per rank; what happens when one fails
    2. runtime/shm.py, wait.py, p2p.py   the wire: a shared arena, polling, mailboxes
    3. runtime/call.py, records.py, flight.py, watch.py, group.py, world.py, mesh.py
                               calls and their records, failure watching, groups, the mesh
    4. collectives/            simulated.py (the oracle), ring, tree, halving, direct, all_to_all
    5. autograd/               Tensor, Function, ops, fused ops, gradcheck
    6. nn/, optim/             the GPT (and its MoE), AdamW and SGD
    7. seed.py, data.py        layout-independent parameters and batches
    8. baseline.py             single-process training: the ground truth
    9. train.py, parallel/     the per-rank loop, then one subpackage per parallelism (data,
                               zero, tensor, context, pipeline, expert), applied in order
                               by parallel/compose.py and checked against the baseline

The names below are the torch.distributed-shaped API; they are loaded on first use, so
`import minidist.baseline` does not pull in the runtime.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"          # setup.cfg's [metadata] version (tests/test_cli.py checks)

_EXPORTS = {
    "minidist.runtime": ("spawn", "init", "get_rank", "get_world_size", "new_group",
                         "RankFailure", "CollectiveTimeout", "CollectiveMismatch"),
    "minidist.collectives": ("broadcast", "reduce", "all_reduce", "reduce_scatter",
                             "all_gather", "gather", "scatter", "all_to_all", "barrier",
                             "send", "recv"),
    "minidist.collectives.api": ("isend", "irecv"),
    "minidist.runtime.process_group_api": ("init_process_group", "destroy_process_group",
                                           "is_initialized", "get_backend"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'minidist' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value             # found once: later lookups skip this hook (~4 us)
    return value
