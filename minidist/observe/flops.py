"""The FLOP ledger: count the floating-point operations a training step actually executes.

A formula such as 6N + 12LHQT says what a step SHOULD cost. The ledger says what it DID
cost: every autograd operation that runs is counted, by operation and by phase, with the
rules of observe/op_flops.py (matmul FLOPs 2*M*K*N; other FLOPs one per element per NumPy
pass). Comparing the two (observe/throughput.py) shows exactly where an implementation
does more or less than the model needs.

    ledger = FlopLedger()
    with ledger:                          # hooks on
        _, loss = model(x, y)
        loss.backward()
    ledger.count_optimizer(opt)           # the update, from its formula
    ledger.model_flops(), ledger.hardware_flops(), print(ledger.table())

Phases:
    forward     an operation's forward, outside any backward
    backward    an operation's backward rule, and the engine's own gradient sums (a
                tensor used twice gets its two gradients added; a leaf's .grad += g)
    recompute   a forward that runs INSIDE a backward rule: activation recomputation
                (memory/recompute.py)
    optimizer   the update and the gradient norm, counted from their formulas
Model FLOPs = matmul FLOPs of forward + backward: the work the model needs, whatever
the implementation (PaLM's MFU numerator). Hardware FLOPs = everything counted, both
kinds, all four phases: the work that was executed (HFU's numerator).

How it hooks in (one rank's view; each process counts its own operations):
    1. entering the block plugs the ledger into the autograd as an Observer
       (autograd/tensor.py: nothing is counted, and nothing costs, outside the block);
    2. after each forward, `forward` counts it from the shapes and, if the output keeps a
       graph node, wraps the node's backward rule so that the rule, when it runs, is
       counted too (whoever calls it: Tensor.backward, split backward, ZeRO-3);
    3. a wrapped backward raises a depth counter while it runs; forwards seen at depth
       > 0 are recomputation.
Operations without a rule (a new Function) are counted as zero and listed in `unknown`.
Not counted: the engine's gradient sums inside split backward (autograd/split.py's own
loop), work outside Functions, and the arithmetic inside collectives.

Reference: Chowdhery et al. 2022, "PaLM", arXiv:2204.02311, App. B (model vs hardware
    FLOPs); Korthikanti et al. 2022, arXiv:2205.05198 (MFU and HFU under recomputation).
Read next: observe/throughput.py.
"""

from __future__ import annotations

from typing import Any

from minidist.autograd.tensor import Observer, observe, unobserve
from minidist.observe import op_flops

PHASES = ("forward", "backward", "recompute", "optimizer")
_active: "FlopLedger | None" = None


class FlopLedger(Observer):
    """FLOPs by (op, phase): matmul and other FLOPs, and the number of calls."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], list[int]] = {}   # (op, phase) -> [mm, other, n]
        self.unknown: dict[str, int] = {}                      # op without a rule -> calls
        self._depth = 0                                        # backward rules running now

    # --- plugging in and out (`with ledger:` calls start and stop) ---
    def start(self) -> "FlopLedger":
        """Count from now on: plug this ledger into the autograd."""
        global _active
        if _active is not None:
            raise RuntimeError("FlopLedger: another ledger is counting in this process; "
                               "stop it first (one ledger at a time).")
        _active = observe(self)
        return self

    def stop(self) -> None:
        """Stop counting (if this ledger is the one counting)."""
        global _active
        if _active is self:
            _active = None
            unobserve(self)

    def __enter__(self) -> "FlopLedger":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def active(self) -> bool:
        """True between start() and stop() (inside `with ledger:`)."""
        return _active is self

    # --- the Observer: what the autograd shows while the ledger counts ---
    def forward(self, fn, ctx, args, arrays, kwargs, result, t0) -> None:
        """Count a forward now, and wrap its node's backward rule to count that later."""
        rules = op_flops.rule_for(fn)
        if rules is None:
            self.unknown[fn.__name__] = self.unknown.get(fn.__name__, 0) + 1
            return
        shapes, out = [_shape(a) for a in arrays], result.data.shape
        mm, other = rules[0](ctx, shapes, out)
        self.add(fn.__name__, "recompute" if self._depth else "forward", mm, other)
        if result._node is not None:
            backward, ctx, parents = result._node
            result._node = (_counted(self, fn.__name__, rules[1], backward, shapes, out),
                            ctx, parents)

    def grad_add(self, g: Any) -> None:
        """One add per element of g: the engine's own gradient sums."""
        self.add("grad_sum", "backward", other=g.size)

    # --- recording ---
    def add(self, op: str, phase: str, matmul: int = 0, other: int = 0, calls: int = 1) -> None:
        """Add FLOPs to (op, phase) by hand (the optimizer, or work outside autograd)."""
        if phase not in PHASES:
            raise ValueError(f"FlopLedger.add: phase {phase!r} is not one of {PHASES}.")
        entry = self.entries.setdefault((op, phase), [0, 0, 0])
        entry[0] += int(matmul)
        entry[1] += int(other)
        entry[2] += calls

    def count_optimizer(self, optimizer: Any, grad_norm: bool = True) -> int:
        """Add one update of `optimizer` (optim.AdamW or optim.SGD), over the parameters
        that have a gradient now, and (grad_norm) the global gradient norm; returns FLOPs."""
        name = type(optimizer).__name__.lower()
        sizes = [p.data.size for p in optimizer.params if p.grad is not None]
        flops = op_flops.optimizer_flops(
            name, sum(sizes), weight_decay=getattr(optimizer, "weight_decay", 0.0),
            momentum=getattr(optimizer, "momentum", 0.0))
        self.add(type(optimizer).__name__, "optimizer", other=flops)
        if grad_norm:
            self.add("grad_norm", "optimizer", other=op_flops.grad_norm_flops(sizes))
            flops += op_flops.grad_norm_flops(sizes)
        return flops

    def merge(self, other: "FlopLedger") -> None:
        """Add another ledger's counts to this one (e.g. those of other ranks)."""
        for (op, phase), (mm, oth, n) in other.entries.items():
            self.add(op, phase, mm, oth, n)
        for op, n in other.unknown.items():
            self.unknown[op] = self.unknown.get(op, 0) + n

    def reset(self) -> None:
        """Forget every count."""
        self.entries.clear()
        self.unknown.clear()

    # --- reading ---
    def total(self, kind: str = "all", phases: tuple[str, ...] = PHASES) -> int:
        """FLOPs of one kind ("matmul", "other" or "all") summed over `phases`."""
        if kind not in ("matmul", "other", "all"):
            raise ValueError(f"FlopLedger.total: kind {kind!r}; use 'matmul', 'other', 'all'.")
        pick = {"matmul": (0,), "other": (1,), "all": (0, 1)}[kind]
        return sum(e[i] for (_, ph), e in self.entries.items() if ph in phases for i in pick)

    def model_flops(self) -> int:
        """Matmul FLOPs of forward and backward: what the model needs (MFU's numerator)."""
        return self.total("matmul", ("forward", "backward"))

    def hardware_flops(self) -> int:
        """All FLOPs counted, in every phase, recomputation included (HFU's numerator)."""
        return self.total("all")

    def table(self) -> str:
        """One line per (op, phase), largest first, with the totals under it."""
        rows = sorted(self.entries.items(), key=lambda kv: (-kv[1][0] - kv[1][1], kv[0]))
        lines = [f"{'op':<16}{'phase':<11}{'matmul FLOPs':>16}{'other FLOPs':>14}{'calls':>7}"]
        for (op, phase), (mm, other, n) in rows:
            lines.append(f"{op:<16}{phase:<11}{mm:>16,d}{other:>14,d}{n:>7d}")
        lines.append(f"{'total':<27}{self.total('matmul'):>16,d}{self.total('other'):>14,d}")
        if self.unknown:
            lines.append("not counted (no rule in observe/op_flops.py): " + ", ".join(
                f"{op} x{n}" for op, n in sorted(self.unknown.items())))
        return "\n".join(lines)


def _shape(a: Any):
    return None if a is None else getattr(a, "shape", ())


def _counted(ledger: FlopLedger, name: str, rule, backward, shapes: list, out: tuple):
    """backward(ctx, g), counted by `rule` when it runs while the ledger is active."""
    def counted_backward(ctx: Any, g: Any) -> Any:
        ledger._depth += 1
        try:
            grads = backward(ctx, g)
        finally:
            ledger._depth -= 1
        if ledger.active:
            seq = grads if isinstance(grads, (tuple, list)) else (grads,)
            done = [gr is not None for gr in seq] + [False] * (len(shapes) - len(seq))
            ledger.add(name, "backward", *rule(ctx, shapes, out, done))
        return grads
    counted_backward.__qualname__ = backward.__qualname__     # autograd/saved.py names by it
    return counted_backward
