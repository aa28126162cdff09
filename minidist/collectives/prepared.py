"""The lean call path: collectives whose signature was validated before.

Programs repeat their collectives with the same signature (a loss, a gradient norm, a
bucket, every step). The first call takes api.py's plain path: validate, pick the
algorithm, open the header scope, run. Its signature is then remembered in the group
(`group.prepared`) together with its header scope (runtime/group.py: reusable) and its
algorithm, so a later call with the same signature checks only that it is the same and
goes straight to the algorithm.

One rank's view of a call (api.all_reduce):
    1. key = (op name, reduce op, algo, dtype, shape); `lookup`: one dict lookup;
    2. found: drain this group's async queue, enter the scope, run the algorithm
       (the same objects the plain path built: the same bits, the same call records,
       mismatch checks, deadlines and flight-recorder entries);
    3. not found: the plain path, which `remember`s the signature at the end.
Validation is proportional to what changed: dtype, shape and arguments are part of the
key, so anything new takes the plain path and is checked there.
Cost: a few hundred ns of Python before the algorithm (bench collectives measures it).
Read next: api.py.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from minidist.collectives import cost

# Only synchronous calls are remembered. An "auto" choice that the formulas made (not
# fixed by cost.rule) follows the calibration file: its entry keeps the constants it was
# chosen with, and is used only while they are the ones in force (one identity check).

MAX_PREPARED = 4096            # signatures remembered per group (then forgotten)


def lookup(g, key: tuple, x: np.ndarray):
    """The prepared call for this signature, or None (not seen, x not contiguous, or an
    "auto" choice made under constants no longer in force)."""
    if not x.flags.c_contiguous:
        return None
    try:
        run = g.prepared.get(key)
    except TypeError:                  # an unhashable argument: the plain path says what
        return None                    # is wrong with it
    if run is None or run.constants is None or run.constants is cost.recent_constants(g.size):
        return run
    return None


def remember(g, key: tuple, async_op, algo, nbytes: int, body: Callable, op: str, x, *,
              root: int | None = None, reduce_op: str | None = None, name: str = "") -> None:
    """After a validated call: keep `body(x)` ready, in its header scope, for the next
    call with the same signature (see the module docstring)."""
    if async_op is not False:
        return
    chosen_by = None                   # the constants a formula-made choice depends on
    if algo == "auto" and cost.rule(op, nbytes, g.size,
                                    getattr(g, "supports_shared", False)) is None:
        chosen_by = cost.recent_constants(g.size)
    scope, drain = g.collective(op, x, root=root, reduce_op=reduce_op, algo=name), g.drain

    def run(x):
        drain()
        with scope:
            return body(x)

    run.constants = chosen_by
    if len(g.prepared) >= MAX_PREPARED:
        g.prepared.clear()
    g.prepared[key] = run
