"""Flat sharded buffers: a group of parameters as one padded vector cut into W equal shards.

ZeRO never shards a parameter by its shape. It lays the parameters of a unit (a
transformer block, or the embeddings with the final LayerNorm and head) end to end in
one flat vector, in model order, pads the vector with zeros to a multiple of W, and
gives rank r the contiguous slice [r*S, (r+1)*S), S = ceil(N / W). A shard may start
in the middle of one parameter and end in the middle of another; that is fine because
everything ZeRO does to a shard (sum gradients over ranks, sum squares for the norm,
AdamW or SGD) is elementwise. Padding holds zeros in parameters, gradients and
optimizer state, and stays zero: AdamW and SGD map (p, g, m, v) = 0 to 0.

Why units rather than one vector for the whole model: ZeRO-3 gathers the parameters of
one block just before the block runs and frees them right after, so a block must be a
unit of its own; ZeRO-1 and 2 use the same units so that every stage shards the same
elements the same way and the ownership map below holds for all of them.

One rank's view (rank r of W, one unit of N elements):
    flat  = [p_0.ravel(), p_1.ravel(), ..., zeros(W*S - N)]      (W*S,)
    shard = flat[r*S : (r+1)*S]                                 (S,)    what r updates
    reduce_scatter(flat_grad) returns exactly the gradient of `shard` (chunk r of
    np.array_split of a length divisible by W), and all_gather(shard).reshape(-1)
    rebuilds `flat`.

What an optimizer steps is a `FlatShard`: .data = the shard (S,) of the parameters and
.grad = the shard (S,) of the summed gradient, the two attributes optim/ reads. So ZeRO
runs the very AdamW / SGD objects DDP runs on whole parameters, over one "parameter" per
unit, and keeps their state (m, v, momentum) as shards of the same flat layout.

Shapes: N = sum of the unit's parameter sizes; S = ceil(N / W); padding W*S - N < W.
Reference: Rajbhandari et al. 2020, "ZeRO", arXiv:1910.02054, Sec. 5 (partitioning);
    Zhao et al. 2023, "PyTorch FSDP", arXiv:2304.11277, Sec. 3.2 (FlatParameter units).
Read next: parallel/zero/engine.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minidist.nn.module import Module, Parameter


@dataclass(frozen=True)
class Slot:
    """One parameter inside a unit: where its elements sit in the unit's flat vector."""

    name: str                    # full dotted name, e.g. "blocks.0.attn.qkv.weight"
    index: int                   # position in model.parameters() (optimizer state keys)
    shape: tuple[int, ...]
    offset: int                  # first element in the flat vector
    numel: int


class FlatUnit:
    """The flat layout of one unit's parameters over W ranks (see the module docstring)."""

    def __init__(self, name: str, params: list[tuple[str, int, Parameter]], W: int) -> None:
        self.name, self.W = name, W
        self.params = [p for _, _, p in params]
        slots, offset = [], 0
        for full_name, index, p in params:
            n = int(p.data.size)
            slots.append(Slot(full_name, index, tuple(p.data.shape), offset, n))
            offset += n
        self.slots = slots
        self.numel = offset                              # N
        self.shard = max(1, math.ceil(offset / W))       # S (>= 1: no empty messages)
        self.padded = self.shard * W                     # W*S

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of the flat vector that `rank` owns."""
        return rank * self.shard, (rank + 1) * self.shard

    def pack(self, arrays: list[np.ndarray], dtype) -> np.ndarray:
        """A new zero-padded flat vector (W*S,) holding `arrays` in slot order."""
        flat = np.zeros(self.padded, dtype)
        for view, a in zip(self.views(flat), arrays):
            view[...] = a
        return flat

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        """One view of `flat` per slot, in the parameter's shape (writes go to `flat`)."""
        return [flat[s.offset:s.offset + s.numel].reshape(s.shape) for s in self.slots]

    def owners(self, slot: Slot) -> list[tuple[int, int, int]]:
        """(rank, lo, hi): the ranks that own elements [lo, hi) of this parameter (flat order)."""
        out = []
        for r in range(self.W):
            a, b = self.shard_range(r)
            lo, hi = max(a, slot.offset), min(b, slot.offset + slot.numel)
            if lo < hi:
                out.append((r, lo - slot.offset, hi - slot.offset))
        return out


class FlatShard:
    """Rank r's slice of one unit, shaped like a Parameter for optim/: `.data` = w_shard (S,),
    `.grad` = dw_shard (S,). Both are updated in place, never replaced, so views of them
    (the unit's flat parameters under ZeRO-1/2, its gradient buffer under ZeRO-1) stay live."""

    __slots__ = ("name", "data", "grad")

    def __init__(self, name: str, data: np.ndarray, grad: np.ndarray) -> None:
        self.name, self.data, self.grad = name, data, grad

    def __repr__(self) -> str:
        return f"FlatShard({self.name!r}, {self.data.shape[0]} elements)"


def split_units(model: Module, W: int, experts_W: int | None = None) -> list[FlatUnit]:
    """The units of `model`: unit 0 ("root") holds every parameter outside model.blocks
    (embeddings, final LayerNorm, head); unit 1 + i holds model.blocks[i]. A pipeline
    stage's model holds only some blocks, and a middle stage no root unit at all.
    experts_W (expert parallelism): a MoE block's experts form a unit of their own,
    "blocks.i.experts", sharded over experts_W ranks (their replicas), after the block's.

    A model without `blocks` is one unit. Order inside a unit is model.parameters() order.
    """
    named = list(model.named_parameters())
    blocks = [n for n, _ in model.blocks.named_children()] if hasattr(model, "blocks") else []
    groups: dict[str, list] = {"root": []}
    for i in blocks:                                      # a pipeline stage: some blocks
        groups[f"blocks.{i}"] = []
        if experts_W is not None:
            groups[f"blocks.{i}.experts"] = []
    for index, (name, p) in enumerate(named):
        parts = name.split(".")
        key = f"blocks.{parts[1]}" if blocks and parts[0] == "blocks" else "root"
        if experts_W is not None and ".moe.experts." in name:
            key += ".experts"
        groups[key].append((name, index, p))
    return [FlatUnit(key, entries, experts_W if key.endswith(".experts") else W)
            for key, entries in groups.items() if entries]   # (a middle stage: no root)


def unit_of(units: list[FlatUnit], module_name: str) -> int:
    """Index of the unit holding the parameters of the module called `module_name` (its
    dotted name in model.named_modules(): "" is the model, "blocks.3.attn" is in unit
    "blocks.3"); 0, the root, for every module outside the blocks."""
    for i, u in enumerate(units):
        if u.name != "root" and (module_name == u.name or module_name.startswith(u.name + ".")):
            return i
    return 0


def ownership_map(units: list[FlatUnit]) -> list[str]:
    """Lines "name (shape): r0[lo:hi] r1[lo:hi] ..." saying which rank owns which elements."""
    lines = []
    for u in units:
        lines.append(f"unit {u.name}: N = {u.numel}, shard S = {u.shard} per rank, "
                     f"padding {u.padded - u.numel}")
        for s in u.slots:
            parts = " ".join(f"r{r}[{lo}:{hi}]" for r, lo, hi in u.owners(s))
            lines.append(f"  {s.name} {s.shape}: {parts}")
    return lines
