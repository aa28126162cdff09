"""Pipeline timeline renderers: draw a Timeline as text, as a Chrome trace, or as a PNG.

A pipeline schedule is understood by looking at it: one row per stage, time to the right,
every forward, backward and weight-gradient a labelled bar, the bubble the blank space.
The renderers here draw a Timeline (schedule_sim.py), simulated or recorded from a real
run, so that the two can be put side by side and compared.

ASCII, step by step (`ascii`):
    1. choose the cell: if every start and end is a whole multiple of 1/q time units
       (q <= 12; q = 1 for unit costs), one cell per 1/q unit, exactly (up to 120 cells);
       otherwise cut the makespan into `columns` equal cells (default 60)
    2. in each cell of each stage write the action occupying most of it (idle counts as a
       candidate and is drawn "."), 3 characters: kind and micro-batch, upper case F B W
       for chunk 0, lower case f b w for chunks >= 1 (interleaved schedules); an
       overlapped FB (DualPipe's F&B) shows "X" and its forward's micro-batch in the first
       half of its cells and "&" and its backward's in the rest; an action
       too short to win a cell still gets one near its midpoint, so that every action
       of a row shows, in the order it ran (`_cells`)
    3. a header with the schedule name, P, M and the bubble; a legend line below

1F1B, P=3, M=4, default costs (F = 1, B = 2: a backward costs two forwards), drawn by
`ascii(simulate(one_f_one_b(3, 4)))`; tests/parallel/pipeline/test_schedule_sim.py checks it:

    1f1b: P=3, M=4, bubble 33.3% (1 cell = 1 time unit)
    stage 0 |F0 F1 F2 .  .  .  .  B0 B0 F3 B1 B1 .  B2 B2 .  B3 B3 |
    stage 1 |.  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3 .  .  |
    stage 2 |.  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  .  .  .  |
    Fm/Bm/Wm: forward/backward/weight-grad of micro-batch m; f/b/w: chunk >= 1; .: idle

Stage 2 (the last) runs each backward right after its forward; stage 0 waits 4 units for
the first gradient. Every stage is idle 6 of the 18 units, (P-1)(F+B) = 2 x 3 (the fill and
the drain, split differently per stage), so the bubble is 6/18 = (P-1)/(M+P-1).

Chrome trace (`chrome_trace`): one row per stage (its rank), one bar per action, named
"F3" or "B3 (chunk 1)", cat = the kind; a simulated time unit is drawn as 1 ms. Open the
file in https://ui.perfetto.dev. PNG (`plot_png`): a Gantt chart with matplotlib (the
optional extra "plot"), F B W in distinct colours, lighter shades for later chunks; an FB
is two half-height bars over the same time, its F above its B.

Shapes: none; a Timeline holds per stage a list of Slot(action, start, end).
References:
    Interleaved 1F1B diagrams -- Narayanan et al. 2021, arXiv:2104.04473, Fig. 4.
    ZB-H1 diagrams -- Qi et al. 2023, arXiv:2401.10241, Fig. 3.
    "Trace Event Format", Google (see observe/trace.py).
Read next: parallel/pipeline/stage.py (the mechanics that run a schedule on P ranks).
"""

from __future__ import annotations

import os
from typing import Sequence

from minidist.observe.trace import Trace
from minidist.parallel.pipeline.schedule_sim import Slot, Timeline
from minidist.parallel.pipeline.schedules import FB, Action

IDLE = "."
LEGEND = "Fm/Bm/Wm: forward/backward/weight-grad of micro-batch m; f/b/w: chunk >= 1; .: idle"
FB_LEGEND = ("Xm &n (xm &n): forward of m overlapped with the backward of n (F&B), the F's "
             "chunk 0 (>= 1)")
MAX_EXACT_CELLS = 120                                       # wider rows are quantized
_US_PER = {"unit": 1e3, "s": 1e6, "ms": 1e3, "us": 1.0}     # a simulated unit is 1 ms


def _label(a: Action | None, back: bool = False) -> str:
    """The 3-character cell of action `a` (or of idle time); an overlapped FB is "X" and
    its forward's micro-batch, or (back) "&" and its backward's."""
    if a is None:
        return IDLE.ljust(3)
    if a.kind == FB:
        f, b = a.parts()
        return f"&{b.micro_batch % 100}".ljust(3) if back else \
            f"{'X' if f.chunk == 0 else 'x'}{f.micro_batch % 100}".ljust(3)
    kind = a.kind if a.chunk == 0 else a.kind.lower()
    return f"{kind}{a.micro_batch % 100}".ljust(3)


def _labels(cells: list[Action | None]) -> str:
    """The row's cells as text; an FB's run of cells shows its F in the first half and
    its B ("&n") in the rest (a single cell: the F)."""
    out, i = [], 0
    while i < len(cells):
        j = i
        while j < len(cells) and cells[j] == cells[i]:
            j += 1
        out += [_label(cells[i], back=k - i >= max(1, (j - i + 1) // 2)) for k in range(i, j)]
        i = j
    return "".join(out)


def _grain(timeline: Timeline) -> int | None:
    """q such that every time is a whole multiple of 1/q time units (q <= 12), or None."""
    if timeline.time_unit != "unit":
        return None
    times = [t - timeline.origin for sl in timeline.slots() for t in (sl.start, sl.end)]
    for q in range(1, 13):
        if all(abs(t * q - round(t * q)) <= 1e-9 * max(1.0, abs(t * q)) for t in times):
            return q
    return None


def _cells(row: list[Slot], t0: float, dt: float, n: int) -> list[Action | None]:
    """For each of n cells [t0 + i dt, t0 + (i+1) dt): the action occupying most of it, or
    None where idle time is the largest share (ties go to the earlier action); then every
    action of the row is drawn, at least once and in order, when the row has n or fewer:

        1. each action (of nonzero length) gets an anchor cell, the cell of its midpoint,
           moved right past the previous action's anchor and left of the next one's
           (a measured timeline's quick F or W next to a long wait wins no cell by
           majority; under load, several can fall into one cell);
        2. an anchor shows its action; any other cell shows its majority action only if
           that lies between the anchors of the actions before and after it, else idle.

    Exact timelines (whole cells, unit costs) are drawn unchanged: there each midpoint
    cell is the action's own and already in order."""
    majority: list[int | None] = []
    for i in range(n):
        lo, hi = t0 + i * dt, t0 + (i + 1) * dt
        best, best_len, used = None, 0.0, 0.0
        for k, sl in enumerate(row):
            share = min(hi, sl.end) - max(lo, sl.start)
            if share > 0:
                used += share
                if share > best_len:
                    best, best_len = k, share
        majority.append(best if best_len >= dt - used else None)
    drawn = [k for k, sl in enumerate(row) if sl.end > sl.start]     # in time order
    if not 0 < len(drawn) <= n:                    # nothing to anchor, or too many to fit
        return [None if k is None else row[k].action for k in majority]
    cells = []                                     # 1. midpoint cells, pushed right ...
    for k in drawn:
        mid = int(((row[k].start + row[k].end) / 2 - t0) // dt)
        cells.append(max(min(n - 1, max(0, mid)), cells[-1] + 1 if cells else 0))
    for pos in range(len(cells) - 1, -1, -1):      # ... and pulled left to fit in n cells
        cells[pos] = min(cells[pos], n - 1 if pos == len(cells) - 1 else cells[pos + 1] - 1)
    anchor = dict(zip(drawn, cells))
    at = {cell: k for k, cell in anchor.items()}

    def in_order(k: int | None, cell: int) -> bool:
        """Action k may show in `cell`: right of the anchors before it, left of those after."""
        return k is not None and all(c < cell for d, c in anchor.items() if d < k) and \
            all(cell < c for d, c in anchor.items() if d > k)

    return [row[at[cell]].action if cell in at else      # 2. anchors, then majority
            row[k].action if in_order(k, cell) else None for cell, k in enumerate(majority)]


def _layout(timeline: Timeline, columns: int | None) -> tuple[float, int, str]:
    """(cell width dt, number of cells n, what a cell is) for `ascii`."""
    span = timeline.makespan
    q = _grain(timeline) if columns is None else None
    if q is not None and round(span * q) <= MAX_EXACT_CELLS:
        n = round(span * q)
        return 1 / q, n, "1 cell = 1 time unit" if q == 1 else f"1 cell = 1/{q} time unit"
    n = columns or 60
    if n < 1:
        raise ValueError(f"ascii: columns={columns}; need at least 1 cell.")
    dt = span / n if span else 1.0
    return dt, n, f"1 cell = {float(dt):.3g} {timeline.time_unit}"


def ascii(timeline: Timeline, columns: int | None = None) -> str:
    """The timeline as text: a header, one row per stage ("stage 0 |F0 F1 ...|"), a legend.
    See the module docstring for the cells; `columns` forces quantized time."""
    P = len(timeline.stages)
    dt, n, cell = _layout(timeline, columns)
    bubble = float(timeline.bubble_fraction())
    head = (f"{timeline.schedule_name or 'timeline'}: P={P}, M={timeline.micro_batches}"
            + (f", V={timeline.chunks}" if timeline.chunks > 1 else "")
            + f", bubble {100 * bubble:.1f}% ({cell})")
    width = len(str(max(P - 1, 0)))
    rows = [f"stage {s:>{width}} |"
            + _labels(_cells(row, timeline.origin, dt, n)) + "|"
            for s, row in enumerate(timeline.stages)]
    fb = [FB_LEGEND] if any(sl.action.kind == FB for sl in timeline.slots()) else []
    return "\n".join([head, *rows, LEGEND, *fb])


def side_by_side(a: Timeline, b: Timeline, titles: Sequence[str] = ("simulated", "measured"),
                 columns: int | None = None) -> str:
    """Two ASCII timelines stacked under their titles, each header with its bubble %, the
    same number of cells wide: when a has exact cells, b is quantized to as many."""
    n = _layout(a, columns)[1]
    return (f"== {titles[0]} ==\n{ascii(a, columns)}\n\n"
            f"== {titles[1]} ==\n{ascii(b, columns or n)}")


def _name(a: Action) -> str:
    if a.kind == FB:
        return " & ".join(_name(p) for p in a.parts())
    return f"{a.kind}{a.micro_batch}" + (f" (chunk {a.chunk})" if a.chunk else "")


def chrome_trace(timeline: Timeline, rank_of_stage: Sequence[int] | None = None) -> Trace:
    """A Trace with one row per stage (pid = rank_of_stage[s], default s) and one event per
    action: name "F3" / "B3 (chunk 1)", cat the kind, args {micro_batch, chunk}. Times
    start at 0; a simulated time unit becomes 1 ms, a recorded second 1 s."""
    if timeline.time_unit not in _US_PER:
        raise ValueError(f"chrome_trace: unknown time unit {timeline.time_unit!r}; "
                         f"known: {sorted(_US_PER)}.")
    scale, t0 = _US_PER[timeline.time_unit], timeline.origin
    ranks = list(rank_of_stage) if rank_of_stage is not None else list(range(len(
        timeline.stages)))
    if len(ranks) != len(timeline.stages):
        raise ValueError(f"chrome_trace: rank_of_stage has {len(ranks)} entries for "
                         f"{len(timeline.stages)} stages; give one rank per stage.")
    trace = Trace()
    for s, row in enumerate(timeline.stages):
        trace.label(ranks[s], f"stage {s} (rank {ranks[s]})")
        for sl in row:
            a = sl.action
            trace.add(_name(a), ranks[s], float(sl.start - t0) * scale,
                      float(sl.end - t0) * scale,
                      {"micro_batch": a.micro_batch, "chunk": a.chunk}
                      | ({"back_micro_batch": a.back_micro_batch, "back_chunk": a.back_chunk}
                         if a.kind == FB else {}), cat=a.kind)
    return trace


# --- PNG ----------------------------------------------------------------------------------

_COLOURS = {"F": (0.23, 0.47, 0.80), "B": (0.87, 0.45, 0.16), "W": (0.30, 0.65, 0.33)}


def _shade(kind: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """The kind's colour, mixed with white by chunk / (chunks + 1): later chunks lighter."""
    mix = chunk / (chunks + 1)
    return tuple(c + (1 - c) * mix for c in _COLOURS[kind])


def _gantt(ax, timeline: Timeline, title: str) -> None:
    P, t0 = len(timeline.stages), timeline.origin
    for s, row in enumerate(timeline.stages):
        for sl in row:
            a, x, w = sl.action, float(sl.start - t0), float(sl.duration)
            # an overlapped FB: two half-height bars, its F above its B, for the same time
            for p, y, h in (zip(a.parts(), (s - 0.2, s + 0.2), (0.4, 0.4)) if a.kind == FB
                            else [(a, s, 0.8)]):
                ax.barh(y, w, left=x, height=h, color=_shade(p.kind, p.chunk, timeline.chunks),
                        edgecolor="black", linewidth=0.4)
                if w > 0:
                    ax.text(x + w / 2, y, str(p.micro_batch), ha="center", va="center",
                            fontsize=7 if h > 0.5 else 6,
                            color="white" if p.chunk == 0 else "black")
    ax.set_yticks(range(P), [f"stage {s}" for s in range(P)])
    ax.set_ylim(P - 0.5, -0.5)                         # stage 0 on top
    ax.set_xlim(0, max(float(timeline.makespan), 1e-12))
    ax.set_xlabel("time (units)" if timeline.time_unit == "unit"
                  else f"time ({timeline.time_unit})")
    bubble = 100 * float(timeline.bubble_fraction())
    ax.set_title(f"{title or timeline.schedule_name or 'timeline'}: bubble {bubble:.1f}%")


def plot_png(timeline: Timeline, path: str | os.PathLike, title: str | None = None,
             compare: Timeline | None = None) -> str:
    """Write a Gantt chart of `timeline` (and of `compare` below it, e.g. simulated versus
    measured) to the PNG file `path`; return the path. Needs matplotlib."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.patches import Patch
    except ImportError:
        raise RuntimeError("plot_png needs matplotlib: pip install -e '.[plot]'") from None
    panels = [timeline] + ([compare] if compare is not None else [])
    height = sum(1.0 + 0.35 * len(tl.stages) for tl in panels)
    fig = Figure(figsize=(10, height + 0.6))
    FigureCanvasAgg(fig)                                # the Agg backend: no display needed
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for i, (ax, tl) in enumerate(zip(axes, panels)):
        _gantt(ax, tl, title if i == 0 else "")
    kinds = [k for k in _COLOURS if any(p.kind == k for tl in panels
                                        for sl in tl.slots() for p in sl.action.parts())]
    handles = [Patch(color=_COLOURS[k], label=k) for k in kinds]
    if max(tl.chunks for tl in panels) > 1:
        handles.append(Patch(color=_shade("F", 1, 2), label="lighter: chunk >= 1"))
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (height + 0.6)))    # room for the legend
    fig.savefig(os.fspath(path), format="png", dpi=100)
    return os.fspath(path)
