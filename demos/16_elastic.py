"""Elastic training: a replica is lost for good; the job goes on with dp=3, then grows back.

What you will see: a tiny GPT (float64) trained on 4 ranks (dp=4), rank 3 SIGKILLed at the
start of step 5, a checkpoint every 2 steps, --elastic --rejoin-after 3 --max-restarts 2 and
--check. The launcher's lines say what failed, that the job continues on dp=3 from the latest
checkpoint keeping the global batch (4 rows per replica instead of 3), and that 3 steps later
capacity is back and the job grows to dp=4 again. --check then compares the whole run with
the single-process run: equal within rounding, not bitwise, because only the grouping of the
gradient sum changed.

Run:       python demos/16_elastic.py [--steps 12 --every 2 --kill-step 5 --rejoin-after 3]
Read with: minidist/reliability/elastic.py, minidist/reliability/recovery.py,
           minidist/reliability/checkpoint.py
Paper:     TorchElastic (torchrun --nnodes MIN:MAX); Dubey et al. 2024, "The Llama 3 Herd
           of Models", arXiv:2407.21783, Sec. 3.3.4
"""

import argparse
import re
import subprocess
import sys
import tempfile

from minidist.cli import CliParser, echo, shell_command

# --- settings (each can be overridden on the command line) ---
STEPS, EVERY, KILL_STEP, KILL_RANK, REJOIN_AFTER, BATCH, SEED = 12, 2, 5, 3, 3, 12, 0
SHOW = ("no checkpoint", "[rank", "recovery:", "elastic:", "resuming", "OK:", "MISMATCH")
# each number option's (low, high): the demo stays small (--kill-rank: 4 ranks)
LIMITS = dict(steps=(1, 99), every=(1, 99), kill_step=(0, 98), kill_rank=(0, 3),
              rejoin_after=(1, 99), batch=(12, 96), seed=(0, 2 ** 32))
WIDTH = 100                                    # characters a line


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(steps=STEPS, every=EVERY, kill_step=KILL_STEP, kill_rank=KILL_RANK,
                        rejoin_after=REJOIN_AFTER, batch=BATCH, seed=SEED), LIMITS)
    a = ap.parse_args(argv)
    if a.kill_step >= a.steps or a.batch % 12:
        ap.error("need --kill-step < --steps and --batch a multiple of 12 (split over dp=4 and "
                 "dp=3)")
    return a


def train(a, cwd: str) -> tuple[int, list[str]]:
    """Run `python -m minidist train` in `cwd` as a user types it and print its lines that
    start with one of SHOW; return (exit code, those lines)."""
    argv = ["train", "--dp", "4", "--dtype", "float64", "--n-layer", "1", "--n-embd", "16",
            "--n-head", "2", "--batch", str(a.batch), "--steps", str(a.steps), "--seed",
            str(a.seed), "--checkpoint-dir", "ck", "--checkpoint-every", str(a.every),
            "--max-restarts", "2", "--elastic", "--rejoin-after", str(a.rejoin_after),
            "--inject", f"sigkill:rank={a.kill_rank}:step={a.kill_step}", "--check"]
    print(shell_command(argv, WIDTH))
    done = subprocess.run([sys.executable, "-m", "minidist", *argv], cwd=cwd, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith(SHOW)]
    print("\n".join(echo(line, WIDTH) for line in lines))
    return done.returncode, lines


def main(argv=None) -> int:
    a = parse_args(argv)
    saved = a.kill_step // a.every * a.every          # steps done at the latest checkpoint
    print(f"demo 16 · elastic · dp=4 float64, {a.steps} steps: rank {a.kill_rank} SIGKILLed at "
          f"step {a.kill_step}\n--elastic --rejoin-after {a.rejoin_after}, checked vs 1 process "
          "· train's lines after '  | '")
    with tempfile.TemporaryDirectory(prefix="minidist-demo16-") as tmp:
        print(f"\n== 1. dp=4, rank {a.kill_rank} killed at step {a.kill_step}; its machine "
              f"does not come back for {a.rejoin_after} steps ==")
        rc, out = train(a, tmp)
    shrink = next((x for x in out if x.startswith("elastic: a replica is lost")), None)
    grow = next((x for x in out if x.startswith("elastic: capacity is back")), None)
    verdict = next((x for x in out if x.startswith(("OK:", "MISMATCH"))), "none")

    print("\n== 2. the launcher's lines, read ==")
    print(f"  what failed: rank {a.kill_rank} of 4 died (SIGKILL); the launcher stopped the "
          "other ranks")
    print(f"  shrink:      no spare machine, so the job goes on with 3 replicas from "
          f"ck/step{saved:08d};")
    print(f"               the global batch stays {a.batch}: {a.batch // 3} rows per replica "
          f"instead of {a.batch // 4}")
    stop = min(a.steps, saved + a.rejoin_after)
    print(f"  grow:        at step {stop} the dp=3 job saves a checkpoint and stops;")
    print("               the dp=4 job loads it and runs to the end")

    print("\n== 3. the --check verdict: the whole run vs the single-process run ==")
    m = re.search(r"final params max \|Δ\| = (\S+?)\)", verdict)
    bitwise = m is not None and float(m[1]) == 0.0
    print(f"  final params max |Δ| = {m[1] if m else 'none'}: equal within rounding, "
          f"{'and even bitwise' if bitwise else 'not bitwise'}.")
    print("  Each step still sums the same per-token gradient terms over the same global batch;")
    print("  on dp=3 they are grouped into other per-rank partial sums, so the last bits can "
          "differ.")

    ok = rc == 0 and shrink is not None and grow is not None and verdict.startswith("OK:")
    if not ok:
        print(f"MISMATCH: exit code {rc}; shrink line {shrink is not None}, grow line "
              f"{grow is not None}; verdict {verdict!r}")
        return 1
    print(f"OK: rank {a.kill_rank} lost, dp=4 -> 3 -> 4 with the global batch kept; matches 1 "
          f"process (max |Δ| = {m[1] if m else '?'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
