"""The rank runtime: launching ranks, the shared-memory wire, groups and meshes.

Read in this order: launch.py (process_setup.py, rank_output.py), report.py, shm.py,
wait.py, p2p.py, call.py, records.py, flight.py, watch.py, group.py, job.py, world.py,
mesh.py, then process_group_api.py (the torch.distributed-style lifecycle), mpi.py (the
transport across machines), nodes.py (emulated nodes: a slower link between groups of
ranks) and dry_run.py (a transport that moves nothing: one rank of any world, counted).
"""

from minidist.runtime.errors import CollectiveMismatch, CollectiveTimeout, RankFailure
from minidist.runtime.group import ProcessGroup, SharedBuffer, Work
from minidist.runtime.launch import RankContext, init, run_script, spawn
from minidist.runtime.world import get_rank, get_world_size, is_initialized, new_group, world

__all__ = ["CollectiveMismatch", "CollectiveTimeout", "RankFailure", "ProcessGroup",
           "SharedBuffer", "Work", "RankContext", "init", "run_script", "spawn", "get_rank",
           "get_world_size", "is_initialized", "new_group", "world"]
