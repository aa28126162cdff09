"""Activation recomputation: keep a region's input, drop its activations, rebuild them in backward.

Between a forward and its backward, the autograd keeps every array a backward rule needs
(autograd/saved.py): for a GPT layer about 34 B T C + 5 B H T^2 bytes in 16-bit
(Korthikanti et al., Table 2). `checkpoint(fn, *args)` trades that memory for compute: it
runs fn WITHOUT a graph in the forward, keeps only fn's Tensor arguments, and in the
backward runs fn again, this time with a graph, and backpropagates through the copy.

Two policies (GPTConfig(recompute=...), used by nn/gpt.py and nn/attention.py):
    "full"       (Chen et al. 2016) checkpoint(Block.layers, x, key) for every block: a
                 layer keeps its input x (B, T, C) only; the backward pays one more
                 forward of every block.
    "selective"  (Korthikanti et al. 2022) `selective_attention`: y = att @ v with att =
                 drop(softmax(q k^T / sqrt(D) + M)) computed without a graph; it keeps
                 q, k, v (the matmuls around the core keep them anyway), and the backward
                 rebuilds att from q and k, then applies MatMul's own backward rule to
                 (att, v), so att @ v is never redone. The T^2 arrays (scores, softmax,
                 mask, dropout mask and output) are the biggest terms for long sequences,
                 and rebuilding them costs q k^T (2 B T^2 C flops) and the elementwise
                 work: T / (12 C + 2 T) of a layer's forward flops (3.8 % at T = 128,
                 C = 256).

Exactness. The copy is the original, bit for bit: same inputs, same dropout masks (drawn
from (seed, step, layer name, global element index), never from an RNG state: see
nn/layers.py), the same MoE routing (a function of the same router probabilities). So the
gradients equal those without recomputation BITWISE. A MoE block's auxiliary loss is
counted once: the loss uses the value of the first forward, the recomputed one only carries
the graph of its gradient, and inside `recomputing()` MoE layers (which ask
`is_recomputing()`) do not add their routing statistics a second time.

One rank's view of y = checkpoint(fn, x, key) (a Block: x (B, T, C), key a DropoutKey):
    forward   1. run fn(x, key) under no_grad: no node is recorded, nothing is kept
              2. keep x's array and the other arguments (the key); return fn's result,
                 a (y, aux) pair carried as one Tensor and split back (`_pack`)
    backward  1. fresh leaves on the kept arrays (with their placement tags)
              2. inside recomputing(): run fn again WITH a graph (nested checkpoints
                 run plainly here: no third forward)
              3. backpropagate dy through the copy: the parameters' .grad accumulate as
                 usual; return dL/dx; the rebuilt graph is dropped when this returns
Kept per layer and rank (b bytes per element, T' = T/W under sequence parallelism; the
terms of parallel/tensor_memory.activation_terms, checked against saved_bytes by tests):
    none       activation_terms(...)
    selective  none - (scores and softmax, 2 B H/W T^2 b)
               - (with dropout: its mask and output, 2 B H/W T^2 b)
               + (the query and key positions, int64, to rebuild the mask: 8 T)
    full       the block input, B T' C b
During the backward of one block the rebuilt arrays of that block (full: all of
activation_terms; selective: its attention weights) are alive beside what is kept.

Communication: none of its own. Collectives inside fn run again in the backward (under
tensor parallelism, full recomputation repeats each block's two forward all-reduces).
Limits: fn is differentiable in its positional Tensor arguments and returns a Tensor or a
tuple of Tensors and Nones of one dtype. A parameter used inside fn gets its gradient in
the recomputation's backward, so its grad hook fires there (and twice if fn's parameters
are also used outside fn). Under zero-bubble schedules (autograd/split.py) a checkpointed
block computes its weight gradients together with its input gradient, in B. Under context
parallelism only "full" applies (ring attention already rebuilds its probabilities block
by block; nn/attention.py refuses "selective" there). Under ZeRO-3 both work as under
every other stage: stage 3 keeps each call's graph (parallel/zero/stage3.py), and a
checkpointed block inside it keeps only its input there.
References: Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost",
    arXiv:1604.06174, Sec. 4 (recompute dropped segments, one extra forward); Korthikanti
    et al. 2022, arXiv:2205.05198, Sec. 5 (selective recomputation) and Table 2; PyTorch's
    torch.utils.checkpoint (the same contract).
Read next: memory/precision.py.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import numpy as np

from minidist import backend
from minidist.autograd import Context, Function, Tensor, is_grad_enabled, no_grad
from minidist.autograd.tensor import alias
from minidist.autograd.functional import MatMul, concatenate

MODES = ("none", "selective", "full")
_TENSOR = object()                 # marks where a Tensor argument sat in the call
_STATE = {"recomputing": False, "watchers": [], "counts": {}}


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Inside: a forward that runs again to rebuild activations. checkpoint() runs its
    function plainly (a graph is being built anyway), and layers that count statistics
    in their forward (nn/moe.py's routing) ask `is_recomputing()` and count nothing."""
    previous, _STATE["recomputing"] = _STATE["recomputing"], True
    try:
        yield
    finally:
        _STATE["recomputing"] = previous


def is_recomputing() -> bool:
    """True inside `recomputing()`: this forward already ran once for this step."""
    return _STATE["recomputing"]


@contextlib.contextmanager
def on_recompute(callback: Callable[[str, Tensor], None]) -> Iterator[None]:
    """Inside, call callback(name of fn, rebuilt output) after every recomputation, before
    its backward: the moment the rebuilt graph is largest (demos and benches measure it)."""
    _STATE["watchers"].append(callback)
    try:
        yield
    finally:
        _STATE["watchers"].remove(callback)


def counts() -> dict[str, int]:
    """{name of fn: recomputations run in this process so far} (tests: did it happen?)."""
    return dict(_STATE["counts"])


def checkpoint(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), keeping only the arguments for the backward (module docstring).

    Without a graph to build (no_grad) or inside a recomputation it is fn itself. When no
    Tensor argument needs a gradient (the parameters inside fn may), a scalar leaf is added
    as an input, so that the node is recorded and its backward runs.
    """
    if not is_grad_enabled() or _STATE["recomputing"]:
        return fn(*args, **kwargs)
    tensors = [a for a in args if isinstance(a, Tensor)]
    if not any(t.requires_grad for t in tensors):
        tensors.append(Tensor(backend.xp.zeros(()), requires_grad=True))     # the anchor
    template = tuple(_TENSOR if isinstance(a, Tensor) else a for a in args)
    result: dict = {}
    packed = Recompute.apply(*tensors, fn=fn, template=template, kwargs=kwargs,
                             sources=tensors, result=result)
    out = _unpack(packed, result["layout"])
    for inner, outer in zip(result["inner"], out if isinstance(out, tuple) else (out,)):
        if outer is not None:
            alias(inner, outer)                # outer stands for the layers' result
    return out


class Recompute(Function):
    """packed = fn(*args) with no graph inside; the backward rebuilds it (module docstring).

    Saved: the input arrays, and `template` (the arguments with a marker for each Tensor)
    as a tuple, so that saved_bytes counts any array among them (an index array, say).
    """

    @staticmethod
    def forward(ctx, *arrays, fn, template, kwargs, sources, result):
        ctx.arrays, ctx.template = arrays, template
        ctx.fn, ctx.kwargs, ctx.sources = fn, kwargs, sources
        with no_grad():
            out = fn(*_fill(template, sources), **kwargs)
        packed, result["layout"] = _pack(out)
        result["inner"] = out if isinstance(out, tuple) else (out,)
        return packed.data

    @staticmethod
    def backward(ctx, grad):
        leaves = _leaves(ctx.sources, ctx.arrays, ctx.needs_input_grad)
        with recomputing():
            out = ctx.fn(*_fill(ctx.template, leaves), **ctx.kwargs)      # the copy
        packed, _ = _pack(out)
        _note(getattr(ctx.fn, "__qualname__", type(ctx.fn).__name__), packed)
        if packed.requires_grad:
            packed.backward(grad)
        return tuple(leaf.grad if need else None
                     for leaf, need in zip(leaves, ctx.needs_input_grad))


def selective_attention(weights: Callable, q: Tensor, k: Tensor, v: Tensor, *args: Any
                        ) -> Tensor:
    """y = weights(q, k, *args) @ v, keeping q, k, v and args, not the attention weights.

    weights: nn/attention.attention_weights, drop(softmax(q k^T / sqrt(D) + M)) (B, h, Tq,
    Tk); q (B, h, Tq, D), k, v (B, h, Tk, D) -> y (B, h, Tq, D). Plain when no graph is
    built or inside a recomputation.
    """
    if not is_grad_enabled() or _STATE["recomputing"]:
        return weights(q, k, *args) @ v
    return SelectiveAttention.apply(q, k, v, weights=weights, args=args, sources=[q, k, v])


class SelectiveAttention(Function):
    """y = att @ v, att = weights(q, k, *args) rebuilt in the backward (selective).

    backward: att again, with a graph from fresh leaves on q, k; then MatMul's own rule on
    (att, v): datt and dv exactly as the plain graph's node computes them (the product
    att @ v itself is not needed again); datt backpropagated through the rebuilt att.
    """

    @staticmethod
    def forward(ctx, q, k, v, *, weights, args, sources):
        ctx.save_for_backward(q, k, v)
        ctx.weights, ctx.args, ctx.sources = weights, args, sources   # args: a tuple, counted
        with no_grad():
            return (weights(sources[0], sources[1], *args) @ sources[2]).data

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad
        Q, K = _leaves(ctx.sources[:2], (q, k), (need_q, need_k))
        with recomputing():
            att = ctx.weights(Q, K, *ctx.args)                             # (B, h, Tq, Tk)
        _note(getattr(ctx.weights, "__qualname__", "attention weights"), att)
        mm = Context()
        mm.save_for_backward(att.data, v)
        mm.needs_input_grad = [att.requires_grad, need_v]
        datt, dv = MatMul.backward(mm, grad)              # the rule of the plain att @ v
        if datt is not None:
            att.backward(datt)
        return (Q.grad if need_q else None), (K.grad if need_k else None), dv


def _note(name: str, rebuilt: Tensor) -> None:
    """Count a recomputation and show its rebuilt output to the on_recompute watchers."""
    _STATE["counts"][name] = _STATE["counts"].get(name, 0) + 1
    for watch in list(_STATE["watchers"]):
        watch(name, rebuilt)


def _leaves(sources: list, arrays: tuple, needs: list) -> list[Tensor]:
    """Fresh leaves on the kept arrays, each an alias of the Tensor passed (so that the
    placement check still sees a sequence-parallel block's x as Shard(1))."""
    return [alias(src, Tensor(a, requires_grad=bool(need)))
            for src, a, need in zip(sources, arrays, needs)]


def _fill(template: tuple, tensors: list) -> list:
    """template with each _TENSOR slot replaced by the next of `tensors` (an extra anchor
    at the end of `tensors` is left out)."""
    it = iter(tensors)
    return [next(it) if a is _TENSOR else a for a in template]


def _pack(out) -> tuple[Tensor, tuple | None]:
    """(one Tensor carrying every Tensor of out, the layout that splits it back).

    A Tensor travels as itself (layout None); a tuple of Tensors and Nones, e.g. a MoE
    block's (y, aux), as concatenate of the Tensors raveled, layout = (shape or None, ...)
    so that the Function's one output carries both and its backward gets both gradients.
    """
    if isinstance(out, Tensor):
        return out, None
    if not isinstance(out, tuple) or not all(o is None or isinstance(o, Tensor) for o in out):
        raise ValueError(f"checkpoint: the function returned {type(out).__name__}; it must "
                         "return a Tensor or a tuple of Tensors and Nones.")
    tensors = [o for o in out if o is not None]
    if not tensors or len({t.dtype for t in tensors}) > 1:
        raise ValueError(f"checkpoint: the function returned {len(tensors)} Tensors of dtypes "
                         f"{sorted({str(t.dtype) for t in tensors})}; it must return at least "
                         "one, all of one dtype, to travel as one Tensor.")
    layout = tuple(None if o is None else o.shape for o in out)
    if len(tensors) == 1:
        return tensors[0], layout
    return concatenate([t.reshape(-1) for t in tensors], axis=0), layout


def _unpack(packed: Tensor, layout: tuple | None):
    """The inverse of _pack: a Tensor, or the tuple with each Tensor cut from `packed`."""
    if layout is None:
        return packed
    if sum(s is not None for s in layout) == 1:
        return tuple(None if s is None else packed for s in layout)
    out, at = [], 0
    for shape in layout:
        if shape is None:
            out.append(None)
            continue
        n = int(np.prod(shape, dtype=np.int64))
        out.append(packed[at:at + n].reshape(tuple(shape)))
        at += n
    return tuple(out)


# --- what a layer keeps ------------------------------------------------------------------

def kept_terms(mode: str, B: int, T: int, C: int, H: int, F: int, *, tp: int = 1,
               sp: bool = False, itemsize: int = 8, dropout: bool = False) -> dict[str, int]:
    """{term: bytes} one rank keeps for the backward of one dense layer under `mode` (module
    docstring; "none" is parallel/tensor_memory.activation_terms, written again here so
    that nn does not import parallel/; the tests check the two agree and match saved_bytes).
    tp ranks W, T' = T / W under sequence parallelism, b = itemsize."""
    check_mode(mode, "kept_terms")
    W, b = tp, itemsize
    if H % W or C % W or F % W or (sp and (T % W or W == 1)):
        raise ValueError(f"kept_terms: H={H}, C={C}, F={F}{f', T={T}' if sp else ''} must "
                         f"divide by tp={W}{' (and SP needs tp > 1)' if sp else ''}.")
    Tl = T // W if sp else T                              # positions outside the tp regions
    if mode == "full":
        return {"block input": B * Tl * C * b}
    terms = {"layernorm xhat, 1/sigma (x2)": 2 * B * Tl * (C + 1) * b,
             "qkv and fc inputs": 2 * B * Tl * C * b,
             "q, k, v of my heads": 3 * B * T * (C // W) * b,
             "proj input": B * T * (C // W) * b,
             "gelu input, tanh, output": 3 * B * T * (F // W) * b}
    if dropout:
        terms["residual dropouts (x2) input, mask"] = 4 * B * Tl * C * b
    if mode == "selective":                               # the T^2 terms are rebuilt
        terms["query and key positions (int64)"] = 8 * T
        return terms
    terms["scores and softmax"] = 2 * B * (H // W) * T * T * b
    if dropout:
        terms["attention dropout mask, output"] = 2 * B * (H // W) * T * T * b
    return terms


def kept_bytes(mode: str, B: int, T: int, C: int, H: int, F: int, **options: Any) -> int:
    """Bytes one rank keeps for the backward of one dense layer: sum of kept_terms."""
    return sum(kept_terms(mode, B, T, C, H, F, **options).values())


def check_mode(mode: str, where: str = "recompute") -> str:
    """mode if it is one of MODES, else ValueError naming them."""
    if mode not in MODES:
        raise ValueError(f"{where}: recompute={mode!r} is not a policy; choose 'none' (keep "
                         "every activation), 'selective' (recompute the attention core) or "
                         "'full' (recompute each block).")
    return mode


__all__ = ["MODES", "checkpoint", "Recompute", "selective_attention", "SelectiveAttention",
           "recomputing", "on_recompute", "counts", "kept_terms", "kept_bytes", "check_mode"]
