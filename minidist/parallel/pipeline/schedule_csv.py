"""Schedules as text: a pipeline schedule read from and written to torchtitan's CSV format.

A schedule is data (parallel/pipeline/schedules.py), so a user can write their own in a text file
and run it: `python -m minidist train --pp 2 --schedule my.csv`. The validator
(schedule_validate.py) proves it complete and free of deadlock before any process starts.

Format: one line per stage, comma-separated cells "{vstage}{kind}{micro_batch}",
    0F0,0F1,0B0,0B1        stage 0 of a 2-stage GPipe
    1F0,1F1,1B0,1B1        stage 1
where vstage is the virtual stage, kind is F, B or W. The placement is read from the
vstages: every vstage mod P equal to its line's stage is the loop placement (vstage =
chunk P + stage); on a line s holding only s and 2P-1-s it is the V placement (chunk 0
down, chunk 1 back up: 0F0 on line 0 ... then 3F0 on line 0 of a 2-stage V).
Blank lines, blank cells, spaces around cells and lines starting with "#" are ignored.
Reference: torchtitan / torch.distributed.pipelining's CSV schedules (one row per rank).
Read next: parallel/pipeline/schedule_validate.py.
"""

from __future__ import annotations

import re

from minidist.parallel.pipeline.schedules import KINDS, Action, PipelineSchedule, place_of

_CELL = re.compile(r"(\d+)([A-Za-z]+)(\d+)")


def to_csv(schedule: PipelineSchedule) -> str:
    """The schedule as CSV text, one line per stage; from_csv reads it back."""
    return "".join(",".join(f"{schedule.vstage(s, a.chunk)}{a.kind}{a.micro_batch}"
                            for a in actions) + "\n"
                   for s, actions in enumerate(schedule.actions))


def from_csv(text: str, name: str = "custom") -> PipelineSchedule:
    """Read a schedule from CSV text. P = the number of stage lines, V = the chunks used,
    M = max micro-batch + 1, split_backward = any W. Column = the cell's place in its line,
    from 1. Check the result with schedule_validate.validate before running it."""
    lines = [(i, line) for i, line in enumerate(text.splitlines(), start=1)
             if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        raise ValueError(f"from_csv: {name!r} has no stage lines; write one line per stage "
                         "with cells like 0F0,0F1,0B0,0B1.")
    P, actions = len(lines), []
    for s, (i, line) in enumerate(lines):
        actions.append([])
        for j, cell in enumerate(line.split(","), start=1):
            if not cell.strip():
                continue
            where = f"from_csv: line {i}, column {j} ({cell.strip()!r})"
            match = _CELL.fullmatch(cell.strip())
            if match is None or match[2] not in KINDS:
                raise ValueError(f"{where}: a cell is {{vstage}}{{kind}}{{micro_batch}} with "
                                 f"kind one of {KINDS}, e.g. 0F3 or 5B0.")
            actions[s].append((where, int(match[1]), match[2], int(match[3])))
    cells = [c for line in actions for c in line]
    placement = "loop" if all(k % P == s for s, line in enumerate(actions)
                              for _, k, _, _ in line) else "v"
    for s, line in enumerate(actions):
        for where, k, _, _ in line:
            if placement == "v" and k not in (s, 2 * P - 1 - s):
                raise ValueError(
                    f"{where}: virtual stage {k} cannot be on stage {s}: in the loop "
                    f"placement it runs on stage {k % P} (vstage mod P, P = {P} lines), in "
                    f"the V placement on stage {min(k, 2 * P - 1 - k)}; move the cell, or "
                    "keep every line to one placement.")
    rows = tuple(tuple(Action(kind, m, place_of(placement, P, k)[1])
                       for _, k, kind, m in line) for line in actions)
    return PipelineSchedule(
        name, P, max((m for *_, m in cells), default=0) + 1, rows,
        chunks=max((a.chunk for row in rows for a in row), default=0) + 1,
        split_backward=any(kind == "W" for _, _, kind, _ in cells), placement=placement)
