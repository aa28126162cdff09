"""Schedules as text: a pipeline schedule read from and written to torchtitan's CSV format.

A schedule is data (parallel/pipeline/schedules.py), so a user can write their own in a text file
and run it: `python -m minidist train --pp 2 --schedule my.csv`. The validator
(schedule_validate.py) proves it complete and free of deadlock before any process starts.

Format: one line per stage, comma-separated cells "{vstage}{kind}{micro_batch}",
    0F0,0F1,0B0,0B1        stage 0 of a 2-stage GPipe
    1F0,1F1,1B0,1B1        stage 1
where vstage is the virtual stage, kind is F, B or W; "0F4&1B1" is an overlapped forward
and backward (one FB action, DualPipe's F&B). A B is split (zero bubble) where its W is in
the file. The placement is read from the vstages: every vstage mod P equal to its line's
stage is the loop placement (vstage = chunk P + stage); lines s holding only s and
2P-1-s are the V placement (chunk 0 down, chunk 1 back up: 0F0 on line 0 ... then 3F0
on line 0 of a 2-stage V); lines s holding only s and P-1-s are the dual placement
(DualPipe: the first M/2 micro-batches flow up through chunk 0, the rest down through
chunk 1).
Blank lines, blank cells, spaces around cells and lines starting with "#" are ignored.
Reference: torchtitan / torch.distributed.pipelining's CSV schedules (one row per rank).
Read next: parallel/pipeline/schedule_validate.py.
"""

from __future__ import annotations

import re

from minidist.parallel.pipeline.schedules import KINDS, Action, PipelineSchedule, overlapped

_CELL = re.compile(r"(\d+)([A-Za-z]+)(\d+)")


def to_csv(schedule: PipelineSchedule) -> str:
    """The schedule as CSV text, one line per stage; from_csv reads it back."""
    def cell(s: int, a: Action) -> str:
        return "&".join(f"{schedule.vstage(s, p.chunk)}{p.kind}{p.micro_batch}"
                        for p in a.parts())
    return "".join(",".join(cell(s, a) for a in actions) + "\n"
                   for s, actions in enumerate(schedule.actions))


def _fits(placement: str, P: int, M: int, s: int, k: int, m: int) -> bool:
    """Can virtual stage k of micro-batch m be on stage s under `placement`? (Dual: P and
    M even, and m on its direction's chunk: the first M/2 on chunk 0, vstage s.)"""
    if placement == "loop":
        return k % P == s
    if placement == "v":
        return k in (s, 2 * P - 1 - s)
    return P % 2 == 0 and M % 2 == 0 and k == (s if m < M // 2 else P - 1 - s)


def from_csv(text: str, name: str = "custom") -> PipelineSchedule:
    """Read a schedule from CSV text. P = the number of stage lines, V = the chunks used,
    M = max micro-batch + 1; a B is split where its W is in the file. Column = the cell's
    place in its line, from 1. Check the result with schedule_validate.validate before
    running it."""
    lines = [(i, line) for i, line in enumerate(text.splitlines(), start=1)
             if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        raise ValueError(f"from_csv: {name!r} has no stage lines; write one line per stage "
                         "with cells like 0F0,0F1,0B0,0B1.")
    P, cells = len(lines), []                  # (where, stage, [(k, kind, m), ...])
    for s, (i, line) in enumerate(lines):
        for j, cell in enumerate(line.split(","), start=1):
            if not cell.strip():
                continue
            where = f"from_csv: line {i}, column {j} ({cell.strip()!r})"
            parts = [_CELL.fullmatch(p.strip()) for p in cell.split("&")]
            kinds = [p[2] if p else None for p in parts]
            if None in parts or any(k not in KINDS for k in kinds) or (
                    len(parts) > 1 and kinds != ["F", "B"]):
                raise ValueError(f"{where}: a cell is {{vstage}}{{kind}}{{micro_batch}} with "
                                 f"kind one of {KINDS}, e.g. 0F3 or 5B0, or an overlapped "
                                 "forward and backward, e.g. 0F4&1B1.")
            cells.append((where, s, [(int(p[1]), p[2], int(p[3])) for p in parts]))
    M = max((m for _, _, parts in cells for _, _, m in parts), default=0) + 1
    placement = next((pl for pl in ("loop", "v", "dual") if all(
        _fits(pl, P, M, s, k, m) for _, s, parts in cells for k, _, m in parts)), None)
    if placement is None:
        first = {pl: next(f"{where.removeprefix('from_csv: ')} is vstage {k} on stage {s}"
                          for where, s, parts in cells for k, _, m in parts
                          if not _fits(pl, P, M, s, k, m))
                 for pl in ("loop", "v", "dual")}
        raise ValueError(f"from_csv: {name!r}: no placement fits every cell (stage s holds "
                         f"vstages c P + s in the loop, s and 2P-1-s in the V, s and P-1-s "
                         f"in the dual placement, P and M even, s for the first M/2 "
                         f"micro-batches; P = {P} lines, M = {M}). Not the loop: "
                         f"{first['loop']}; not the V: {first['v']}; not dual: "
                         f"{first['dual']}. Move the cells to their stages' lines.")
    rows: list[list[Action]] = [[] for _ in range(P)]
    for _, s, parts in cells:
        acts = [Action(kind, m, k // P if placement == "loop" else
                       (0 if k == s else 1)) for k, kind, m in parts]
        rows[s].append(acts[0] if len(acts) == 1 else overlapped(*acts))
    flat = [part for row in rows for a in row for part in a.parts()]
    return PipelineSchedule(name, P, M, tuple(map(tuple, rows)),
                            chunks=max((a.chunk for a in flat), default=0) + 1,
                            placement=placement)
