"""gradcheck: test a backward rule against central finite differences in float64.

For f = fn(*inputs) and a fixed random array u of f's shape, the scalar
L = sum(u * f) has gradient dL/dx = J^T u, where J is the Jacobian of f with
respect to an input x. Autograd gives J^T u from one backward; the same
number is also the directional slope of L, which central differences measure
element by element:

    dL/dx_k ~ (L(x + eps e_k) - L(x - eps e_k)) / (2 eps),   error O(eps^2).

A random u (rather than all ones) makes every output element count with a
different weight, so a backward that mixes up positions, forgets a term or
sums over the wrong axis is caught. Cost: 2 forward passes per input element,
so keep the inputs small (a few dozen elements).

Everything runs in float64: with eps = 1e-6, float32's 1e-7 resolution would
drown the slope in rounding error.

Read next: tests/autograd/test_gradcheck.py (gradcheck catching a wrong backward)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy  # only for the seeded random weights u; the math goes through backend.xp

from minidist import backend
from minidist.autograd.tensor import Tensor, no_grad


def gradcheck(fn: Callable[..., Tensor], inputs: Sequence[Any], eps: float = 1e-6,
              atol: float = 1e-6, rtol: float = 1e-5, seed: int = 0) -> bool:
    """Return True if autograd's gradients of fn match finite differences; raise otherwise.

    inputs: Tensors (those with requires_grad=True are checked) and constants,
    passed to fn positionally. Float Tensors are copied to float64 first;
    the caller's tensors are left untouched. An element fails when
    |analytic - numeric| > atol + rtol * |numeric|; the AssertionError names
    the input, the worst element and both values.
    """
    xp = backend.xp
    args = [_as_float64(x) for x in inputs]
    out = fn(*args)
    u = xp.asarray(numpy.random.default_rng(seed).standard_normal(out.shape))
    (out * u).sum().backward()

    def loss() -> float:
        return float((fn(*args).data * u).sum())

    for i, x in enumerate(args):
        if not (isinstance(x, Tensor) and x.requires_grad):
            continue
        analytic = x.grad if x.grad is not None else xp.zeros_like(x.data)
        numeric = _central_differences(loss, x.data, eps)
        _compare(i, x.shape, analytic, numeric, atol, rtol)
    return True


def _as_float64(x: Any) -> Any:
    if isinstance(x, Tensor) and x.dtype.kind == "f":
        return Tensor(x.data.astype(backend.xp.float64, copy=True), x.requires_grad)
    return x


def _central_differences(loss: Callable[[], float], data: Any, eps: float) -> Any:
    """(loss(x + eps e_k) - loss(x - eps e_k)) / (2 eps) for every k, perturbing data in place."""
    numeric = backend.xp.zeros(data.shape, dtype=backend.xp.float64)
    flat, out = data.reshape(-1), numeric.reshape(-1)        # views: data is our own copy
    with no_grad():
        for k in range(flat.size):
            orig = float(flat[k])
            flat[k] = orig + eps
            up = loss()
            flat[k] = orig - eps
            down = loss()
            flat[k] = orig
            out[k] = (up - down) / (2 * eps)
    return numeric


def _compare(i: int, shape: tuple, analytic: Any, numeric: Any, atol: float,
             rtol: float) -> None:
    if analytic.shape != numeric.shape:
        raise AssertionError(f"gradcheck: input {i}: gradient has shape {analytic.shape}, "
                             f"the input has shape {numeric.shape}")
    excess = abs(analytic - numeric) - (atol + rtol * abs(numeric))
    if excess.size and float(excess.max()) > 0:
        k = int(excess.argmax())
        where = tuple(int(j) for j in numpy.unravel_index(k, shape))
        a, n = float(analytic.reshape(-1)[k]), float(numeric.reshape(-1)[k])
        bad = int((excess > 0).sum())
        raise AssertionError(
            f"gradcheck: input {i} (shape {shape}): {bad} of {numeric.size} gradient elements "
            f"disagree; worst at index {where}: autograd {a:.10g} vs finite differences "
            f"{n:.10g} (|diff| {abs(a - n):.3g} > atol {atol:g} + rtol {rtol:g} * |numeric|)"
        )
