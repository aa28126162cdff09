"""ZeRO-3's forward and backward: a unit's parameters exist only while a call that reads them runs.

Under stage 3 every rank keeps only w_shard (S_u,) of each unit (flat.py) and the model's
Parameters hold a NaN placeholder (a zero-stride view of one NaN: a forward that forgot
to gather is loud). ZeRO-3 knows nothing of the model's layers. It wraps HOOK POINTS,
(module, method name) pairs listed in call order, and gives each the unit whose
parameters the method reads: flat.unit_of(units, name of the module), i.e. unit 1 + j
for anything inside block j and the root unit 0 for everything else. For the GPT
(`gpt_hook_points`), in call order:
    (model, "embed")              x = drop(wte[idx] + wpe[positions])     unit 0 (root)
    (model.blocks[j], "forward")  x, aux = Block_j(x)   (aux: MoE losses)  unit 1 + j
    (model, "head")               logits = ln_f(x) @ wte^T                unit 0 again
`Zero3Hooks` replaces each method by an instance attribute (unwrap() puts it back), so
GPT.forward runs unchanged and calls the wrapper, which runs the original method inside
one autograd Function (`_HookCall`). A unit used by several hook points (the root: embed
and head) stays gathered from its first use to its LAST one in each pass; the uses per
pass are counted from the hook points.

The backward needs the call's activations and its parameters. The activations are kept:
the call runs with a graph, as without ZeRO. The parameters are not: the graph's nodes
hold views of u's gathered buffer (MatMul's W, LayerNorm's w, the tied head's W^T), and
kept there they would keep every unit gathered at once. So right after the call
`unpin` cuts every array that lives in the buffer out of its node (remembering the
offset, shape and strides of the view), and the backward, once it has gathered u again,
`repin`s the same views of the new buffer: the same numbers, since the parameters change
only in the optimizer step. Nothing runs twice (re-running each call's forward in the
backward instead would cost 4/3 of a step's compute). PyTorch's saved-tensor hooks serve
the same end: pack a saved tensor as something smaller, unpack it in the backward.

One rank's view of hook point k, whose unit is u:
    forward   1. wait for u's all_gather (start it if no prefetch did) and point the
                 Parameters at it; start the gather of hook point k+1's unit (prefetch)
              2. run the original method on fresh leaves of its inputs, with a graph;
                 unpin u's arrays from that graph
              3. count the use; after u's last use in this pass, free u
    backward  1. gather u again; prefetch hook point k-1's unit; repin
              2. backpropagate dy through the kept graph
              3. add the Parameters' .grad into u's flat gradient buffer; after u's last
                 backward use, hand it to the engine (reduce-scatter into dw_shard,
                 engine.py; only on the last micro-batch) and free u
For the GPT with L blocks ("+u" = gather of u started on the group's worker, "=u" = wait
for it, "-u" = free it; tests/parallel/zero/test_stage3.py checks this trace):
    forward:  +0 =0 +1 embed | =1 +2 block0 -1 | =2 +3 block1 -2 | ... |
              =L block(L-1) -L | head -0
    backward: +0 =0 +L head | =L +(L-1) block(L-1) RS(L) -L | ... | =1 block0 RS(1) -1 |
              embed RS(0) -0
While block j computes, block j+1's gather is in flight (forward; j-1 in backward): the
prefetch that hides communication.

Memory: the activations are those of stage 0 under the same `recompute` (the graphs, less
the parameters). At most the root and two adjacent blocks are gathered at once, and during
the backward the root's gradient buffer lives beside one block's, so without accumulation
    peak_gathered_params = b W (S_0 + max_j (S_{1+j} + S_{2+j}))      (L >= 2)
    peak_unsharded_grads = b W (S_0 + max_j S_{1+j})
(with M > 1 micro-batches add b W sum_u S_u, the no_sync accumulators; parallel/zero/memory.py).
Communication per micro-batch: each unit all-gathered twice (2 Ψ_pad (W-1)/W sent);
the reduce-scatter only on the last micro-batch (Ψ_pad (W-1)/W): 3 Ψ_pad (W-1)/W per
step without accumulation, the paper's 1.5x of data parallelism.

Under expert parallelism a MoE block's experts are a unit of their own, sharded over the
experts' replicas (engine.py): the block's hook point reads two units, gathered, counted and
freed each on its own group.

Limits: a wrapped method is differentiable in its positional Tensor arguments and returns
a Tensor, a tuple whose first item is the Tensor and the rest None, or (y, aux) with aux a
scalar Tensor (a MoE block's auxiliary losses): the pair travels through the Function as
one Tensor, concatenate(y.ravel(), [aux]), and is split back exactly. Each hook point
runs once per forward pass, and a pass's backward ends before the next pass's backward
starts (true of every schedule here). A node that saves a COPY of a parameter (a cast to
another dtype) keeps it: correct, at the copy's memory.

Reference: Rajbhandari et al. 2020, arXiv:1910.02054, Sec. 5.3 (P_p) and Sec. 7.2.2 (the
    3Ψ volume); Zhao et al. 2023, "PyTorch FSDP", arXiv:2304.11277, Sec. 3.3-3.4
    (gather/free per unit around module hooks, backward prefetch).
Read next: parallel/zero/memory.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from minidist.autograd import Function, Tensor
from minidist.autograd import functional as F
from minidist.autograd.saved import base_buffer, graph_tensors
from minidist.nn import Module
from minidist.parallel import placement
from minidist.parallel.zero.flat import unit_of

_TENSOR = object()                 # marks where a Tensor argument sat in a wrapped call


@dataclass
class HookPoint:
    """One wrapped call: `module.<method>` reads the parameters of unit `unit`."""

    name: str                      # "embed", "blocks.0.forward", "head"
    module: Module
    method: str
    unit: int
    original: Callable             # the bound method before wrapping (what the call runs)
    extra: tuple[int, ...] = ()    # more units it reads (a MoE block's experts, under ep)

    @property
    def units(self) -> tuple[int, ...]:
        return (self.unit, *self.extra)


def gpt_hook_points(model: Module) -> list[tuple[Module, str]]:
    """The GPT's hook points in call order: embed, every block's forward, head."""
    if not all(hasattr(model, a) for a in ("embed", "blocks", "head")):
        raise ValueError(f"ZeroEngine stage 3: {type(model).__name__} has no embed / blocks / "
                         "head to wrap; pass ZeroEngine(..., hook_points=[(module, method "
                         "name), ...]) in call order, or use stage 1 or 2.")
    return [(model, "embed"), *[(b, "forward") for b in model.blocks], (model, "head")]


class _HookCall(Function):
    """y = point.original(*args) with the point's unit gathered only inside forward and
    backward; differentiable in the Tensor arguments (`handle`: the unit's shard as a leaf,
    so that the backward runs even when no argument needs a gradient, e.g. embed).

    The call's own graph (its `inner` output) is kept for the backward, with the unit's
    parameters cut out of it (Zero3Hooks.unpin) and put back after the backward's gather."""

    @staticmethod
    def forward(ctx, *arrays, hooks: "Zero3Hooks", k: int, args: tuple, kwargs: dict,
                sources: list, n_handles: int = 1):
        ctx.n_handles, ctx.k, ctx.hooks = n_handles, k, hooks
        needs = ctx.needs_input_grad[n_handles:]
        hooks.before(k, backward=False)
        ctx.xs = _inputs(sources, arrays[n_handles:], needs)
        y = hooks.take(k, hooks.points[k].original(*_fill(args, ctx.xs), **kwargs))
        ctx.inner, ctx.pins = y, hooks.unpin(k, y)
        hooks.after(k, backward=False)
        return y.data

    @staticmethod
    def backward(ctx, dy):
        h, k = ctx.hooks, ctx.k
        h.before(k, backward=True)
        (inner, pins), ctx.inner, ctx.pins = (ctx.inner, ctx.pins), None, None
        h.repin(pins)
        inner.backward(dy)
        del inner, pins          # the graph, and with it the gather's views, go now
        h.after(k, backward=True)
        return (*[None] * ctx.n_handles, *[x.grad for x in ctx.xs])


def _pack(out) -> tuple[Tensor, tuple | None, tuple | None]:
    """(one Tensor, the shape of the first output if packed, the rest of a tuple).

    A call returning (y, aux) with aux a scalar Tensor (a MoE block's auxiliary losses)
    travels as ONE Tensor, concatenate(y.ravel(), [aux]), so that the Function carries
    both and its backward gets both gradients (split back exactly by the wrapper)."""
    if not isinstance(out, tuple):
        return out, None, None
    y, rest = out[0], out[1:]
    if len(rest) == 1 and isinstance(rest[0], Tensor) and rest[0].size == 1:
        return F.concatenate([y.reshape(-1), rest[0].reshape(1)], axis=0), y.shape, None
    if any(r is not None for r in rest):
        raise ValueError("ZeroEngine stage 3: a wrapped call returned more than a Tensor and "
                         "one scalar auxiliary Tensor, which the wrapped call cannot carry.")
    return y, None, rest


def _inputs(sources: list, arrays: tuple, needs: list) -> list:
    """Fresh leaves on the call's input arrays (requiring a gradient where the Tensor passed
    did), with the placement tags of those Tensors (check mode: a sequence-parallel block
    must still see x as Shard(1))."""
    return [placement.carry(src, Tensor(a, requires_grad=bool(need)))
            for src, a, need in zip(sources, arrays, needs)]


@dataclass
class _Pin:
    """Where one array of a call's graph sat in a unit's gathered buffer: the slot (its
    holder, a node's ctx or a Tensor; the attribute; the index in a tuple or list, or None)
    and the view (byte offset, shape, strides, dtype) to rebuild in the unit's next gather."""

    holder: Any
    name: str
    index: int | None
    unit: int
    offset: int
    shape: tuple
    strides: tuple
    dtype: Any


def _pin(holder, name: str, index: int | None, a: Any, owner: dict, pins: list) -> bool:
    """If `a` lives in one of the buffers of `owner` ({id(buffer): unit}), append its _Pin
    to `pins` and say so (the caller then empties the slot)."""
    if not isinstance(a, np.ndarray):
        return False
    buf = base_buffer(a)
    if id(buf) not in owner:
        return False
    pins.append(_Pin(holder, name, index, owner[id(buf)], _address(a) - _address(buf),
                     a.shape, a.strides, a.dtype))
    return True


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _placeholder(a: np.ndarray) -> np.ndarray:
    """a's shape and dtype, no memory: a zero-stride view of one NaN (loud if computed on)."""
    return np.broadcast_to(np.array(np.nan, a.dtype), a.shape)


def _fill(template: tuple, tensors: list) -> list:
    """template with each _TENSOR slot replaced by the next of `tensors`."""
    it = iter(tensors)
    return [next(it) if a is _TENSOR else a for a in template]


class Zero3Hooks:
    """Stage 3 of a ZeroEngine: wraps the hook points; gathers, frees, prefetches units."""

    def __init__(self, engine, points: list[tuple[Module, str]] | None = None) -> None:
        model = engine.model
        pairs = gpt_hook_points(model) if points is None else list(points)
        names = {id(m): n for n, m in model.named_modules()}
        self.e, self.points = engine, []
        for module, method in pairs:
            if id(module) not in names or not callable(getattr(module, method, None)):
                raise ValueError(f"ZeroEngine stage 3: hook point ({type(module).__name__}, "
                                 f"{method!r}) is not a method of a module of this model.")
            if method in vars(module) or any(q.module is module and q.method == method
                                             for q in self.points):
                raise ValueError(f"ZeroEngine stage 3: {names[id(module)] or 'model'}.{method} "
                                 "is already wrapped: list each hook point once, and call "
                                 "unwrap() on an earlier ZeRO-3 engine of this model first.")
            name = ".".join(x for x in (names[id(module)], method) if x)
            unit = unit_of(engine.units, names[id(module)])
            extra = tuple(i for i, u in enumerate(engine.units)     # its experts' unit
                          if u.name == engine.units[unit].name + ".experts")
            self.points.append(HookPoint(name, module, method, unit, getattr(module, method),
                                         extra))
        self.uses = Counter(u for p in self.points for u in p.units)  # uses per forward pass
        missing = [u.name for i, u in enumerate(engine.units) if i not in self.uses]
        if missing:
            raise ValueError(f"ZeroEngine stage 3: no hook point reads unit(s) {missing}, so "
                             "their parameters would never be gathered; add hook points.")
        n = len(engine.units)
        self.fwd, self.bwd = [0] * n, [0] * n                     # uses done in this pass
        # the shards as leaves: inputs that make every call's backward run (grad: None)
        self.handles = [Tensor(s.data, requires_grad=True) for s in engine.shards]
        self.work: dict[int, object] = {}           # unit -> Work of its all_gather
        self.gathered: set[int] = set()
        self.buffers: dict[int, np.ndarray] = {}    # unit -> the array its gather filled
        self.grads: dict[int, np.ndarray] = {}      # unit -> full gradient being collected
        self.inner: Tensor | None = None
        self.rest: tuple | None = None
        self.packed: tuple | None = None            # shape of y when (y, aux) was packed
        for i in range(n):
            self._free_params(i)
        for k, p in enumerate(self.points):
            setattr(p.module, p.method, self._wrapper(k))

    def unwrap(self) -> None:
        """Put every original method back (the Parameters stay placeholders)."""
        for p in self.points:
            if vars(p.module).get(p.method) is not None:
                delattr(p.module, p.method)

    def _wrapper(self, k: int) -> Callable:
        point = self.points[k]

        def call(*args: Any, **kwargs: Any):
            template = tuple(_TENSOR if isinstance(a, Tensor) else a for a in args)
            tensors = [a for a in args if isinstance(a, Tensor)]
            y = _HookCall.apply(*[self.handles[u] for u in point.units], *tensors,
                                hooks=self, k=k, args=template, kwargs=kwargs, sources=tensors,
                                n_handles=len(point.units))
            rest, shape = self.rest, self.packed
            self.rest = self.packed = None
            if shape is not None:                        # (y, aux) packed into one Tensor
                y, rest = y[:-1].reshape(*shape), (y[-1],)
            placement.carry(self.inner, y)   # the layers' placement tags, onto the result
            self.inner = None
            return y if rest is None else (y, *rest)

        call.__wrapped__ = point.original
        call.__name__ = f"zero3_{point.method}"
        return call

    def take(self, k: int, out) -> Tensor:
        """The one Tensor a call's result travels as (_pack); keeps the rest for the
        wrapper: the shape to unpack (y, aux), or the None entries of a tuple."""
        y, self.packed, self.rest = _pack(out)
        self.inner = out[0] if isinstance(out, tuple) else out
        return y

    # --- the schedule of the module docstring ---
    def before(self, k: int, backward: bool) -> None:
        """Gather hook point k's units; prefetch the next (forward) or previous one's."""
        for u in self.points[k].units:
            self._acquire(u, backward)
        nxt = k - 1 if backward else k + 1
        if 0 <= nxt < len(self.points):
            for u in self.points[nxt].units:
                self._prefetch(u, backward)

    def after(self, k: int, backward: bool) -> None:
        """Count the use of each of k's units; after a unit's last use of the pass,
        (backward: reduce and) free it."""
        for u in self.points[k].units:
            self._after_unit(u, backward)

    def _after_unit(self, u: int, backward: bool) -> None:
        e = self.e
        if backward:
            if u not in self.grads:
                self.grads[u] = self._new_grad_buffer(u)
            self._collect(u, self.grads[u])
        done = self.bwd if backward else self.fwd
        done[u] += 1
        if done[u] < self.uses[u]:
            return
        done[u] = 0
        if backward:
            e.add_unit_grads(u, self.grads.pop(u))
        self._release(u)

    # --- gather / free ---
    def _prefetch(self, i: int, backward: bool) -> None:
        """Start unit i's all_gather on the group's worker unless it is already on its way
        (the engine's gather_async: ZeRO++ gathers differently in the backward)."""
        if i in self.work:
            return
        e = self.e
        self.work[i] = e.gather_async(i, backward)
        held = sum(e.units[u].padded for u in self.work) * e.dtype.itemsize
        e._note_peak("gathered_params", held)

    def _acquire(self, i: int, backward: bool) -> None:
        """Make unit i's parameters real: wait for its gather, point the Parameters at it."""
        self._prefetch(i, backward)
        if i not in self.gathered:
            flat = self.work[i].wait().reshape(-1)                 # (W S_u,)
            self.buffers[i] = base_buffer(flat)
            for p, view in zip(self.e.units[i].params, self.e.units[i].views(flat)):
                p.data = view
            self.gathered.add(i)

    def _release(self, i: int) -> None:
        self.work.pop(i)
        self.gathered.discard(i)
        self.buffers.pop(i, None)
        self._free_params(i)

    # --- the call's graph without the unit's parameters between forward and backward ---
    def unpin(self, k: int, root: Tensor) -> list[_Pin]:
        """Cut every array of root's graph that lives in a gathered buffer of one of hook
        point k's units out of its node: what a node saved (MatMul's W, LayerNorm's w; the
        slot is set to None) and the value of a node that is a view of a parameter (the
        tied head's W^T; a NaN placeholder of its shape, as the Parameters get). Freeing
        the unit then frees its memory, while the graph keeps the activations. Returns
        where each sat, for repin."""
        owner = {id(self.buffers[u]): u for u in self.points[k].units if u in self.buffers}
        pins: list[_Pin] = []
        for t in graph_tensors(root):
            if _pin(t, "data", None, t.data, owner, pins):
                t.data = _placeholder(t.data)
            ctx = t._node[1]
            for name, value in list(vars(ctx).items()):
                if isinstance(value, (tuple, list)):
                    cut = [j for j, a in enumerate(value)
                           if _pin(ctx, name, j, a, owner, pins)]
                    if cut:
                        setattr(ctx, name, type(value)(None if j in cut else a
                                                       for j, a in enumerate(value)))
                elif _pin(ctx, name, None, value, owner, pins):
                    setattr(ctx, name, None)
        return pins

    def repin(self, pins: list[_Pin]) -> None:
        """Put every cut array back, as the same view of its unit's NEW gather (which holds
        the same numbers: the parameters do not change between forward and backward)."""
        for p in pins:
            view = np.ndarray(p.shape, p.dtype, buffer=self.buffers[p.unit], offset=p.offset,
                              strides=p.strides)
            if p.index is None:
                setattr(p.holder, p.name, view)
            else:
                items = list(getattr(p.holder, p.name))
                items[p.index] = view
                setattr(p.holder, p.name, type(getattr(p.holder, p.name))(items))

    def _free_params(self, i: int) -> None:
        for p in self.e.units[i].params:
            p.data = _placeholder(p.data)

    # --- gradients ---
    def _new_grad_buffer(self, i: int) -> np.ndarray:
        e = self.e
        flat = np.zeros(e.units[i].padded, e.dtype)
        held = flat.nbytes + sum(g.nbytes for g in e.g_acc if g is not None) + sum(
            g.nbytes for g in self.grads.values())
        e._note_peak("unsharded_grads", held)
        return flat

    def _collect(self, i: int, flat: np.ndarray) -> None:
        """flat += every .grad of unit i's Parameters (left by the call's backward)."""
        u = self.e.units[i]
        for view, p in zip(u.views(flat), u.params):
            if p.grad is not None:
                view += p.grad
                p.grad = None
