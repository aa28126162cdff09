"""Schedules as text: a pipeline schedule read from and written to torchtitan's CSV format.

A schedule is data (parallel/pipeline/schedules.py), so a user can write their own in a text file
and run it: `python -m minidist train --pp 2 --schedule my.csv`. The validator
(schedule_validate.py) proves it complete and free of deadlock before any process starts.

Format: one line per stage, comma-separated cells "{vstage}{kind}{micro_batch}",
    0F0,0F1,0B0,0B1        stage 0 of a 2-stage GPipe
    1F0,1F1,1B0,1B1        stage 1
where vstage = chunk P + stage (so vstage mod P = the line's stage), kind is F, B or W.
Blank lines, blank cells, spaces around cells and lines starting with "#" are ignored.
Reference: torchtitan / torch.distributed.pipelining's CSV schedules (one row per rank).
Read next: parallel/pipeline/schedule_validate.py.
"""

from __future__ import annotations

import re

from minidist.parallel.pipeline.schedules import KINDS, Action, PipelineSchedule

_CELL = re.compile(r"(\d+)([A-Za-z]+)(\d+)")


def to_csv(schedule: PipelineSchedule) -> str:
    """The schedule as CSV text, one line per stage; from_csv reads it back."""
    return "".join(",".join(f"{schedule.vstage(s, a.chunk)}{a.kind}{a.micro_batch}"
                            for a in actions) + "\n"
                   for s, actions in enumerate(schedule.actions))


def from_csv(text: str, name: str = "custom") -> PipelineSchedule:
    """Read a schedule from CSV text. P = the number of stage lines, V = max vstage // P + 1,
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
            k, kind, m = int(match[1]), match[2], int(match[3])
            if k % P != s:
                raise ValueError(f"{where}: virtual stage {k} runs on stage {k % P} "
                                 f"(vstage mod P, P = {P} lines), but this line is stage {s}; "
                                 f"move the cell to stage {k % P}'s line.")
            actions[s].append(Action(kind, m, k // P))
    cells = [a for line in actions for a in line]
    return PipelineSchedule(
        name, P, max((a.micro_batch for a in cells), default=0) + 1,
        tuple(map(tuple, actions)), chunks=max((a.chunk for a in cells), default=0) + 1,
        split_backward=any(a.kind == "W" for a in cells))
