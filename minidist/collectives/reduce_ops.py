"""Reduction operators: how two ranks' arrays are combined into one.

A reducing collective (reduce, all_reduce, reduce_scatter) folds W arrays into
one with a binary, elementwise operator. This module is the only place that
knows what "sum", "avg", "max", "min" and "prod" mean, so every algorithm and
the oracle in simulated.py combine numbers in exactly the same way.

Fixed operand order. `combine(op, a, b)` always computes a (op) b with `a`
the accumulator that holds the LOWER ranks' contributions and `b` the incoming
higher-rank operand. IEEE addition and multiplication are commutative bitwise
(a + b == b + a), but not associative: ((x0 + x1) + x2) and (x0 + (x1 + x2))
may differ in the last bit. Which partial sums an algorithm forms is therefore
part of its numerics, and each algorithm's docstring states it. Only
collectives/direct.py uses the canonical order x0, x1, ..., x_{W-1} for every
element, which makes its result bitwise reproducible.

avg is sum followed by one division by W at the very end (never a running
mean), so avg and sum share every rounding step but the last. Integer arrays
have no exact mean; avg on them is refused with a ValueError that points to
op="sum" (then divide yourself). Bool arrays are refused for every op.

Shapes: every function is elementwise; operands have identical shape and dtype.
Read next: simulated.py (the oracle), then ring.py.
"""

from __future__ import annotations

import numpy as np

# name -> the NumPy ufunc that combines two operands (avg accumulates as a sum)
_UFUNCS = {
    "sum": np.add,
    "avg": np.add,
    "max": np.maximum,
    "min": np.minimum,
    "prod": np.multiply,
}
OPS: tuple[str, ...] = tuple(_UFUNCS)

# dtype kinds a reduction accepts: signed/unsigned int, float, complex. Bool is refused:
# np.add on bools is a logical or, which would silently make "sum" mean "any".
_REDUCIBLE_KINDS = "iufc"


def _is_ml_float(dtype: np.dtype) -> bool:
    """bf16 and the fp8 types of ml_dtypes (memory/precision.py): NumPy sees them as kind
    "V", yet they add like floats (each element in fp32, rounded back to the format)."""
    return dtype.kind == "V" and dtype.type.__module__.startswith("ml_dtypes")


def check_op(op: str, dtype: np.dtype, where: str = "reduction") -> str:
    """Return `op` if it is a known operator usable on `dtype`; raise ValueError otherwise."""
    if not isinstance(op, str) or op not in _UFUNCS:
        raise ValueError(
            f"{where}: unknown op {op!r}. Use one of {', '.join(map(repr, OPS))}.")
    dtype = np.dtype(dtype)
    if dtype.kind not in _REDUCIBLE_KINDS and not _is_ml_float(dtype):
        raise ValueError(
            f"{where}: cannot reduce arrays of dtype {dtype} with op={op!r}; reductions need "
            "an int, float or complex dtype. Convert first, e.g. x.astype(np.int64).")
    if op == "avg" and dtype.kind in "iu":
        raise ValueError(
            f"{where}: op='avg' on dtype {dtype} has no exact integer result. Use op='sum' "
            "and divide by the group size yourself, or cast to a float dtype first.")
    return op


def combine(op: str, acc: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Return acc (op) x elementwise; `acc` holds the lower ranks, `x` the higher ones.

    Pass out=acc to accumulate in place; the result is bitwise the same as the
    out-of-place `acc + x`, because a ufunc rounds each element once either way.
    """
    return _UFUNCS[op](acc, x, out=out)


def ufunc(op: str) -> np.ufunc:
    """The NumPy ufunc behind `op`, for transports that reduce straight out of a mailbox
    (`group.recv(..., combine=ufunc(op))` computes mine (op) incoming; commutative ops
    give the same bits as incoming (op) mine)."""
    return _UFUNCS[op]


def finish(op: str, acc: np.ndarray, W: int) -> np.ndarray:
    """Return the final value of a completed reduction of W operands held in `acc`.

    Only avg has a last step: divide the sum by W, with W cast to acc's own
    dtype so that float32 stays float32 (float32(W) is exact for W < 2**24).
    Every other op returns `acc` itself.
    """
    if op != "avg":
        return acc
    return acc / acc.dtype.type(W)


def fold_in_order(op: str, operands: list[np.ndarray]) -> np.ndarray:
    """Return ((x0 (op) x1) (op) x2) ... in the given order, as a new array (before finish).

    The canonical rank-order fold used by the oracle and by direct.py. It needs
    no identity element, so it needs at least one operand (W >= 1).
    """
    acc = np.array(operands[0], copy=True)
    for x in operands[1:]:
        combine(op, acc, x, out=acc)
    return acc
