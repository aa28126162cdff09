"""ZeRO-3's forward and backward: a unit's parameters exist only while its piece of the model runs.

Under stage 3 every rank keeps only w_shard (S_u,) of each unit (flat.py) and the model's
Parameters hold a NaN placeholder (a zero-stride view of one NaN: a forward that forgot
to gather is loud). The GPT forward is cut into pieces, each run by one unit's params:
    embed   x = drop(wte[idx] + wpe[0..T-1])      unit 0 (root: wte, wpe, ln_f, head)
    block j x = Block_j(x)                        unit 1 + j
    head    logits = ln_f(x) @ wte^T              unit 0 again (tied weights)
Each piece is one autograd Function (`_Piece`). Its forward gathers the unit, runs the
piece under no_grad and frees the unit; its backward gathers the unit again, re-runs the
piece WITH a graph on the saved input (recomputation), backpropagates dy through it,
reduce-scatters the unit's gradient into dw_shard (zero.py) and frees everything. The
recomputation is the price of freeing with this autograd: a graph built in the forward
would keep the gathered arrays alive until its backward, i.e. all of them at once. So
stage 3 runs every block's forward twice (about 4/3 of the compute of a step).

One rank's view of one micro-batch (L blocks; "+u" = all_gather of unit u started
asynchronously on the group's worker, "=u" = wait for it, "-u" = free it):
    forward:  =0 +1 embed | =1 +2 block0 -1 | =2 +3 block1 -2 | ... | head -0
    backward: =0 +L head | =L +(L-1) block(L-1) RS(L) -L | ... | block0 RS(1) -1 |
              embed RS(0) -0
The root unit stays gathered from the embedding to the head (both use wte) and again
from the head's backward to the embedding's. While block j computes, block j+1's gather
is in flight (forward; j-1 in backward): the prefetch that hides communication.

Memory: at most root + two adjacent blocks are gathered at once, so
    peak_gathered_params = b W (S_0 + max_j (S_{1+j} + S_{2+j}))      (L >= 2),
and during the backward the root's gradient buffer plus one block's:
    peak_unsharded_grads = b W (S_0 + max_j S_{1+j})                   (no accumulation).
Communication per micro-batch: each unit all-gathered twice (2 Ψ_pad (W-1)/W sent);
the reduce-scatter only on the last micro-batch (Ψ_pad (W-1)/W): 3 Ψ_pad (W-1)/W per
step without accumulation, the paper's 1.5x of data parallelism.

Reference: Rajbhandari et al. 2020, arXiv:1910.02054, Sec. 5.3 (P_p) and Sec. 7.2.2 (the
    3Ψ volume); Zhao et al. 2023, "PyTorch FSDP", arXiv:2304.11277, Sec. 3.3-3.4
    (gather/free per unit, backward prefetch); Chen et al. 2016, arXiv:1604.06174
    (recomputation).
Read next: parallel/zero_memory.py.
"""

from __future__ import annotations

import numpy as np

from minidist.autograd import Function, Tensor, no_grad
from minidist.parallel import placement


class _Piece(Function):
    """y = piece(x) with the piece's unit gathered only inside forward and backward."""

    @staticmethod
    def forward(ctx, x, handle, *, gatherer: "Gatherer", kind: str, j: int):
        ctx.x, ctx.gatherer, ctx.kind, ctx.j = x, gatherer, kind, j
        gatherer.before(kind, j, backward=False)
        with no_grad():
            y = gatherer.run(kind, j, None if x is None else Tensor(x))
        gatherer.after(kind, j, backward=False)
        gatherer.inner = y                  # its placement tags go to the outer result
        return y.data

    @staticmethod
    def backward(ctx, dy):
        g = ctx.gatherer
        g.before(ctx.kind, ctx.j, backward=True)
        x = None if ctx.x is None else Tensor(ctx.x, requires_grad=True)
        g.run(ctx.kind, ctx.j, x).backward(dy)          # recompute, then backpropagate
        g.after(ctx.kind, ctx.j, backward=True)
        return (None if x is None else x.grad), None


class Gatherer:
    """Stage 3 of a ZeroEngine: gathers, frees and prefetches units around the pieces."""

    def __init__(self, engine) -> None:
        model = engine.model
        if not all(hasattr(model, a) for a in ("wte", "wpe", "blocks", "ln_f", "cfg")):
            raise ValueError(f"ZeroEngine stage 3: {type(model).__name__} is not a GPT; stage "
                             "3 cuts the GPT forward into embed / blocks / head pieces. Use "
                             "stage 1 or 2 for other models.")
        if model.cfg.moe_every:
            raise ValueError("ZeroEngine stage 3: MoE blocks return an auxiliary loss that the "
                             "piecewise forward does not carry; use stage 1 or 2, or a dense "
                             "GPT (moe_every=0).")
        self.e, self.model, self.L = engine, model, len(model.blocks)
        # the shards as leaves: inputs that make every piece's backward run (grad: None)
        self.handles = [Tensor(s, requires_grad=True) for s in engine.p_shard]
        self.work: dict[int, object] = {}           # unit -> Work of its all_gather
        self.gathered: set[int] = set()
        self.root_grad: np.ndarray | None = None     # root gradient between head and embed
        self.inputs: tuple = ()
        for i in range(len(engine.units)):
            self._free_params(i)

    # --- the forward train.py calls through ZeroEngine.forward ---
    def forward(self, idx, targets=None, *, n_tokens=None, aux_weight=1.0, dropout_key=None):
        """(logits, loss) of the GPT, piece by piece (the same ops in the same order)."""
        self.inputs = (np.asarray(idx), dropout_key)
        x = self._apply(None, "embed", 0)
        for j in range(self.L):
            x = self._apply(x, "block", j)
        logits = self._apply(x, "head", 0)
        if targets is None:
            return logits, None
        return logits, self.model.loss(logits, targets, n_tokens, (), aux_weight)

    def _apply(self, x: Tensor | None, kind: str, j: int) -> Tensor:
        handle = self.handles[1 + j if kind == "block" else 0]
        y = _Piece.apply(x, handle, gatherer=self, kind=kind, j=j)
        return placement.carry(self.inner, y)

    def run(self, kind: str, j: int, x: Tensor | None) -> Tensor:
        """The piece itself, on the currently gathered parameters."""
        m, (idx, key) = self.model, self.inputs
        if kind == "embed":
            return m.embed(idx, key)                                       # (B, T, C)
        if kind == "block":
            return m.blocks[j](x, key)[0]                                  # (B, T, C)
        return m.head(x)                                                   # (B, T, V)

    # --- the schedule of the module docstring ---
    def before(self, kind: str, j: int, backward: bool) -> None:
        unit = 1 + j if kind == "block" else 0
        self._acquire(unit)
        if not backward:
            nxt = 1 if kind == "embed" else 2 + j if kind == "block" else None
        else:
            nxt = self.L if kind == "head" else j if kind == "block" else None
        if nxt is not None and 1 <= nxt <= self.L:
            self._prefetch(nxt)

    def after(self, kind: str, j: int, backward: bool) -> None:
        e = self.e
        if not backward:
            if kind != "embed":                       # the root stays until the head
                self._release(1 + j if kind == "block" else 0)
            return
        if kind == "block":
            flat = self._new_grad_buffer(1 + j)
            self._collect(1 + j, flat)
            e.add_unit_grads(1 + j, flat)
            self._release(1 + j)
        elif kind == "head":                          # root: head part now, embed part later
            self.root_grad = self._new_grad_buffer(0)
            self._collect(0, self.root_grad)
        else:
            self._collect(0, self.root_grad)          # wte: head part + embed part
            flat, self.root_grad = self.root_grad, None
            e.add_unit_grads(0, flat)
            self._release(0)

    # --- gather / free ---
    def _prefetch(self, i: int) -> None:
        """Start unit i's all_gather on the group's worker unless it is already on its way."""
        if i in self.work:
            return
        e = self.e
        self.work[i] = e._all_gather(e.p_shard[i], async_op=True)
        held = sum(e.units[u].padded for u in self.work) * e.dtype.itemsize
        e._note_peak("gathered_params", held)

    def _acquire(self, i: int) -> None:
        """Make unit i's parameters real: wait for its gather, point the Parameters at it."""
        self._prefetch(i)
        if i not in self.gathered:
            flat = self.work[i].wait().reshape(-1)                 # (W S_u,)
            for p, view in zip(self.e.units[i].params, self.e.units[i].views(flat)):
                p.data = view
            self.gathered.add(i)

    def _release(self, i: int) -> None:
        self.work.pop(i)
        self.gathered.discard(i)
        self._free_params(i)

    def _free_params(self, i: int) -> None:
        for p in self.e.units[i].params:
            p.data = np.broadcast_to(np.array(np.nan, p.data.dtype), p.data.shape)

    # --- gradients ---
    def _new_grad_buffer(self, i: int) -> np.ndarray:
        e = self.e
        flat = np.zeros(e.units[i].padded, e.dtype)
        held = flat.nbytes + sum(g.nbytes for g in e.g_acc if g is not None) + (
            self.root_grad.nbytes if self.root_grad is not None else 0)
        e._note_peak("unsharded_grads", held)
        return flat

    def _collect(self, i: int, flat: np.ndarray) -> None:
        """flat += every .grad of unit i's Parameters (left by the recomputed backward)."""
        u = self.e.units[i]
        for view, p in zip(u.views(flat), u.params):
            if p.grad is not None:
                view += p.grad
                p.grad = None
