"""Stragglers: one rank is slow, not dead; the job names it, then gives its replica fewer rows.

What you will see: a small GPT (float64) trained on 2 ranks (dp=2) where rank 1 is a slow
device from step 2 on: it sleeps X seconds per row of its batch as every forward begins
(--inject slow:...:per_row=X), several times its compute. Run twice. With --straggler
detect, rank 0 names rank 1 after 3 slow steps (compute, not wall time: rank 0's wall time
includes waiting for rank 1). With --straggler rebalance, every 5 steps the rows of the
global batch move towards the faster replica, rank 1 ends with few rows and the step gets
shorter again. Both runs use --check: moving rows changes only how the gradient sum is
grouped, so each run matches the single-process run within rounding, not bitwise.

What is timed (compute per rank, seconds per step) depends on the machine and its load: the
demo prints what it measured. Its verdict needs rank 1 named in both runs, its rows moved
away and both --check verdicts OK; the seconds per step are information, never checked.

Run:       python demos/18_straggler.py [--steps 15 --per-row 0.004 --batch 64]
Read with: minidist/reliability/straggler.py, minidist/reliability/faults.py
Paper:     FALCON (Wu et al. 2024, arXiv:2410.12588); Dubey et al. 2024, "The Llama 3 Herd
           of Models", arXiv:2407.21783, Sec. 3.3.4
"""

import argparse
import re
import subprocess
import sys
import tempfile
import textwrap

from minidist.cli import CliParser, shell_command
from minidist.reliability.straggler import FACTOR, MIN_GAIN, PATIENCE

# --- settings (each can be overridden on the command line) ---
STEPS, PER_ROW, SLOW_STEP, BATCH, SEED = 15, 0.004, 2, 64, 0
SHOW = ("step", "[rank", "straggler:", "OK:", "MISMATCH")
# each number option's (low, high): the demo stays small
LIMITS = dict(steps=(10, 99), per_row=(0.0001, 0.1), slow_step=(0, 89), batch=(4, 128),
              seed=(0, 2 ** 32))
WIDTH = 100                                    # characters a line
STEP = re.compile(r"step +(\d+) \| loss \S+ \| +([\d.]+) s \|")   # progress.py's line


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(steps=STEPS, per_row=PER_ROW, slow_step=SLOW_STEP, batch=BATCH,
                        seed=SEED), LIMITS)
    a = ap.parse_args(argv)
    if a.steps < a.slow_step + 10 or a.batch % 2:
        ap.error("need --steps >= --slow-step + 10 (3 steps to detect, 5 per rebalance) and "
                 "an even --batch")
    return a


def echo(line: str) -> str:
    """A line of train's output as shown here, after "  | ": a step line cut to `step N |
    loss X | T s | comm C%` (T: seconds since the start; comm: the share of the step the
    ranks spent waiting for each other), any other line wrapped at WIDTH."""
    if line.startswith("step "):
        fields = line.split(" | ")
        line = " | ".join(fields[:3] + [f for f in fields if f.startswith("comm ")])
    return textwrap.fill(line, WIDTH, initial_indent="  | ", subsequent_indent="  |     ")


def train(a, mode: str, cwd: str) -> tuple[int, list[str]]:
    """Run `python -m minidist train` in `cwd` as a user types it and print its lines that
    start with one of SHOW; return (exit code, those lines)."""
    argv = ["train", "--dp", "2", "--dtype", "float64", "--n-layer", "2", "--n-embd", "64",
            "--n-head", "2", "--batch", str(a.batch), "--steps", str(a.steps), "--every", "5",
            "--seed", str(a.seed), "--inject",
            f"slow:rank=1:step={a.slow_step}:per_row={a.per_row:g}", "--straggler", mode,
            "--check"]
    print(shell_command(argv, WIDTH))
    done = subprocess.run([sys.executable, "-m", "minidist", *argv], cwd=cwd, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith(SHOW)]
    print("\n".join(map(echo, lines)))
    return done.returncode, lines


def read(out: list[str]) -> dict:
    """What a run's lines say: the ranks named stragglers and their measured compute ("2.7x
    the median (195 ms vs 72 ms)"), the moves of rows, the seconds per step between the last
    two step lines (their `T s` fields: seconds since the start), the last comm share and
    the --check verdict."""
    named = []
    for x in out:
        m = re.match(r"straggler: rank (\d+) computes (\S+) the median .*\(compute (.*)\)$", x)
        if m:
            named.append((int(m[1]), f"{m[2]} the others' median ({m[3]})"))
    moves = [re.match(r"straggler: rows per dp rank \(([\d, ]+)\) -> \(([\d, ]+)\)", x)
             for x in out]
    moves = [[tuple(int(v) for v in m[i].split(",")) for i in (1, 2)] for m in moves if m]
    steps = [(int(m[1]), float(m[2])) for x in out if (m := STEP.match(x))]
    (s0, t0), (s1, t1) = steps[-2:] if len(steps) > 1 else [(0, 0.0), (0, 0.0)]
    comm = [m[1] for x in out if x.startswith("step ") and (m := re.search(r"comm (\d+)%", x))]
    return dict(named=named, moves=len(moves), first=moves[0][0] if moves else None,
                last=moves[-1][1] if moves else None, window=(s0, s1),
                per_step=(t1 - t0) / (s1 - s0) if s1 > s0 else None,
                comm=comm[-1] if comm else None,
                verdict=next((x for x in out if x.startswith(("OK:", "MISMATCH"))), "none"))


def main(argv=None) -> int:
    a = parse_args(argv)
    print(f"demo 18 · straggler · dp=2 float64, {a.steps} steps, rank 1 slow by {a.per_row:g} s "
          f"per row from step {a.slow_step}\n--straggler detect, then rebalance · train's lines "
          "after '  | ', step lines cut")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="minidist-demo18-") as tmp:
        for i, mode in enumerate(("detect", "rebalance"), start=1):
            print(f"\n== {i}. --straggler {mode} ==")
            rc, out = train(a, mode, tmp)
            runs[mode] = dict(rc=rc, **read(out))
    det, reb = runs["detect"], runs["rebalance"]

    print("\n== 3. the lines, read: what was timed on this machine (it varies with its load) ==")
    para = dict(width=WIDTH, subsequent_indent=" " * 13)
    for r, what in det["named"] or [(None, None)]:
        print(f"  detect:    rank {r} named: its compute was {what}" if r is not None else
              f"  detect:    no rank named: no rank's compute stayed {FACTOR}x the others' for "
              f"{PATIENCE} steps")
    print(textwrap.fill("             a fast rank waits for the slow one in every all-reduce: "
                        "the comm column (the ranks' mean share of a step spent waiting) read "
                        f"{det['comm']}% at step {det['window'][1]}", **para))
    if reb["moves"]:
        print(textwrap.fill(f"  rebalance: rows per dp rank {reb['first']} -> {reb['last']} in "
                            f"{reb['moves']} move(s): rows go where they are processed fastest,"
                            " each move made only while it predicts a step >= "
                            f"{MIN_GAIN:.0%} faster",
                            **para))
    else:
        print(f"  rebalance: no move: the timings never predicted a step >= {MIN_GAIN:.0%} "
              "faster")
    x, y, (s0, s1) = det["per_step"], reb["per_step"], det["window"]
    if x is not None and y is not None:
        print(textwrap.fill(
            f"  per step:  {x:.3f} s with detect, {y:.3f} s with rebalance, from step {s0} to "
            f"step {s1} (the step lines' seconds): rebalance's steps were "
            f"{'shorter' if y < x else 'not shorter'} on this run. The slow device's delay is "
            "per row, so the fewer rows it gets, the shorter its steps (a fixed delay per step, "
            "seconds=, no rebalancing wins back)", **para))

    print("\n== 4. the --check verdicts: each run vs the single-process run ==")
    for mode, run in runs.items():
        m = re.search(r"final params max \|Δ\| = (\S+?)\)", run["verdict"])
        print(f"  {mode:<9}  final params max |Δ| = {m[1] if m else 'none'}")
    print("  Every micro-batch loss is divided by the global token count, so any split of the")
    print("  rows sums to the same gradient, grouped differently: equal within rounding.")

    named = [sorted({r for r, _ in run["named"]}) for run in (det, reb)]
    moved = reb["moves"] > 0 and reb["last"][1] < reb["first"][1]
    ok = (det["rc"] == 0 and reb["rc"] == 0 and all(1 in n for n in named) and moved
          and det["verdict"].startswith("OK:") and reb["verdict"].startswith("OK:"))
    if not ok:
        print(f"MISMATCH: exit codes {det['rc']}, {reb['rc']}; named {named[0]}, {named[1]}; "
              f"rows {reb['first']} -> {reb['last']}; --check verdicts {det['verdict']!r}, "
              f"{reb['verdict']!r}")
        return 1
    print(f"OK: rank 1 named in both runs; rebalance moved rows {reb['first']} -> "
          f"{reb['last']}; both match 1 process")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
