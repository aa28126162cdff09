"""Saved activations: the bytes the autograd graph keeps alive until the backward runs.

Between a forward and its backward, every node of the graph holds what its backward rule
needs: the arrays put in `ctx.save_for_backward(...)` and any array set as an attribute
of ctx (a mask, the ids of an embedding lookup). Those arrays are the activation memory
that activation recomputation trades for compute and that tensor and sequence
parallelism split over ranks (parallel/tensor/memory.py turns them into formulas).

What counts, and once:
    * every node reachable from the root through parents that need a gradient: exactly
      the nodes Tensor.backward would visit (autograd/tensor.py), and the nodes of any
      graph a node keeps as a Tensor attribute, to run in its backward (ZeRO-3's calls);
    * each array of ctx.saved_tensors, each ndarray attribute of ctx, and the ndarrays
      inside a tuple or list attribute; numbers, shapes and objects (a group) cost nothing;
    * a view keeps its whole base alive, so an array counts as its BASE buffer (the array
      at the end of its .base chain), once however many views of it the nodes hold:
      q, k and v of attention are three views of one qkv output and count as one;
    * `exclude`: arrays (or Tensors) not to count, with everything that shares their base,
      typically the parameters, which are model state whatever the graph does.
The node objects themselves (a few hundred bytes of Python each) are not counted.

One rank's view: a local walk over this rank's graph; nothing communicates.
    1. order = every tensor reachable from root through node parents (iterative DFS);
    2. for each node, collect its ctx arrays and map each to its base buffer;
    3. sum nbytes over the distinct buffers that are not excluded.
Shapes: any. Cost: O(nodes + saved arrays), no copies.
Reference: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", arXiv:2205.05198, Sec. 4.1 (what each layer stores);
    PyTorch's saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks) play the same
    role there.
Read next: parallel/tensor/memory.py.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from minidist import backend
from minidist.autograd.tensor import Tensor


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, backend.xp.ndarray))


def base_buffer(a: Any) -> Any:
    """The array that owns a's memory: follow .base while it is an array (a itself if none)."""
    while _is_array(getattr(a, "base", None)):
        a = a.base
    return a


def ctx_arrays(ctx: Any) -> list:
    """The arrays one node keeps for its backward: ctx.saved_tensors, array attributes of
    ctx and arrays inside tuple or list attributes (in that order, duplicates kept)."""
    out = [a for a in getattr(ctx, "saved_tensors", ()) if _is_array(a)]
    for name, value in vars(ctx).items():
        if name == "saved_tensors":
            continue
        if _is_array(value):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            out.extend(v for v in value if _is_array(v))
    return out


def graph_nodes(root: Tensor | list[Tensor]) -> list[tuple[str, Any]]:
    """(operation name, ctx) of every node reachable from root (or from any of a list of
    roots, each node once), root first: the nodes Tensor.backward visits. The name is the
    Function class, e.g. "MatMul"."""
    return [(t._node[0].__qualname__.split(".")[0], t._node[1]) for t in graph_tensors(root)]


def graph_tensors(root: Tensor | list[Tensor]) -> list[Tensor]:
    """The Tensors of graph_nodes' nodes (their outputs), root first, each once."""
    out, seen = [], set()
    stack = list(root) if isinstance(root, (list, tuple)) else [root]
    while stack:
        t = stack.pop()
        if id(t) in seen or t._node is None:
            continue
        seen.add(id(t))
        out.append(t)
        _, ctx, parents = t._node
        stack.extend(p for p in parents if p is not None and id(p) not in seen)
        stack.extend(_held_tensors(ctx))
    return out


def _held_tensors(ctx: Any) -> list:
    """Tensors a node keeps as attributes (alone or in a tuple or list): a node that runs a
    graph of its own in its backward (ZeRO-3's hook call) keeps that graph alive too."""
    out = []
    for value in vars(ctx).values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, Tensor) and v._node is not None:
                out.append(v)
    return out


def _excluded(exclude: Iterable[Any]) -> set[int]:
    ids = set()
    for e in exclude:
        e = e.data if isinstance(e, Tensor) else e
        if _is_array(e):
            ids.add(id(base_buffer(e)))
    return ids


def saved_by_op(root: Tensor | list[Tensor], exclude: Iterable[Any] = ()) -> dict[str, int]:
    """{operation name: bytes}: each distinct base buffer counted once, under the first
    node (from the root) that holds it. Values sum to saved_bytes(root, exclude)."""
    skip, seen, out = _excluded(exclude), set(), {}
    for op, ctx in graph_nodes(root):
        for a in ctx_arrays(ctx):
            buf = base_buffer(a)
            if id(buf) in skip or id(buf) in seen:
                continue
            seen.add(id(buf))
            out[op] = out.get(op, 0) + int(buf.nbytes)
    return out


def distinct_bytes(arrays: Iterable[Any], exclude: Iterable[Any] = ()) -> int:
    """Bytes of the distinct base buffers of `arrays` (views of one buffer count once),
    leaving out those of `exclude` (e.g. the parameters)."""
    skip, seen, total = _excluded(exclude), set(), 0
    for a in arrays:
        buf = base_buffer(a)
        if id(buf) not in skip and id(buf) not in seen:
            seen.add(id(buf))
            total += int(buf.nbytes)
    return total


def saved_bytes(root: Tensor | list[Tensor], exclude: Iterable[Any] = ()) -> int:
    """Bytes of the distinct buffers the graph behind `root` (or several roots: buffers
    shared between their graphs count once) keeps for the backward.

    exclude: arrays or Tensors (e.g. model.parameters()) whose buffers are not counted.
    A root that is a leaf (no node) keeps nothing: 0.
    """
    return sum(saved_by_op(root, exclude).values())


__all__ = ["saved_bytes", "saved_by_op", "graph_nodes", "ctx_arrays", "base_buffer",
           "distinct_bytes"]
