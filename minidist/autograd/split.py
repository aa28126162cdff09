"""Split backward: the input gradient now (B), the weight gradients later (W).

A pipeline stage's backward does two jobs. B computes dL/d(input), the gradient the
previous stage is waiting for; W computes dL/d(weights), which nobody waits for until
the optimizer step. Zero-bubble schedules run B as soon as possible and push W into
the idle slots (the bubbles) of the pipeline; `parallel/pipeline/schedules.py` names the two
actions B(m, c) and W(m, c). This module splits one `Tensor.backward` into the two.

The split follows the graph. A tensor is on the INPUT PATH if some input (a leaf the
caller names, usually the stage's input activation) is reachable from it through node
parents: only those tensors' gradients are needed for dL/d(input). Every other tensor
that requires grad is on the WEIGHT PATH. A node on the input path whose parents
include weight-path tensors (x @ W: x on the input path, W not) runs twice: in B asked
only for its input-path parents, in W only for its weight-path ones. Backward rules
read `ctx.needs_input_grad` and skip what is not asked for (MatMul computes dx in B and
dW in W, with no extra flops), so the mask is how the node is told which half to do.

One rank's view (one micro-batch of one chunk; backward_input is B, WeightGrad.run is W):
    1. order = the reverse topological order Tensor.backward walks (tensor.py);
    2. mark the input path in one forward pass over order (a tensor is on it if it is
       an input or one of its parents is on it);
    3. B: visit the input-path tensors in order; call each node's backward with
       needs_input_grad masked to its input-path parents and sum their gradients as
       Tensor.backward does; remember each node that also has a weight-path parent,
       with its output gradient; return a copy of each input's gradient;
    4. W: walk the same order again, keeping only remembered nodes (now masked to
       their weight-path parents) and weight-path tensors (the normal rule); leaves
       accumulate into .grad (+=, copied when aliased) and then fire their grad hooks.
W visits the weight-path tensors in the same order as the full backward and every
gradient is summed from the same terms in the same order, so .grad ends BITWISE equal
to `root.backward(grad)`. With no input reachable (the first stage), B does nothing
and W is the whole backward.

Shapes: any graph; root and grad of one shape; each input's gradient has its shape.
Communication: none here (the pipeline sends B's result to the previous stage).
Cost: the topological order is built once; each remembered node's rule is called twice
(split work when the rule honours needs_input_grad, repeated work when it does not); one
copy of each input's gradient, so that the caller may change it without changing W.
Measured (one thread, median): a GPT block with C=256 takes 1.02-1.03x the time of one
backward; a tiny block (C=8) 1.5x, the Python bookkeeping (~0.1 ms) dominating there.
Memory: until run(), W keeps the weight-path part of the graph, the remembered nodes'
saved arrays and their output gradients (`grad` too, unchanged); the input-path tensors
are not kept, so once the caller drops root they can be freed. run() drops the rest.
Caveat: a rule must give each input the same bits whatever else is asked of it (true of
every rule in autograd/), and a rule with a collective inside runs it in both B and W.

Reference: Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241, Sec. 2
    (Fig. 1 splits an MLP's backward into B and W). PyTorch's pipelining does the same
    split with autograd.grad (torch.distributed.pipelining, stage_backward_input/weight).
Read next: parallel/pipeline/schedules.py (where B and W are placed in a pipeline schedule).
"""

from __future__ import annotations

from typing import Any, Sequence

from minidist import backend
from minidist.autograd.saved import ctx_arrays
from minidist.autograd.tensor import Tensor, accumulate_leaf, topological_order


class WeightGrad:
    """W: the rest of a backward that backward_input started; `run()` finishes it once.

    Holds, in the full backward's order, the nodes on the input path that still owe
    gradients to weight-path parents (with their output gradients) and the weight-path
    tensors; `grads` holds the gradients already known (the root's, when B had nothing).
    """

    def __init__(self, steps: list, grads: dict, given: set) -> None:
        self._steps, self._grads, self._given = steps, grads, given
        self._done = False

    def run(self) -> None:
        """Add dL/d(leaf) into .grad of every leaf but the inputs; fire each leaf's hooks.

        Same semantics as Tensor.backward for those leaves: += onto an existing .grad, a
        copy when the gradient may alias another array, hooks once .grad is final.
        """
        if self._done:
            raise RuntimeError(
                "WeightGrad.run(): already run; its gradients are in .grad and its graph "
                "references are gone. Each backward_input(...) gives one W to run once.")
        self._done = True
        steps, grads, given = self._steps, self._grads, self._given
        self._steps = self._grads = self._given = None      # free the graph as we finish
        for step in steps:
            if not isinstance(step, Tensor):                # (backward_fn, ctx, parents, g)
                _call_node(*step, grads, masked=True)
                continue
            g = grads.pop(id(step), None)
            if g is None:                                   # no gradient reaches this tensor
                continue
            if step._node is None:
                accumulate_leaf(step, g, given)
                for hook in getattr(step, "_grad_hooks", None) or ():
                    hook(step)
            else:
                _call_node(*step._node, g, grads)


    def kept_arrays(self) -> list:
        """The arrays this W keeps alive until run(): its nodes' saved arrays
        (autograd/saved.py's ctx_arrays) and the output gradients it still owes."""
        out = [g for g in (self._grads or {}).values()]
        for step in self._steps or ():
            if not isinstance(step, Tensor):                # (backward_fn, ctx, parents, g)
                out += ctx_arrays(step[1]) + [step[3]]
            elif step._node is not None:
                out += ctx_arrays(step._node[1])
        return out


def backward_input(root: Tensor, grad: Any, inputs: Sequence[Tensor]) -> tuple[list, WeightGrad]:
    """B: return ([dL/d(input) for each input], W) where dL/d(root) = grad.

    Each entry is a fresh array owned by the caller (None when the input does not reach
    root); inputs' .grad and hooks are left alone. No other leaf is touched until
    W.run() (see the module doc for the algorithm). grad may be None for a one-element
    root, as in Tensor.backward. `grad` and the forward's arrays must stay unchanged
    until W.run(): W reads them.
    """
    grad = _check(root, grad, inputs)
    order = topological_order(root)
    wanted = {id(x) for x in inputs}
    on_path = set()
    for t in order:                                         # parents come before children
        node = t._node
        if id(t) in wanted or (node is not None
                               and any(p is not None and id(p) in on_path for p in node[2])):
            on_path.add(id(t))
    grads, w_grads, steps = {id(root): grad}, {}, []
    found = {}
    for t in reversed(order):
        if id(t) not in on_path:
            steps.append(t)                                 # a weight-path tensor: W's job
            continue
        g = grads.pop(id(t), None)
        if g is None:
            continue
        if t._node is None:                                 # an input: its gradient is final
            found[id(t)] = g
            continue
        backward_fn, ctx, parents = t._node
        if all(p is None or id(p) in on_path for p in parents):
            _call_node(backward_fn, ctx, parents, g, grads)     # nothing here for W
            continue
        mine = [p if p is not None and id(p) in on_path else None for p in parents]
        rest = [p if p is not None and id(p) not in on_path else None for p in parents]
        _call_node(backward_fn, ctx, mine, g, grads, masked=True)
        steps.append((backward_fn, ctx, rest, g))         # W finishes this node
    if id(root) not in on_path:                             # nothing for B: W is everything
        w_grads[id(root)] = grad
    return [_own(x, found.get(id(x))) for x in inputs], WeightGrad(steps, w_grads, {id(grad)})


def _call_node(backward_fn: Any, ctx: Any, parents: list, g: Any, grads: dict,
               masked: bool = False) -> None:
    """Run one backward rule and sum what the non-None `parents` get from it.

    masked: ask the rule only for those parents (needs_input_grad is masked for the call
    and restored after it, so the graph can be walked again). Sums are `prev + gp`, never
    in place, exactly as in _run_backward.
    """
    if masked:
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = [n and p is not None for n, p in zip(needs, parents)]
        try:
            in_grads = backward_fn(ctx, g)
        finally:
            ctx.needs_input_grad = needs
    else:
        in_grads = backward_fn(ctx, g)
    if not isinstance(in_grads, (tuple, list)):
        in_grads = (in_grads,)
    for p, gp in zip(parents, in_grads):
        if p is None or gp is None:                         # not asked for (or not needed)
            continue
        prev = grads.get(id(p))
        grads[id(p)] = gp if prev is None else prev + gp


def _own(x: Tensor, g: Any) -> Any:
    """The gradient x.grad would receive (shape checked, cast to x's dtype), as a fresh
    array: it may be the very array a node remembered for W, which must not change."""
    if g is None:
        return None
    box = Tensor(x.data)                                    # a stand-in leaf, no copy
    accumulate_leaf(box, g, set())
    return box.grad.copy() if box.grad is g else box.grad


def _check(root: Any, grad: Any, inputs: Sequence[Any]) -> Any:
    """Validate the arguments; return grad as an xp array (ones for a 1-element root)."""
    xp = backend.xp
    if not isinstance(root, Tensor) or not root.requires_grad:
        raise ValueError(
            "backward_input: root does not require grad, so no graph leads to it. Run the "
            "chunk's forward from leaves with requires_grad=True (its input, its "
            "parameters), outside no_grad().")
    if grad is None:
        if root.data.size != 1:
            raise ValueError(
                f"backward_input: grad can only be omitted for a one-element root, but root "
                f"has shape {root.shape}. Pass grad= (dL/d(root)) with shape {root.shape}.")
        grad = xp.ones_like(root.data)
    else:
        grad = grad.data if isinstance(grad, Tensor) else xp.asarray(grad)
        if grad.shape != root.shape:
            raise ValueError(
                f"backward_input: grad has shape {grad.shape}, but root has shape "
                f"{root.shape}; grad must be dL/d(root), of root's shape.")
    for i, x in enumerate(inputs):
        if not isinstance(x, Tensor) or x._node is not None or not x.requires_grad:
            what = ("not a Tensor" if not isinstance(x, Tensor) else "not a leaf (an "
                    "operation made it)" if x._node is not None else "a leaf without grad")
            raise ValueError(
                f"backward_input: inputs[{i}] is {what}; B returns gradients of leaves that "
                "require grad. Make the chunk's input one, x = Tensor(h.data, "
                "requires_grad=True), and run the chunk's forward from x.")
    return grad
