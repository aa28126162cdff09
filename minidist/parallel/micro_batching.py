"""Micro-batching: a rank's rows of each global batch, cut into M micro-batches, and the
trivial step schedule, gradient accumulation.

The third job of a training step (parallel/compose.py) is the step schedule: who runs the
forward and backward of which micro-batch, in what order. It owns the `backward()` calls;
the model and the engine only react to them. Without a pipeline it is this module's
gradient accumulation; a pipeline schedule (parallel/pipeline/) runs the same micro-batches
in another order across stages.

Micro-batches. Step s reads the global batch ids = data.global_indices(s, B). Its B rows
are cut into dp * M equal parts; dp rank d takes parts d M .. d M + M - 1, so micro-batch
m of dp rank d holds global rows (d M + m) B/(dp M) ... (every tp rank of dp rank d holds
the same rows; under context parallelism each cp rank keeps its positions of them). Uneven
work (reliability/straggler.py) gives dp rank d r_d rows instead, any r_d >= M summing to
B, cut into M micro-batches of sizes within one of each other. Each micro-batch carries
its global sample ids (for dropout) and aux_weight = (its tokens on this rank) / (tokens
of the global batch) = rows / B, times T_cp / T under context parallelism (the weight of
a MoE layer's auxiliary losses, means over routing groups).

The loss of every micro-batch is divided by the number of counted targets in the WHOLE
global batch, n_tokens, so the micro-batch losses (and gradients) of all ranks simply add
up to the global-batch loss. Dividing by a local count instead weighs a token by how many
tokens its rank happened to get (Megatron-LM #7452; transformers #34191): in check mode
`check_token_count` recounts the targets that the dp ranks really used, all-reduces the
count over dp, and raises unless it equals the n_tokens the loss was divided by.

Gradient accumulation, one rank's view of step s (M micro-batches):
    for m in 0 .. M-2, inside engine.no_sync():   loss_m = forward(m); loss_m.backward()
    m = M-1, syncing:                             loss_m = forward(m); loss_m.backward()
                                                  (its backward starts the dp reduction)
    return sum_m loss_m   (this rank's share of the global-batch loss)
Communication: none here; the engine reduces over dp, the layers over tp.
Read next: train.py; for pipelines parallel/pipeline/schedules.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from minidist import collectives as C
from minidist.data import IGNORE_INDEX, SyntheticData
from minidist.nn import DropoutKey
from minidist.parallel.placement import PlacementError


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of one rank: its rows x, y (rows, T) and how to weigh it."""

    index: int
    x: np.ndarray
    y: np.ndarray
    dropout_key: DropoutKey
    aux_weight: float


def global_token_count(y_all: np.ndarray) -> int:
    """Counted targets (!= -100) of the WHOLE global batch: the loss's denominator."""
    return int((y_all != IGNORE_INDEX).sum())


def micro_batches(data: SyntheticData, step: int, global_batch: int, dp: int, dp_rank: int,
                  M: int, seed: int, positions: np.ndarray | None = None,
                  rows: tuple[int, ...] | None = None) -> tuple[list[MicroBatch], int]:
    """(this dp rank's M micro-batches of `step`, n_tokens of the global batch).

    positions: under context parallelism, the global positions this cp rank holds; the
    micro-batches then carry only those columns, x, y (rows, T_cp).
    rows: uneven work (reliability/straggler.py): rows[d] rows for dp rank d (dp ints >= M,
    summing to B); rank d takes the rows after those of ranks < d, cut into M micro-batches
    whose sizes differ by at most one (the larger first). Default: B/(dp M) per micro-batch.
    Any partition gives the same global gradient up to the order of additions, since
    every loss is divided by the global n_tokens.
    """
    per_rank = _check_rows(rows, global_batch, dp, M) if rows is not None \
        else (global_batch // (dp * M) * M,) * dp
    ids = data.global_indices(step, global_batch)                        # (B,)
    x_all, y_all = data.batch(ids)                                       # (B, T) each
    cols = slice(None) if positions is None else np.asarray(positions)
    start, mine = sum(per_rank[:dp_rank]), per_rank[dp_rank]
    out = []
    for m in range(M):
        n = mine // M + (m < mine % M)                                   # rows of this one
        part, start = slice(start, start + n), start + n
        key = DropoutKey(seed, step, tuple(int(i) for i in ids[part]))
        share = 1.0 if positions is None else len(positions) / x_all.shape[1]
        out.append(MicroBatch(m, x_all[part][:, cols], y_all[part][:, cols], key,
                              n / global_batch * share))
    return out, global_token_count(y_all)


def _check_rows(rows, global_batch: int, dp: int, M: int) -> tuple[int, ...]:
    """rows as a tuple, or ValueError unless it gives each of the dp ranks >= M rows, B in all."""
    rows = tuple(rows)
    if len(rows) != dp or any(isinstance(r, bool) or not isinstance(r, (int, np.integer))
                              or r < M for r in rows) or sum(rows) != global_batch:
        raise ValueError(f"micro_batches: rows={rows} must give each of the dp={dp} ranks an "
                         f"int >= M={M} rows (one per micro-batch), {global_batch} (the global "
                         "batch) in all.")
    return tuple(int(r) for r in rows)


def grad_accumulation(engine, batches: list[MicroBatch], n_tokens: int) -> float:
    """The trivial schedule: forward + backward of each micro-batch in order; the last one
    outside no_sync(). Returns the sum of the micro-batch losses."""
    total = 0.0
    for mb in batches:
        last = mb.index == len(batches) - 1
        with contextlib.nullcontext() if last else engine.no_sync():
            _, loss = engine.forward(mb.x, mb.y, n_tokens=n_tokens, aux_weight=mb.aux_weight,
                                     dropout_key=mb.dropout_key)
            loss.backward()
        total += float(loss.item())
    return total


def check_token_count(batches: list[MicroBatch], n_tokens: int, dp_group) -> None:
    """COLLECTIVE over dp (x cp): PlacementError unless n_tokens = the targets that all the
    ranks holding different tokens used."""
    mine = sum(int((mb.y != IGNORE_INDEX).sum()) for mb in batches)
    used = int(C.all_reduce(np.array([mine], np.int64), group=dp_group)[0])
    if used != n_tokens:
        raise PlacementError(
            f"{getattr(dp_group, 'prefix', '')} the loss was divided by n_tokens={n_tokens}, "
            f"but the dp ranks' micro-batches hold {used} counted targets in all (this rank: "
            f"{mine}). Divide every micro-batch loss by the GLOBAL count, or the gradient "
            "weighs tokens by how many their rank happened to get.")
