"""Stragglers: one rank is slow, not dead; the job names it, then gives its replica fewer rows.

What you will see: a small GPT (float64) trained on 2 ranks (dp=2) where rank 1 is a slow
device from step 2 on: it sleeps X seconds per row of its batch as every forward begins
(--inject slow:...:per_row=X), several times its compute. Run twice. With --straggler
detect, rank 0 names rank 1 after 3 slow steps (compute, not wall time: rank 0's wall time
includes waiting for rank 1). With --straggler rebalance, every 5 steps the rows of the
global batch move towards the faster replica, rank 1 ends with few rows and the step gets
shorter again (the wall times are printed as information, never checked). Both runs use
--check: moving rows changes only how the gradient sum is grouped, so each run matches the
single-process run within rounding, not bitwise.

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

from minidist.cli import CliParser, like

# --- settings (each can be overridden on the command line) ---
STEPS, PER_ROW, SLOW_STEP, BATCH, SEED = 15, 0.004, 2, 64, 0
SHOW = ("step", "[rank", "straggler:", "OK:", "MISMATCH")


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    for name, value in dict(steps=STEPS, per_row=PER_ROW, slow_step=SLOW_STEP, batch=BATCH,
                            seed=SEED).items():
        ap.add_argument("--" + name.replace("_", "-"), type=like(value, name), default=value)
    a = ap.parse_args(argv)
    if a.steps < a.slow_step + 10 or a.per_row <= 0 or a.batch % 2 or a.batch < 4:
        ap.error("need --steps >= --slow-step + 10 (3 steps to detect, 5 per rebalance), "
                 "--per-row > 0 and an even --batch >= 4")
    return a


def train(a, mode: str, cwd: str) -> tuple[int, list[str]]:
    """Run `python -m minidist train` in `cwd` as a user types it and print its lines that
    start with one of SHOW; return (exit code, those lines)."""
    argv = ["train", "--dp", "2", "--dtype", "float64", "--n-layer", "2", "--n-embd", "64",
            "--n-head", "2", "--batch", str(a.batch), "--steps", str(a.steps), "--every", "5",
            "--seed", str(a.seed), "--inject",
            f"slow:rank=1:step={a.slow_step}:per_row={a.per_row:g}", "--straggler", mode,
            "--check"]
    print("$ python -m minidist " + " ".join(argv))
    done = subprocess.run([sys.executable, "-m", "minidist", *argv], cwd=cwd, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith(SHOW)]
    print("\n".join(f"  | {line}" for line in lines))
    return done.returncode, lines


def read(out: list[str]) -> dict:
    """What a run's lines say: the rank named a straggler, the rows of each dp rank before
    the first and after the last move, the --check verdict, the last step line's seconds."""
    named = [int(m[1]) for x in out if (m := re.match(r"straggler: rank (\d+) computes", x))]
    moves = [re.match(r"straggler: rows per dp rank \(([\d, ]+)\) -> \(([\d, ]+)\)", x)
             for x in out]
    moves = [[tuple(int(v) for v in m[i].split(",")) for i in (1, 2)] for m in moves if m]
    wall = [float(m[1]) for x in out      # observe/progress.py: "step N | loss L | S s | ..."
            if (m := re.match(r"step +\d+ \| loss \S+ \|\s+([\d.]+) s \|", x))]
    return dict(named=named, first=moves[0][0] if moves else None,
                last=moves[-1][1] if moves else None, wall=wall[-1] if wall else float("nan"),
                verdict=next((x for x in out if x.startswith(("OK:", "MISMATCH"))), "none"))


def main(argv=None) -> int:
    a = parse_args(argv)
    print(f"demo 18 · straggler · dp=2 float64, {a.steps} steps, rank 1 slow by {a.per_row:g} s "
          f"per row from step {a.slow_step}: detect, rebalance")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="minidist-demo18-") as tmp:
        for i, mode in enumerate(("detect", "rebalance"), start=1):
            print(f"\n== {i}. --straggler {mode} ==")
            rc, out = train(a, mode, tmp)
            runs[mode] = dict(rc=rc, **read(out))
    det, reb = runs["detect"], runs["rebalance"]

    print("\n== 3. the lines, read ==")
    print(f"  detect:    rank(s) named {det['named']}: rank 1's compute (forward + backward) is"
          " many times")
    print("             rank 0's; rank 0's wall time is as long, but it is spent waiting")
    print(f"  rebalance: rows per dp rank {reb['first']} -> {reb['last']}: rows go where they "
          "are processed fastest,")
    print("             in several moves, each made only while it predicts a step >= 10 % "
          "faster")
    print(f"  wall time of the run (last step line, information only): detect "
          f"{det['wall']:.1f} s, rebalance {reb['wall']:.1f} s")
    print("             the slow device's delay is per row, so the fewer rows it gets, the "
          "shorter")
    print("             its steps (a fixed delay per step, seconds=, no rebalancing wins back)")

    print("\n== 4. the --check verdicts: each run vs the single-process run ==")
    for mode, run in runs.items():
        m = re.search(r"final params max \|Δ\| = (\S+?)\)", run["verdict"])
        print(f"  {mode:<9}  final params max |Δ| = {m[1] if m else 'none'}")
    print("  Every micro-batch loss is divided by the global token count, so any split of the")
    print("  rows sums to the same gradient, grouped differently: equal within rounding.")

    moved = reb["first"] is not None and reb["last"][1] < reb["first"][1]
    ok = (det["rc"] == 0 and reb["rc"] == 0 and 1 in det["named"] and 1 in reb["named"]
          and moved and det["verdict"].startswith("OK:") and reb["verdict"].startswith("OK:"))
    if not ok:
        print(f"MISMATCH: exit codes {det['rc']}, {reb['rc']}; named {det['named']}, "
              f"{reb['named']}; rows {reb['first']} -> {reb['last']}; verdicts "
              f"{det['verdict']!r}, {reb['verdict']!r}")
        return 1
    print(f"OK: rank 1 named in both runs; rebalance moved rows {reb['first']} -> "
          f"{reb['last']}; both match 1 process")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
