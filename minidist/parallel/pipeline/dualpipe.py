"""DualPipe and DualPipeV: micro-batches fed from both ends, and a forward of one
micro-batch overlapped with the backward of another (DeepSeek-V3, arXiv:2412.19437,
Sec. 3.2.1; the order of its public implementation, deepseek-ai/DualPipe).

DualPipe (placement "dual", P even, M even, M >= 2P). The model is cut into P pieces.
Stage s holds two of them: piece s (chunk 0) and piece P-1-s (chunk 1), so every piece
lives on two stages, s and its mirror P-1-s, two copies of the same parameters. The first
M/2 micro-batches enter at stage 0 and flow up through the chunk-0 pieces; the other M/2
enter at stage P-1 and flow down through the chunk-1 pieces, which are the same pieces in
the same order 0, 1, ..., P-1. Both directions keep every stage busy at once, so the
pipeline fills from both ends; the two copies of a piece see different micro-batches, and
their gradients are summed between the mirrors before the update (stage.py).

DualPipeV (placement "v", any P, M >= 2P): DualPipe cut in half. P stages and 2P pieces
in a V (piece s and piece 2P-1-s on stage s, as ZBV), one copy of each, every micro-batch
down the chunk-0 pieces and back up the chunk-1 pieces. Stage s runs the actions of the
first-half rank s of a DualPipe on 2P ranks, its two directions now one stream.

One stage's order. Let H be the number of first-half ranks (P/2 for DualPipe, P for
DualPipeV), h = min(s, P-1-s) the stage's distance from its end of the pipeline, n the
micro-batches per direction (M/2, or M), and "phase 0" the direction in which the stage
is nearer the start (chunk 0 on the first half, chunk 1 on the second; for DualPipeV
chunk 0). Then, with F0/F1 forwards of phase 0/1, B the whole backward, Bz a split
one (its W deferred), W the oldest deferred weight gradient, and F0&B1 an overlapped
pair (an FB action):
    1  2(H-h-1) x F0                       warm up the near direction
    2  (h+1) x F0 F1                       both directions in flight
    3  (H-h-1) x Bz1 W F1                  first backwards, zero bubble
    4  (n-2H+h+1) x F0&B1 F1&B0            the steady state: every slot overlapped
                                           (the middle ranks' first pair not overlapped)
    5  (H-h-1) x B1 F1&B0
    6  (h+1) x B1 B0                       the second half of them split (Bz)
    7  (H-h-1) x W Bz0
    8  (h+1) x W
Each direction's micro-batches run in order on each chunk, so gradients accumulate in the
single process's order within a chunk. An FB runs its F, then its B, on this CPU (no
second stream to overlap them on); the simulator costs it as the overlap: costs["FB"], or
max(F, B).

Bubble and memory (DeepSeek-V3, Table 2; F, B the cost of a forward and of a whole
backward of one piece, W the weight-gradient part of B, F&B an overlapped pair):
    1F1B       (P-1)(F+B)               activations P            parameters 1x
    ZB1P       (P-1)(F+B-2W)            P                        1x
    DualPipe   (P/2-1)(F&B+B-3W)        P+1                      2x
    DualPipeV  (P-1)(F&B+B-3W) on P stages of 2P pieces (the table's PP = 2P)
tests/parallel/pipeline/test_dualpipe.py checks these with exact fractions.
Read next: stage.py (the mirrors' gradient sum), family.py (the names).
"""

from __future__ import annotations

from collections import deque

from minidist.parallel.pipeline.schedules import (Action, PipelineSchedule, check_sizes,
                                                  overlapped)


def _order(H: int, h: int, n: int) -> list[tuple]:
    """The eight steps (module docstring) of a first-half rank h of H: ("F", phase),
    ("B", phase, split), ("W",), or ("FB", forward phase, backward phase)."""
    ops: list[tuple] = [("F", 0)] * (2 * (H - h - 1))                    # 1
    ops += [op for _ in range(h + 1) for op in (("F", 0), ("F", 1))]     # 2
    ops += [op for _ in range(H - h - 1) for op in (("B", 1, True), ("W",), ("F", 1))]
    for i in range(n - 2 * H + h + 1):                                   # 4
        if i == 0 and h == H - 1:            # the middle ranks: not overlapped, to start
            ops += [("F", 0), ("B", 1, False)]
        else:
            ops.append(("FB", 0, 1))
        ops.append(("FB", 1, 0))
    ops += [op for _ in range(H - h - 1) for op in (("B", 1, False), ("FB", 1, 0))]
    split = False
    for i in range(h + 1):                                               # 6
        if i == (h + 1) // 2 and h % 2 == 1:
            split = True
        ops.append(("B", 1, split))
        if i == (h + 1) // 2 and h % 2 == 0:
            split = True
        ops.append(("B", 0, split))
    ops += [op for _ in range(H - h - 1) for op in (("W",), ("B", 0, True))]  # 7
    return ops + [("W",)] * (h + 1)                                      # 8


def _actions(ops: list[tuple], chunk_of, first_of) -> tuple[Action, ...]:
    """The ops as Actions: phase p runs chunk chunk_of(p) on micro-batches first_of(p),
    first_of(p) + 1, ... in order; W takes the oldest split backward's."""
    nf, nb, deferred, out = [0, 0], [0, 0], deque(), []

    def forward(p):
        nf[p] += 1
        return Action("F", first_of(p) + nf[p] - 1, chunk_of(p))

    def backward(p, split):
        nb[p] += 1
        b = Action("B", first_of(p) + nb[p] - 1, chunk_of(p))
        if split:
            deferred.append(Action("W", b.micro_batch, b.chunk))
        return b

    for op in ops:
        if op[0] == "F":
            out.append(forward(op[1]))
        elif op[0] == "B":
            out.append(backward(op[1], op[2]))
        elif op[0] == "W":
            out.append(deferred.popleft())
        else:
            out.append(overlapped(forward(op[1]), backward(op[2], False)))
    return tuple(out)


def _check(name: str, P: int, M: int, even_p: bool) -> None:
    check_sizes(name, P, M)
    if even_p and P % 2:
        raise ValueError(f"{name}: P = {P} stages; DualPipe pairs stage s with stage P-1-s, "
                         "so P must be even (or use dualpipev, which takes any P).")
    if M < 2 * P or M % 2:
        raise ValueError(f"{name}: M = {M} micro-batches; it needs an even M >= 2P = "
                         f"{2 * P} (each direction's steady state needs its P micro-batches "
                         "in flight).")


def dualpipe(P: int, M: int) -> PipelineSchedule:
    """DualPipe on P stages (even), M micro-batches (even, >= 2P): module docstring."""
    _check("dualpipe", P, M, even_p=True)
    H, n = P // 2, M // 2
    rows = []
    for s in range(P):
        second = int(s >= H)                   # phase p is direction p ^ second
        rows.append(_actions(_order(H, min(s, P - 1 - s), n),
                             chunk_of=lambda p, x=second: p ^ x,
                             first_of=lambda p, x=second: (p ^ x) * n))
    return PipelineSchedule("dualpipe", P, M, tuple(rows), chunks=2, placement="dual")


def dualpipe_v(P: int, M: int) -> PipelineSchedule:
    """DualPipeV on P stages, M micro-batches (even, >= 2P): module docstring."""
    _check("dualpipev", P, M, even_p=False)
    rows = tuple(_actions(_order(P, s, M), chunk_of=lambda p: p, first_of=lambda p: 0)
                 for s in range(P))
    return PipelineSchedule("dualpipev", P, M, rows, chunks=2,       # one stage: V = loop
                            placement="v" if P > 1 else "loop")
