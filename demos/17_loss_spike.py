"""Loss spikes: one NaN in one rank's gradients, and the four things a run can do about it.

What you will see: a tiny GPT (float64) trained on 2 ranks (dp=2) for 24 steps, with a NaN
injected into rank 0's gradients at step 15, run once per --spike policy. The spike lines
each policy logs are echoed; a table puts side by side the loss at steps 14-16 and at the
last step. detect lets the NaN through: the all-reduce spreads it to every rank and the run
is ruined. skip drops that one update. rerun computes the step again, finds it normal (the
fault was transient) and ends bitwise equal to a clean run. rollback restarts from the
latest checkpoint with the data moved on, as PaLM did.

Run:       python demos/17_loss_spike.py [--steps 24 --nan-step 15]
Read with: minidist/reliability/spike.py, minidist/reliability/recovery.py,
           minidist/reliability/faults.py
Paper:     Chowdhery et al. 2022, "PaLM", arXiv:2204.02311, Sec. 5.1 (rollback, skip
           200-500 batches); Megatron-LM's re-run state machine (rerun)
"""

import argparse
import math
import re
import subprocess
import sys
import tempfile

from minidist.cli import CliParser, echo, shell_command

# --- settings (each can be overridden on the command line) ---
STEPS, NAN_STEP, CKPT_EVERY, BATCH, SEED = 24, 15, 4, 8, 0
SHOW = ("spike", "recovery:", "resuming", "params sha256")
POLICIES = {  # policy: what it does, in one line
    "detect": "log the spike, apply the update anyway: NaN params on every rank, for good",
    "skip": "zero the spiking step's gradients: no update, optimizer untouched; go on",
    "rerun": "compute the step again on the same batch; normal now: a transient fault, apply",
    "rollback": "stop all ranks, restart from the latest checkpoint, data moved on 5 batches",
}


# each number option's (low, high): the demo stays small (a checkpoint before the NaN)
LIMITS = dict(steps=(6, 99), nan_step=(CKPT_EVERY, 97), batch=(2, 64), seed=(0, 2 ** 32))
WIDTH = 100                                    # characters a line


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(steps=STEPS, nan_step=NAN_STEP, batch=BATCH, seed=SEED), LIMITS)
    a = ap.parse_args(argv)
    if a.nan_step >= a.steps - 1 or a.batch % 2:
        ap.error("need --nan-step < --steps - 1 and an even --batch (2 ranks)")
    return a


def train(a, cwd: str, *options: str) -> tuple[int, list[str], dict[int, str]]:
    """Run `python -m minidist train` in `cwd` as a user types it and echo its SHOW lines (a
    long run of identical spike lines shortened); return (exit code, SHOW lines, {step: the
    last loss printed for it})."""
    argv = ["train", "--dp", "2", "--dtype", "float64", "--n-layer", "1", "--n-embd", "16",
            "--n-head", "2", "--batch", str(a.batch), "--steps", str(a.steps), "--seed",
            str(a.seed), "--every", "1", *options]
    print(shell_command(argv, WIDTH))
    done = subprocess.run([sys.executable, "-m", "minidist", *argv], cwd=cwd, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    out = done.stdout.splitlines()
    lines = [line for line in out if line.startswith(SHOW)]
    spikes = [line for line in lines if line.startswith("spike at")]
    shown = lines if len(spikes) <= 3 else lines[:2] + [
        f"... and {len(spikes) - 2} more 'spike at step s: loss is nan' lines, one per step"
    ] + lines[len(spikes):]
    print("\n".join(map(echo, shown)))
    loss = {int(m[1]): m[2] for m in (re.match(r"step +(\d+) \| loss (\S+)", x) for x in out)
            if m}
    return done.returncode, lines, loss


def main(argv=None) -> int:
    a = parse_args(argv)
    inject = ["--inject", f"nan:rank=0:step={a.nan_step}"]
    saved = a.nan_step // CKPT_EVERY * CKPT_EVERY             # the checkpoint rolled back to
    print(f"demo 17 · loss spike · dp=2, {a.steps} steps, float64, a NaN in rank 0's "
          f"gradients at step {a.nan_step}\ntrain's lines after '  | '")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="minidist-demo17-") as tmp:
        print("\n== 0. the clean run (no fault): the reference ==")
        runs["clean"] = train(a, tmp)
        for i, (policy, what) in enumerate(POLICIES.items(), start=1):
            print(f"\n== {i}. --spike {policy} ==\n{policy}: {what}")
            extra = (["--checkpoint-dir", "ck", "--checkpoint-every", str(CKPT_EVERY),
                      "--max-restarts", "1"] if policy == "rollback" else [])
            runs[policy] = train(a, tmp, *inject, "--spike", policy, *extra)

    last = a.steps - 1
    cols = [a.nan_step - 1, a.nan_step, a.nan_step + 1, last]
    digest = {k: next((x.split()[-1] for x in lines if x.startswith("params sha256")), "none")
              for k, (_, lines, _) in runs.items()}
    print("\nloss per step (the last value printed for it) and the final params:")
    print(f"  {'run':<9} {'spike lines':>11} " + " ".join(f"{'step ' + str(s):>8}" for s in cols)
          + "  params sha256")
    for k, (_, lines, loss) in runs.items():
        n = sum(x.startswith("spike at") for x in lines)
        print(f"  {k:<9} {n:>11} " + " ".join(f"{loss.get(s, '-'):>8}" for s in cols)
              + f"  {digest[k][:16]}...")
    print(f"skip prints the NaN loss of step {a.nan_step} it saw, but never applied its update")
    print(f"rollback ran steps {saved}..{a.nan_step - 1} again after the restart, step s on "
          f"batch s + 5:\n  from step {saved} on it sees other batches than the clean run")

    final = {k: float(loss.get(last, "nan")) for k, (_, _, loss) in runs.items()}
    ok = (all(rc == 0 for rc, _, _ in runs.values()) and math.isnan(final["detect"])
          and all(math.isfinite(final[k]) for k in ("clean", "skip", "rerun", "rollback"))
          and digest["rerun"] == digest["clean"] != "none")
    if not ok:
        print(f"MISMATCH: exit codes {[rc for rc, _, _ in runs.values()]}; final losses "
              f"{final}; rerun sha256 equals clean: {digest['rerun'] == digest['clean']}")
        return 1
    print("OK: detect ends in nan; skip, rerun and rollback end finite; rerun's params sha256 "
          "= the clean run's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
