"""Tensor: an array that remembers how it was computed, so its gradient can be found.

A Tensor wraps one array (`.data`, from `backend.xp`). When an operation runs
on Tensors that require gradients, its output Tensor records a node: the
operation's backward rule, the context the forward saved for it, and the input
Tensors (its parents). Those nodes form a directed acyclic graph from the
leaves (parameters, inputs) to the result, usually a scalar loss.

`loss.backward()` walks that graph once, in reverse topological order, so a
node's backward rule runs only after every use of its output has sent back its
share of the gradient (the chain rule sums over all uses). Leaves that require
gradients receive their total in `.grad`, added to what was there before
(`+=`), which is how gradient accumulation over micro-batches works.

    x ──┐
        ├─ Mul ── y ─┐
    w ──┘            ├─ Add ── z ── Sum ── loss        forward: left to right
    b ───────────────┘                                 backward: right to left

Python-level cost matters here: a training step of a tiny model is thousands of
small operations, so Tensor uses __slots__, the backward engine is one loop over
a precomputed order, and intermediate gradients live only in a local dict.

Gradient arrays that an operation passes back may be views of other gradients
(a reshape, a broadcast, an add that passes g to both inputs). Backward rules
therefore never write into an incoming gradient, and a leaf's `.grad` is copied
when it could alias another array, so that in-place updates of one `.grad`
(clipping, optimizers) can never change another.

Reference: the design follows micrograd (Karpathy 2020) lifted from scalars to
arrays, and PyTorch's autograd (Paszke et al. 2017, "Automatic differentiation
in PyTorch", NIPS-W) for the Function/ctx interface.
Read next: autograd/function.py, then ops.py and functional.py
"""

from __future__ import annotations

from typing import Any

from minidist import backend

# Read by Function.apply on every operation (a module attribute, not a call: the hot path);
# set only by no_grad.
grad_enabled = True
# Called as on_grad_add(g) for each gradient sum the engine itself does (a tensor used twice,
# `+=` into a leaf's .grad) when set: observe/flops.py's FLOP ledger. None: no cost but a test.
on_grad_add = None
# Called as on_backward(t, grads) when set, once the engine is done with tensor t: a node's rule
# ran and grads are its parents' gradients so far, or t is a leaf and grads = (t.grad,), before
# its grad hooks. memory/ledger.py counts them. None: no cost but a test.
on_backward = None


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

    # --- operators and methods (the rules live in ops.py and functional.py) ---
    def __add__(self, other: Any) -> "Tensor":
        return ops.Add.apply(self, other)

    def __radd__(self, other: Any) -> "Tensor":
        return ops.Add.apply(other, self)

    def __sub__(self, other: Any) -> "Tensor":
        return ops.Sub.apply(self, other)

    def __rsub__(self, other: Any) -> "Tensor":
        return ops.Sub.apply(other, self)

    def __mul__(self, other: Any) -> "Tensor":
        return ops.Mul.apply(self, other)

    def __rmul__(self, other: Any) -> "Tensor":
        return ops.Mul.apply(other, self)

    def __truediv__(self, other: Any) -> "Tensor":
        return ops.Div.apply(self, other)

    def __rtruediv__(self, other: Any) -> "Tensor":
        return ops.Div.apply(other, self)

    def __neg__(self) -> "Tensor":
        return ops.Neg.apply(self)

    def __pow__(self, exponent: float) -> "Tensor":
        return ops.pow(self, exponent)

    def __matmul__(self, other: Any) -> "Tensor":
        return functional.MatMul.apply(self, other)

    def __rmatmul__(self, other: Any) -> "Tensor":
        return functional.MatMul.apply(other, self)

    def __getitem__(self, index: Any) -> "Tensor":
        return ops.getitem(self, index)

    def sum(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        return ops.Sum.apply(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        return ops.Mean.apply(self, axis=axis, keepdims=keepdims)

    def max(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        return ops.Max.apply(self, axis=axis, keepdims=keepdims)

    def reshape(self, *shape: Any) -> "Tensor":
        return ops.reshape(self, *shape)

    def transpose(self, *axes: int) -> "Tensor":
        return ops.transpose(self, *axes)

    permute = transpose

    def exp(self) -> "Tensor":
        return ops.Exp.apply(self)

    def log(self) -> "Tensor":
        return ops.Log.apply(self)

    def tanh(self) -> "Tensor":
        return ops.Tanh.apply(self)


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
    given = {id(grad)}                     # arrays a leaf must not keep without a copy
    for t in reversed(topological_order(root)):
        g = grads.pop(id(t), None)
        if g is None:                      # no path from this tensor's output to root
            continue
        node = t._node
        if node is None:                   # a leaf: accumulate into .grad
            accumulate_leaf(t, g, given)
            if on_backward is not None:
                on_backward(t, (t.grad,))
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
            if on_grad_add is not None and prev is not None:
                on_grad_add(gp)
        if on_backward is not None:
            on_backward(t, [grads.get(id(p)) for p in parents if p is not None])


def accumulate_leaf(t: Tensor, g: Any, given: set) -> None:
    """t.grad += g, copying g first if it may alias another array (a view, or given away)."""
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
        if on_grad_add is not None:
            on_grad_add(g)


from minidist.autograd import functional, ops  # noqa: E402  (they import Tensor from here)
