"""The basic operations: elementwise arithmetic, reductions, reshapes and indexing.

Each operation is a Function whose docstring gives the forward and the
backward rule. Notation: x, a, b are inputs, y the output, g = dL/dy the
incoming gradient, and the rule gives dL/dx. Products are elementwise.

Broadcasting. NumPy stretches a size-1 (or missing leading) axis of an input
to the size of the output. In the forward that reuses one input element for
many output elements, so in the backward the gradients of all those output
elements add up: `unbroadcast` sums g over the stretched axes to get back to
the input's shape. Example: a (3, 1, 4) + b (4,) -> y (3, 1, 4);
da = g, db = g summed over axes 0 and 1.

Constants (Python numbers, xp arrays) may appear wherever a Tensor may; they
receive no gradient. Results keep the dtype NumPy gives them: a float32
Tensor times a Python float stays float32.

Read next: autograd/functional.py
"""

from __future__ import annotations

from typing import Any

from minidist import backend
from minidist.autograd.function import Context, Function
from minidist.autograd.tensor import Tensor


def unbroadcast(g: Any, shape: tuple) -> Any:
    """Sum g over the axes that broadcasting added or stretched, returning shape `shape`."""
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    if lead:
        g = g.sum(axis=tuple(range(lead)))                   # axes the input did not have
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if stretched:
        g = g.sum(axis=stretched, keepdims=True)             # size-1 axes the input had
    return g


def _shape(a: Any) -> tuple:
    return a.shape if hasattr(a, "shape") else ()


class Add(Function):
    """y = a + b.  da = unbroadcast(g), db = unbroadcast(g)."""

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.shapes = (_shape(a), _shape(b))
        return a + b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        na, nb = ctx.needs_input_grad
        sa, sb = ctx.shapes
        return (unbroadcast(g, sa) if na else None, unbroadcast(g, sb) if nb else None)


class Sub(Function):
    """y = a - b.  da = unbroadcast(g), db = -unbroadcast(g)."""

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.shapes = (_shape(a), _shape(b))
        return a - b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        na, nb = ctx.needs_input_grad
        sa, sb = ctx.shapes
        return (unbroadcast(g, sa) if na else None, -unbroadcast(g, sb) if nb else None)


class Mul(Function):
    """y = a * b.  da = unbroadcast(g * b), db = unbroadcast(g * a)."""

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        na, nb = ctx.needs_input_grad
        a, b = ctx.saved_tensors
        da = unbroadcast(g * b, _shape(a)) if na else None
        db = unbroadcast(g * a, _shape(b)) if nb else None
        return da, db


class Div(Function):
    """y = a / b.  da = unbroadcast(g / b), db = unbroadcast(-(g / b) * y)   (y = a / b)."""

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        y = a / b
        ctx.save_for_backward(a, b, y)
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        na, nb = ctx.needs_input_grad
        a, b, y = ctx.saved_tensors
        g_over_b = g / b
        da = unbroadcast(g_over_b, _shape(a)) if na else None
        db = unbroadcast(-g_over_b * y, _shape(b)) if nb else None
        return da, db


class Neg(Function):
    """y = -x.  dx = -g."""

    @staticmethod
    def forward(ctx: Context, x: Any) -> Any:
        return -x

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return (-g,)


class Pow(Function):
    """y = x ** p for a constant number p.  dx = g * p * x ** (p - 1)."""

    @staticmethod
    def forward(ctx: Context, x: Any, *, p: float) -> Any:
        ctx.save_for_backward(x)
        ctx.p = p
        return x ** p

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        (x,) = ctx.saved_tensors
        p = ctx.p
        return (g * (2 * x) if p == 2 else g * (p * x ** (p - 1)),)


def pow(x: Tensor, p: float) -> Tensor:
    """x ** p with p a Python number (a Tensor exponent is not supported)."""
    if isinstance(p, Tensor) or hasattr(p, "shape"):
        raise ValueError(
            "x ** p: only a constant number p is supported, got an array/Tensor exponent. "
            "Write exp(p * log(x)) for a differentiable exponent."
        )
    return Pow.apply(x, p=p)


class Exp(Function):
    """y = exp(x).  dx = g * y."""

    @staticmethod
    def forward(ctx: Context, x: Any) -> Any:
        y = backend.xp.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return (g * ctx.saved_tensors[0],)


class Log(Function):
    """y = log(x) (natural).  dx = g / x."""

    @staticmethod
    def forward(ctx: Context, x: Any) -> Any:
        ctx.save_for_backward(x)
        return backend.xp.log(x)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return (g / ctx.saved_tensors[0],)


class Tanh(Function):
    """y = tanh(x).  dx = g * (1 - y^2)."""

    @staticmethod
    def forward(ctx: Context, x: Any) -> Any:
        y = backend.xp.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        y = ctx.saved_tensors[0]
        return (g * (1 - y * y),)


def _axes(axis: Any, ndim: int) -> tuple:
    """Normalise axis (None, int or tuple, possibly negative) to a sorted tuple."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int):
        axis = (axis,)
    return tuple(sorted(a % ndim for a in axis))


def _expand_reduced(g: Any, ctx: Context) -> Any:
    """Give g back the reduced axes as size 1, so it broadcasts against the input."""
    return g if ctx.keepdims else g.reshape(ctx.kept_shape)


def _save_reduction(ctx: Context, x: Any, axis: Any, keepdims: bool) -> tuple:
    axes = _axes(axis, x.ndim)
    ctx.shape, ctx.keepdims = x.shape, keepdims
    ctx.kept_shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
    return axes


class Sum(Function):
    """y = sum of x over `axis`.  dx = g broadcast back over the summed axes."""

    @staticmethod
    def forward(ctx: Context, x: Any, *, axis: Any = None, keepdims: bool = False) -> Any:
        axes = _save_reduction(ctx, x, axis, keepdims)
        return x.sum(axis=axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return (backend.xp.broadcast_to(_expand_reduced(g, ctx), ctx.shape),)


class Mean(Function):
    """y = sum of x over `axis` / n (n = elements per output).  dx = g / n, broadcast back."""

    @staticmethod
    def forward(ctx: Context, x: Any, *, axis: Any = None, keepdims: bool = False) -> Any:
        axes = _save_reduction(ctx, x, axis, keepdims)
        n = 1
        for a in axes:
            n *= x.shape[a]
        ctx.n = n
        return x.mean(axis=axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return (backend.xp.broadcast_to(_expand_reduced(g, ctx) / ctx.n, ctx.shape),)


class Max(Function):
    """y = max of x over `axis`.

    dx = g at the positions that attain the max, 0 elsewhere; when k elements
    tie for the max each gets g / k (the subgradient that treats them alike).
    """

    @staticmethod
    def forward(ctx: Context, x: Any, *, axis: Any = None, keepdims: bool = False) -> Any:
        axes = _save_reduction(ctx, x, axis, keepdims)
        y = x.max(axis=axes, keepdims=True)
        ctx.save_for_backward(x, y)
        ctx.axes = axes
        return y if keepdims else y.reshape([n for i, n in enumerate(x.shape) if i not in axes])

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        x, y = ctx.saved_tensors
        hit = x == y                                        # where the max is attained
        ties = hit.sum(axis=ctx.axes, keepdims=True, dtype=g.dtype)   # k >= 1 per output
        return (hit * (_expand_reduced(g, ctx) / ties),)


class Reshape(Function):
    """y = x with a new shape (same elements in C order).  dx = g reshaped to x's shape."""

    @staticmethod
    def forward(ctx: Context, x: Any, *, shape: tuple) -> Any:
        ctx.shape = x.shape
        return x.reshape(shape)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return (g.reshape(ctx.shape),)


def reshape(x: Tensor, *shape: Any) -> Tensor:
    """x.reshape(2, 3) or x.reshape((2, 3)); one entry may be -1."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return Reshape.apply(x, shape=shape)


class Transpose(Function):
    """y = x with axes permuted: y.shape[i] = x.shape[axes[i]].  dx = g permuted by the inverse."""

    @staticmethod
    def forward(ctx: Context, x: Any, *, axes: tuple) -> Any:
        inverse = [0] * len(axes)
        for i, a in enumerate(axes):
            inverse[a] = i
        ctx.inverse = inverse
        return x.transpose(axes)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return (g.transpose(ctx.inverse),)


def transpose(x: Tensor, *axes: int) -> Tensor:
    """x.transpose(1, 0, 2) or x.transpose((1, 0, 2)); no axes reverses them all."""
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        axes = tuple(axes[0])
    n = x.ndim
    if not axes:
        axes = tuple(range(n - 1, -1, -1))
    axes = tuple(a % n for a in axes) if n else ()
    if sorted(axes) != list(range(n)):
        raise ValueError(f"transpose: axes {axes} are not a permutation of range({n}) "
                         f"for a tensor of shape {x.shape}.")
    return Transpose.apply(x, axes=axes)


def _is_basic(index: Any) -> bool:
    """True for indices made of ints, slices, None and Ellipsis only (they select a view)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)


class GetItem(Function):
    """y = x[index].

    Basic index (ints, slices): every element of x appears at most once in y,
    so dx = zeros with g written into the selected places. Integer-array index:
    an element can be picked several times (x[[0, 0]]), so the copies of g are
    summed into place with add.at (a plain `dx[index] = g` would keep only one).
    """

    @staticmethod
    def forward(ctx: Context, x: Any, *, index: Any) -> Any:
        ctx.shape, ctx.index, ctx.basic = x.shape, index, _is_basic(index)
        return x[index]

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        xp = backend.xp
        dx = xp.zeros(ctx.shape, dtype=g.dtype)
        if ctx.basic:
            dx[ctx.index] = g
        else:
            xp.add.at(dx, ctx.index, g)
        return (dx,)


def getitem(x: Tensor, index: Any) -> Tensor:
    """x[index]; Tensors inside the index are used as (constant) integer arrays."""
    if isinstance(index, Tensor):
        index = index.data
    elif isinstance(index, tuple):
        index = tuple(i.data if isinstance(i, Tensor) else i for i in index)
    elif isinstance(index, list):
        index = backend.xp.asarray(index)
    return GetItem.apply(x, index=index)
