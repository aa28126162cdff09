"""Function: one differentiable operation, written as a forward and a backward rule.

Every operation in the autograd (and every operation whose backward is a
collective, in parallel/) is a subclass with two static methods:

    class Scale(Function):
        '''y = a * x  ->  dx = a * dy'''
        @staticmethod
        def forward(ctx, x, *, a):
            ctx.a = a
            return a * x
        @staticmethod
        def backward(ctx, dy):
            return (ctx.a * dy,)

    y = Scale.apply(x_tensor, a=2.0)

`apply` unwraps Tensor arguments to their xp arrays, calls forward, and wraps
the result in a Tensor. If gradients are enabled and any Tensor argument
requires grad, the result remembers (backward, ctx, inputs) so that
Tensor.backward can later call `backward(ctx, dy)`. backward returns one
gradient per positional input (None for inputs that need none, e.g. constants
or integer ids), each with the shape of that input. Keyword arguments are
passed through to forward and are never differentiated. Two rules keep
gradients safe to share: backward never writes into the `grad` it receives
(other rules may hold the same array), and never returns an array it keeps.

The ctx is a plain object: forward stores whatever backward needs on it, with
`ctx.save_for_backward(*arrays)` for arrays (read back as `ctx.saved_tensors`)
or as attributes. `ctx.needs_input_grad[i]` tells both rules whether input i
needs a gradient, so that work for constants can be skipped.

Reference: PyTorch's torch.autograd.Function has the same interface.
Read next: autograd/ops.py
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

from minidist import backend
from minidist.autograd import tensor as _tensor
from minidist.autograd.tensor import Tensor


# Called as after_apply(cls, args, result) after every operation when set; check mode of
# parallel/placement.py uses it to pass activation placements on. None: no cost but a test.
after_apply = None
# Called as on_forward(cls, ctx, arrays, kwargs, result) after every forward when set;
# observe/flops.py's FLOP ledger counts there. None: no cost but a test. A hook that may share
# the slot keeps the previous value, calls it too and puts it back (memory/ledger.py).
on_forward = None
# Called as trace_op(cls, t0, result) after every forward when set, t0 = perf_counter() taken
# before it: observe/run_dir.py's trace (which wraps the node's backward to time it too).
# None: no cost but two tests.
trace_op = None


class Context:
    """What forward leaves for backward: saved arrays plus any attributes it sets."""

    def save_for_backward(self, *arrays: Any) -> None:
        """Keep references (no copies) to arrays that backward needs."""
        self.saved_tensors = arrays


class Function:
    """Base class of differentiable operations; subclasses define forward and backward."""

    @staticmethod
    def forward(ctx: Context, *args: Any, **kwargs: Any) -> Any:
        """Compute the output array from input arrays (Tensors arrive unwrapped)."""
        raise NotImplementedError("a Function subclass must define forward(ctx, ...)")

    @staticmethod
    def backward(ctx: Context, grad: Any) -> Any:
        """Map dL/d(output) to a tuple of dL/d(input_i), one entry (or None) per input."""
        raise NotImplementedError("a Function subclass must define backward(ctx, grad)")

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Tensor:
        """Run forward on the unwrapped arguments; record the node if a gradient is needed."""
        ctx = Context()
        arrays, parents, needs = [], [], []
        track = False
        for a in args:
            if isinstance(a, Tensor):
                arrays.append(a.data)
                rg = a.requires_grad
                parents.append(a if rg else None)
                needs.append(rg)
                track = track or rg
            else:
                arrays.append(a)
                parents.append(None)
                needs.append(False)
        track = track and _tensor.grad_enabled
        ctx.needs_input_grad = needs
        t0 = perf_counter() if trace_op is not None else 0.0
        out = cls.forward(ctx, *arrays, **kwargs)
        if not isinstance(out, backend.xp.ndarray):       # e.g. a NumPy scalar from a sum
            out = backend.xp.asarray(out)
        result = Tensor.__new__(Tensor)
        result.data = out
        result.grad = None
        result.requires_grad = track
        result._node = (cls.backward, ctx, parents) if track else None
        if on_forward is not None:
            on_forward(cls, ctx, arrays, kwargs, result)
        if after_apply is not None:
            after_apply(cls, args, result)
        if trace_op is not None:
            trace_op(cls, t0, result)
        return result
