"""Tensor: an array that remembers how it was computed, so its gradient can be found.

This module is the autograd's core, in the order a reader needs it: the Tensor,
the backward walk, the Function interface every operation implements, and the
elementary operations behind a Tensor's operators (+, *, @, x[i], .sum(), ...).
They live in one file because they are one unit: a Tensor's operators are
Functions, and every Function returns a Tensor (micrograd keeps them together too).

The Tensor. A Tensor wraps one array (`.data`, from `backend.xp`). When an
operation runs on Tensors that require gradients, its output Tensor records a
node: the operation's backward rule, the context the forward saved for it, and
the input Tensors (its parents). Those nodes form a directed acyclic graph from
the leaves (parameters, inputs) to the result, usually a scalar loss.

`loss.backward()` walks that graph once, in reverse topological order, so a
node's backward rule runs only after every use of its output has sent back its
share of the gradient (the chain rule sums over all uses). Leaves that require
gradients receive their total in `.grad`, added to what was there before
(`+=`), which is how gradient accumulation over micro-batches works.

    x ──┐
        ├─ Mul ── y ─┐
    w ──┘            ├─ Add ── z ── Sum ── loss        forward: left to right
    b ───────────────┘                                 backward: right to left

The Function. Every operation (here, in functional.py and fused.py, and every
operation whose backward is a collective, in parallel/) is a subclass with two
static methods:

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
passed through to forward and are never differentiated. The ctx is a plain
object: forward stores what backward needs on it, with
`ctx.save_for_backward(*arrays)` (read back as `ctx.saved_tensors`) or as
attributes; `ctx.needs_input_grad[i]` tells both rules whether input i needs a
gradient, so that work for constants can be skipped.

Gradients are shared, never written into. A gradient array may be a view of
another (a reshape, a broadcast, an add that passes g to both inputs), so a
backward rule never writes into the `grad` it receives and never returns an
array it keeps, and a leaf's `.grad` is copied when it could alias another
array: in-place updates of one `.grad` (clipping, optimizers) never change another.

The elementary operations. Notation: x, a, b are inputs, y the output, g = dL/dy
the incoming gradient, and each rule gives dL/dx; products are elementwise.
Broadcasting: NumPy stretches a size-1 (or missing leading) axis of an input to
the size of the output, which reuses one input element for many output
elements, so in the backward their gradients add up: `unbroadcast` sums g over
the stretched axes. Example: a (3, 1, 4) + b (4,) -> y (3, 1, 4); da = g,
db = g summed over axes 0 and 1. Constants (Python numbers, xp arrays) may
appear wherever a Tensor may and receive no gradient; results keep the dtype
NumPy gives them (a float32 Tensor times a Python float stays float32).

Python-level cost matters: a training step of a tiny model is thousands of small
operations, so Tensor uses __slots__, the backward walk is one loop over a
precomputed order, and intermediate gradients live only in a local dict.

Tools watch from outside. Nothing in this file knows about FLOP counting, memory
ledgers, traces or placement checks: each is an `Observer` that `observe(o)`
plugs in (and `unobserve(o)` takes out), and that sees every forward, every
node the walk finishes and every gradient sum. With none plugged in, the cost is
one test per operation. Mixed precision is the one mode the operations consult:
like PyTorch's autocast, `autocast` is set while a low-precision forward runs
(memory/precision.py), and MatMul (and functional.py's normalisations) read it.

Reference: micrograd (Karpathy 2020) lifted from scalars to arrays, and PyTorch's
autograd (Paszke et al. 2017, "Automatic differentiation in PyTorch", NIPS-W)
for the Function/ctx interface.
Read next: autograd/functional.py (matmul's friends, activations, losses by name)
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

from minidist import backend

# Read by Function.apply on every operation (a module attribute, not a call: the hot path);
# set only by no_grad.
grad_enabled = True
# memory/precision.py's Autocast while a low-precision forward runs (see the docstring).
autocast = None


def is_grad_enabled() -> bool:
    """True unless inside a `no_grad()` block."""
    return grad_enabled


class no_grad:
    """Context manager: operations inside record no graph (evaluation, optimizer steps)."""

    def __enter__(self) -> "no_grad":
        global grad_enabled
        self._previous = grad_enabled
        grad_enabled = False
        return self

    def __exit__(self, *exc: Any) -> None:
        global grad_enabled
        grad_enabled = self._previous


class Tensor:
    """An xp array with an optional gradient and the node that produced it.

    Tensor(data, requires_grad=False): an xp array is kept as is (no copy, its
    dtype unchanged); Python numbers and lists become an array of the backend's
    default float dtype if they are floats, and keep their integer dtype
    otherwise.
    """

    __slots__ = ("data", "grad", "requires_grad", "_node", "_grad_hooks", "__weakref__")
    __array_priority__ = 1000        # make `ndarray + Tensor` call Tensor.__radd__

    def __init__(self, data: Any, requires_grad: bool = False) -> None:
        xp = backend.xp
        if isinstance(data, Tensor):
            data = data.data
        if not isinstance(data, xp.ndarray):
            dtype = data.dtype if isinstance(data, xp.generic) else None
            data = xp.asarray(data, dtype=dtype)
            if dtype is None and data.dtype.kind == "f":
                data = data.astype(backend.default_dtype(), copy=False)
        if requires_grad and data.dtype.kind not in "fc" \
                and not data.dtype.name.startswith(("bfloat16", "float8")):   # ml_dtypes
            raise ValueError(f"Tensor: requires_grad=True needs a float array, got dtype "
                             f"{data.dtype}; integers (token ids, indices) have no gradient.")
        self.data = data
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self._node = None          # (backward_fn, ctx, parents) for non-leaves
        self._grad_hooks = None    # called with the leaf once its .grad is final

    # --- array-like attributes ---
    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)
    T = property(lambda self: self.transpose())

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        flag = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({self.data!r}{flag})"

    def item(self) -> float:
        """The value of a one-element tensor as a Python number."""
        return self.data.item()

    def numpy(self) -> Any:
        """The data as a NumPy array (copied from the device on the GPU path)."""
        return backend.to_numpy(self.data)

    def detach(self) -> "Tensor":
        """A leaf sharing this tensor's data, cut from the graph (no gradient flows back)."""
        return Tensor(self.data)

    def register_grad_hook(self, hook) -> None:
        """Call hook(self) during backward as soon as this leaf's .grad is final.

        Reverse topological order visits a leaf only after every use of it has
        sent its gradient, so at that moment `.grad` holds this backward's
        whole contribution. Data parallelism uses this to start a bucket's
        all-reduce while the rest of the backward is still running.
        """
        if self._node is not None:
            raise ValueError("register_grad_hook: only leaves (parameters) have a final .grad")
        self._grad_hooks = (self._grad_hooks or ()) + (hook,)

    def zero_grad(self) -> None:
        """Forget the accumulated gradient (`.grad = None`)."""
        self.grad = None

    def backward(self, grad: Any = None) -> None:
        """Add d(self)/d(leaf), contracted with `grad`, to `.grad` of every leaf upstream.

        grad: the gradient of some scalar L with respect to self, same shape as
        self; may be omitted when self has one element (then dL/dself = 1).
        Algorithm: order the graph topologically (parents before children),
        then visit it backwards; each node's rule maps the gradient of its
        output to the gradients of its inputs, which are summed per input.
        """
        xp = backend.xp
        if not self.requires_grad:
            raise ValueError(
                "backward(): this tensor does not require grad, so no graph leads to it. "
                "Make a leaf with requires_grad=True (or use nn.Parameter) before the forward, "
                "and do not run the forward inside no_grad()."
            )
        if grad is None:
            if self.data.size != 1:
                raise ValueError(
                    f"backward(): grad can only be omitted for a one-element tensor, but this "
                    f"one has shape {self.shape}. Reduce it first (e.g. .sum() or .mean()) or "
                    f"pass grad= with shape {self.shape}."
                )
            grad = xp.ones_like(self.data)
        else:
            grad = grad.data if isinstance(grad, Tensor) else xp.asarray(grad)
            if grad.shape != self.shape:
                raise ValueError(f"backward(): grad has shape {grad.shape}, expected {self.shape}")
        _run_backward(self, grad)

    # --- operators and methods (their Functions are below) ---
    def __add__(self, other: Any) -> "Tensor":
        return Add.apply(self, other)

    def __radd__(self, other: Any) -> "Tensor":
        return Add.apply(other, self)

    def __sub__(self, other: Any) -> "Tensor":
        return Sub.apply(self, other)

    def __rsub__(self, other: Any) -> "Tensor":
        return Sub.apply(other, self)

    def __mul__(self, other: Any) -> "Tensor":
        return Mul.apply(self, other)

    def __rmul__(self, other: Any) -> "Tensor":
        return Mul.apply(other, self)

    def __truediv__(self, other: Any) -> "Tensor":
        return Div.apply(self, other)

    def __rtruediv__(self, other: Any) -> "Tensor":
        return Div.apply(other, self)

    def __neg__(self) -> "Tensor":
        return Neg.apply(self)

    def __pow__(self, exponent: float) -> "Tensor":
        return pow(self, exponent)

    def __matmul__(self, other: Any) -> "Tensor":
        return MatMul.apply(self, other)

    def __rmatmul__(self, other: Any) -> "Tensor":
        return MatMul.apply(other, self)

    def __getitem__(self, index: Any) -> "Tensor":
        return getitem(self, index)

    def sum(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        return Sum.apply(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        return Mean.apply(self, axis=axis, keepdims=keepdims)

    def max(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        return Max.apply(self, axis=axis, keepdims=keepdims)

    def reshape(self, *shape: Any) -> "Tensor":
        return reshape(self, *shape)

    def transpose(self, *axes: int) -> "Tensor":
        return transpose(self, *axes)

    permute = transpose

    def exp(self) -> "Tensor":
        return Exp.apply(self)

    def log(self) -> "Tensor":
        return Log.apply(self)

    def tanh(self) -> "Tensor":
        return Tanh.apply(self)


def topological_order(root: Tensor) -> list:
    """Tensors reachable from root through nodes that need grad, parents before children.

    Iterative depth-first search (graphs of deep models are deeper than
    Python's recursion limit). A tensor is appended after all its parents.
    """
    order, seen = [], set()
    stack = [(root, False)]
    while stack:
        t, expanded = stack.pop()
        if expanded:
            order.append(t)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack.append((t, True))
        if t._node is not None:
            for p in t._node[2]:
                if p is not None and id(p) not in seen:
                    stack.append((p, False))
    return order


def _run_backward(root: Tensor, grad: Any) -> None:
    """Propagate `grad` from root to the leaves (see Tensor.backward)."""
    grads = {id(root): grad}
    watching = observers
    given = {id(grad)}                     # arrays a leaf must not keep without a copy
    for t in reversed(topological_order(root)):
        g = grads.pop(id(t), None)
        if g is None:                      # no path from this tensor's output to root
            continue
        node = t._node
        if node is None:                   # a leaf: accumulate into .grad
            accumulate_leaf(t, g, given)
            if watching:
                for o in watching:
                    o.backward(t, (t.grad,))
            for hook in getattr(t, "_grad_hooks", None) or ():
                hook(t)
            continue
        backward_fn, ctx, parents = node
        in_grads = backward_fn(ctx, g)
        if not isinstance(in_grads, (tuple, list)):
            in_grads = (in_grads,)
        for p, gp in zip(parents, in_grads):
            if p is None or gp is None:
                continue
            prev = grads.get(id(p))
            grads[id(p)] = gp if prev is None else prev + gp     # never in place: may alias
            if prev is not None and watching:
                for o in watching:
                    o.grad_add(gp)
        if watching:
            for o in watching:
                o.backward(t, [grads.get(id(p)) for p in parents if p is not None])


def accumulate_leaf(t: Tensor, g: Any, given: set) -> None:
    """t.grad += g, copying g first if it may alias another array (a view, or given away);
    observers see the sum (the split backward of autograd/split.py calls this too)."""
    if g.shape != t.data.shape:
        raise RuntimeError(
            f"backward: a gradient of shape {g.shape} reached a leaf of shape {t.data.shape}; "
            "the backward rule of the operation that used this leaf returns a wrong shape."
        )
    if g.dtype != t.data.dtype:            # e.g. a float64 constant met a float32 parameter
        g = g.astype(t.data.dtype)
    elif g.base is not None or id(g) in given or g is t.data:
        g = g.copy()
    if t.grad is None:
        t.grad = g
        given.add(id(g))
    else:
        t.grad += g
        for o in observers:
            o.grad_add(g)




# --- the Function interface ---------------------------------------------------------

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
        track = track and grad_enabled
        ctx.needs_input_grad = needs
        watching = observers
        t0 = perf_counter() if watching else 0.0
        out = cls.forward(ctx, *arrays, **kwargs)
        if not isinstance(out, backend.xp.ndarray):       # e.g. a NumPy scalar from a sum
            out = backend.xp.asarray(out)
        result = Tensor.__new__(Tensor)
        result.data = out
        result.grad = None
        result.requires_grad = track
        result._node = (cls.backward, ctx, parents) if track else None
        if watching:
            for o in watching:
                o.forward(cls, ctx, args, arrays, kwargs, result, t0)
        return result


# --- the elementary operations behind a Tensor's operators ------------------------

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


def shape_of(a: Any) -> tuple:
    """The shape of an array, () for a Python number."""
    return a.shape if hasattr(a, "shape") else ()


class Add(Function):
    """y = a + b.  da = unbroadcast(g), db = unbroadcast(g)."""

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.shapes = (shape_of(a), shape_of(b))
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
        ctx.shapes = (shape_of(a), shape_of(b))
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
        da = unbroadcast(g * b, shape_of(a)) if na else None
        db = unbroadcast(g * a, shape_of(b)) if nb else None
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
        da = unbroadcast(g_over_b, shape_of(a)) if na else None
        db = unbroadcast(-g_over_b * y, shape_of(b)) if nb else None
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


def mm(x: Any, y: Any) -> Any:
    """x @ y; a stack (..., K) times a matrix (K, N) runs as ONE (prod(...), K) @ (K, N) GEMM."""
    if x.ndim > 2 and y.ndim == 2:
        return (x.reshape(-1, x.shape[-1]) @ y).reshape(x.shape[:-1] + (y.shape[1],))
    return x @ y


class MatMul(Function):
    """y = a @ b, batched over leading axes with broadcasting (NumPy matmul rules).

    For a (..., M, K), b (..., K, N), y (..., M, N):
        da = unbroadcast(g @ b^T),   db = unbroadcast(a^T @ g)   (^T swaps the last two axes)
    A 1-D a is a row (1, K) and a 1-D b a column (K, 1), as in NumPy. The usual
    Linear case, a (B, T, C) @ w (C, F), computes dw = a(BT, C)^T @ g(BT, F) as one GEMM.
    Cost: each of forward, da and db is 2*M*K*N flops per batch element.
    """

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        if autocast is not None:                     # memory/precision.py: rounded GEMM
            return autocast.matmul_forward(ctx, a, b)
        ctx.save_for_backward(a, b)
        return mm(a, b)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        if getattr(ctx, "autocast", None) is not None:
            return ctx.autocast.matmul_backward(ctx, g)
        return matmul_grads(*ctx.saved_tensors, g, *ctx.needs_input_grad)


def matmul_grads(a: Any, b: Any, g: Any, need_a: bool, need_b: bool) -> tuple:
    """(da, db) of y = a @ b for the output gradient g (MatMul's rule; None if not needed)."""
    a2 = a.reshape(1, -1) if a.ndim == 1 else a                  # (..., M, K)
    b2 = b.reshape(-1, 1) if b.ndim == 1 else b                  # (..., K, N)
    if a.ndim == 1 and b.ndim == 1:                              # put back M=1 / N=1
        g = g.reshape(1, 1)
    elif a.ndim == 1:
        g = g[..., None, :]                                      # (..., N) -> (..., 1, N)
    elif b.ndim == 1:
        g = g[..., None]                                         # (..., M) -> (..., M, 1)
    da = db = None
    if need_a:
        da = unbroadcast(mm(g, b2.swapaxes(-1, -2)), a2.shape)
        da = da.reshape(a.shape) if a.ndim == 1 else da
    if need_b:
        if b2.ndim == 2 and a2.ndim > 2:                         # sum over the stack in GEMM
            db = a2.reshape(-1, a2.shape[-1]).T @ g.reshape(-1, g.shape[-1])
        else:
            db = unbroadcast(a2.swapaxes(-1, -2) @ g, b2.shape)
        db = db.reshape(b.shape) if b.ndim == 1 else db
    return da, db


def gemm(a: Any, b: Any) -> tuple:
    """(a @ b, how it was rounded) for a Function that runs its own GEMM (the sequence-
    parallel all-gather matmul): under autocast (memory/precision.py) the rounded GEMM
    MatMul runs, its operands' scales in the second item; else (mm(a, b), None). The
    backward calls gemm_grads with the same operands (gathered again) and that item."""
    if autocast is None:
        return mm(a, b), None
    return autocast.gemm(a, b)


def gemm_grads(a: Any, b: Any, g: Any, how: Any, need_a: bool, need_b: bool) -> tuple:
    """(da, db) of gemm(a, b) for the output gradient g; `how`: gemm's second item."""
    if how is None:
        return matmul_grads(a, b, g, need_a, need_b)
    return how.grads(a, b, g, need_a, need_b)


def matmul(a: Any, b: Any) -> Tensor:
    """a @ b with NumPy's matmul semantics (see MatMul)."""
    return MatMul.apply(a, b)


# --- tools that watch the autograd from outside ------------------------------------------

class Observer:
    """A tool that sees every operation: subclass it, override what you need, `observe` it.

    Users: the FLOP ledger (observe/flops.py), the memory ledger (memory/ledger.py), a
    step's trace (observe/run_dir.py) and the placement check (parallel/placement.py).
    An observer may wrap `result._node`'s backward rule to see the backward of that node,
    whoever runs it (Tensor.backward, a split backward, a ZeRO-3 call's own backward).
    """

    def forward(self, fn: type, ctx: Context, args: tuple, arrays: list, kwargs: dict,
                result: "Tensor", t0: float) -> None:
        """After fn.forward ran on `arrays` (`args` unwrapped) and made `result`; t0 is
        perf_counter() taken just before the forward."""

    def backward(self, t: "Tensor", grads: Any) -> None:
        """The walk is done with t: its node's rule ran and `grads` are its parents'
        gradients so far, or t is a leaf and grads = (t.grad,), before its grad hooks."""

    def grad_add(self, g: Any) -> None:
        """The walk summed a gradient g into another (a tensor used twice, `+=` into .grad)."""

    def alias(self, src: "Tensor", dst: "Tensor") -> None:
        """dst, a new leaf, stands for src (activation recomputation re-runs a block on
        fresh leaves over src's arrays): what the observer knows of src holds for dst."""


observers: tuple = ()          # read by the hot path; changed only by observe / unobserve


def observe(o: Observer) -> Observer:
    """Plug o in: from now on it sees every operation in this process. Returns o."""
    global observers
    if o in observers:
        raise RuntimeError(f"observe: {type(o).__name__} is plugged in already")
    observers = observers + (o,)
    return o


def unobserve(o: Observer) -> None:
    """Take o out (nothing happens if it is not plugged in)."""
    global observers
    observers = tuple(x for x in observers if x is not o)


def alias(src: Tensor, dst: Tensor) -> Tensor:
    """Tell every observer that dst stands for src (see Observer.alias); return dst."""
    for o in observers:
        o.alias(src, dst)
    return dst
