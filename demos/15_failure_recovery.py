"""Failure recovery: a rank is SIGKILLed mid-run; all ranks restart from the latest checkpoint.

What you will see: a tiny GPT trained on 2 ranks (dp=2, ZeRO-1) twice: once without a fault,
once with rank 1 SIGKILLed at the start of step 6, a checkpoint every 4 steps and
--max-restarts 2. The launcher's recovery lines say what failed, the checkpoint it resumes
from and the steps lost (run again); the steps run twice give the same losses; and the two
runs' params sha256, side by side, are equal: the recovered run is the uninterrupted one, bit
for bit (float32), because the checkpoint holds the whole global state and every step's data
is addressed by its global step index.

Run:       python demos/15_failure_recovery.py [--steps 10 --every 4 --kill-step 6]
           (or python -m minidist demo failure_recovery)
Read with: minidist/reliability/recovery.py, minidist/reliability/faults.py,
           minidist/reliability/checkpoint.py
Paper:     Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, Sec. 3.3.4
           (466 job interruptions in 54 days); torchrun's --max-restarts
"""

import argparse
import re
import subprocess
import sys
import tempfile
import textwrap

from minidist.cli import CliParser, echo, shell_command

# --- settings (each can be overridden on the command line) ---
STEPS, EVERY, KILL_STEP, KILL_RANK, BATCH, SEED = 10, 4, 6, 1, 8, 0
SHOW = ("step", "no checkpoint", "resuming", "recovery:", "[rank", "params sha256")
# each number option's (low, high): the demo stays small (--kill-rank: 2 ranks)
LIMITS = dict(steps=(1, 99), every=(1, 99), kill_step=(0, 98), kill_rank=(0, 1),
              batch=(2, 64), seed=(0, 2 ** 32))
WIDTH = 100                                      # characters a line


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(steps=STEPS, every=EVERY, kill_step=KILL_STEP, kill_rank=KILL_RANK,
                        batch=BATCH, seed=SEED), LIMITS)
    a = ap.parse_args(argv)
    if a.kill_step >= a.steps or a.batch % 2:
        ap.error("need --kill-step < --steps and an even --batch (2 ranks)")
    return a


def train(a, cwd: str, *options: str) -> tuple[int, list[str]]:
    """Run `python -m minidist train` in `cwd` as a user types it and print its lines that
    start with one of SHOW; return (exit code, those lines)."""
    argv = ["train", "--dp", "2", "--zero", "1", "--steps", str(a.steps), "--batch",
            str(a.batch), "--seed", str(a.seed), "--every", "1", *options]
    print(shell_command(argv, WIDTH))
    done = subprocess.run([sys.executable, "-m", "minidist", *argv], cwd=cwd, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith(SHOW)]
    print("\n".join(echo(line, WIDTH) for line in lines))
    return done.returncode, lines


def losses(lines: list[str]) -> list[tuple[int, str]]:
    """(step, printed loss) of every step line, in the order printed."""
    return [(int(m[1]), m[2]) for m in (re.match(r"step +(\d+) \| loss (\S+)", x) for x in lines)
            if m]


def main(argv=None) -> int:
    a = parse_args(argv)
    saved = a.kill_step // a.every * a.every          # steps done at the latest checkpoint
    print(f"demo 15 · failure recovery · dp=2 ZeRO-1, {a.steps} steps: rank {a.kill_rank} "
          f"SIGKILLed at step {a.kill_step}\na checkpoint every {a.every}, --max-restarts 2 · "
          "train's lines after '  | ', step lines cut")
    with tempfile.TemporaryDirectory(prefix="minidist-demo15-") as tmp:
        print("\n== 1. the uninterrupted run (no checkpoints, no faults): the reference ==")
        rc_ref, ref = train(a, tmp)
        print(f"\n== 2. the same run, rank {a.kill_rank} killed by SIGKILL (as by the OOM "
              f"killer) at the start of step {a.kill_step} ==")
        rc_rec, rec = train(a, tmp, "--checkpoint-dir", "ck", "--checkpoint-every",
                            str(a.every), "--max-restarts", "2",
                            "--inject", f"sigkill:rank={a.kill_rank}:step={a.kill_step}")
    log = [line for line in rec if line.startswith("recovery:")]
    print("\nthe launcher's recovery lines, read:")
    print(f"  what failed:  rank {a.kill_rank} of 2; its process died without a word,\n"
          "                the launcher saw it and stopped the other rank")
    if saved:
        print(f"  resumed from: ck/step{saved:08d}, the latest complete checkpoint ({saved} "
              f"steps done),\n                on all ranks, after a 0.5 s backoff")
    else:
        print("  resumed from: step 0: no checkpoint had been written yet")
    lost = f"steps {saved}..{a.kill_step - 1}" if a.kill_step > saved else "none"
    print(f"  lost:         {lost}: done since that point, gone with the processes' memory,\n"
          f"                run again (at most {a.every}: --checkpoint-every)")
    seen: dict[int, list[str]] = {}
    for s, x in losses(rec):
        seen.setdefault(s, []).append(x)
    redo = {s: xs for s, xs in seen.items() if len(xs) == 2}
    print(textwrap.fill("steps run twice, losses before | after the restart: " + (", ".join(
        f"step {s}: {x} | {y}" for s, (x, y) in redo.items()) or "none"), WIDTH,
        subsequent_indent="  "))
    want = (f"steps {saved}..{a.kill_step - 1} are lost and run again" if a.kill_step > saved
            else "")
    d_ref, d_rec = (next((x.split()[-1] for x in out if x.startswith("params sha256")), "none")
                    for out in (ref, rec))
    print(f"\nparams sha256, uninterrupted: {d_ref}\nparams sha256, recovered:     {d_rec}")
    ok = (rc_ref == rc_rec == 0 and d_ref == d_rec != "none" and len(log) == 2
          and want in log[1] and all(x == y for x, y in redo.values()))
    if not ok:
        print(f"MISMATCH: exit codes {rc_ref}, {rc_rec}; recovery lines {log}; digests differ: "
              f"{d_ref != d_rec}")
        return 1
    print(f"OK: rank {a.kill_rank} SIGKILLed at step {a.kill_step}, resumed from step {saved} "
          "after 1 restart; same params sha256 as run 1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
