"""Benchmark, part 2 of bench/checkpoint.py: the time from a rank's death to training again.

The run is the train command itself, started as a child process:

    python -m minidist train --dp 2 --zero 1 ... --every 1 --checkpoint-dir D
        --checkpoint-every E --max-restarts 1 --inject sigkill:rank=1:step=S

and its stdout is read line by line, each line stamped with this process's clock when it
arrives (every line it uses is flushed as it is printed). The lines, in order, and what
lies between them:

    no checkpoint in D: starting at step 0        launcher, attempt 0
    step 0 | ...                                  fresh start: fork, build, first step
    step S-1 | ...                                rank 0, the last step done
    [rank 1] injecting sigkill:...                rank 1, just before SIGKILL: t_kill
      detection: the launcher reaps rank 1, rank 0 sees the abort flag and reports,
      supervise() finds the latest checkpoint (latest(): reads and checks every byte)
    recovery: attempt 0 failed: ...               launcher: t_detect
    recovery: restarting all ranks in B s ...     backoff B (0.5 s, then doubling)
      backoff, then policy.start(): latest() again, and load() (reads it again)
    resuming from D/step... (step R)              launcher: t_resume
      fork W ranks, build the model, engine.load_full_state, train step R
    step R | ...                                  training again: t_first
    step S-1 | ...                                the lost steps R..S-1 redone: t_caught_up

Detection and the launcher's checkpoint read are split using latest() and load() timed
again in this process on the same directory (the page cache is warm for both). The
"fresh start" (no checkpoint line to step 0) is the same fork, build and first step
without a checkpoint to load: the restart's start minus it is the cost of loading.
Target (issue 13): kill -> training again <= 5 s plus the checkpoint load time.

Read next: reliability/recovery.py (supervise), runtime/launch.py (failure detection)
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from minidist.reliability import checkpoint as ckpt

TARGET_S = 5.0
_STEP = re.compile(r"^step\s+(\d+) \| loss")
_RESTART = re.compile(r"^recovery: restarting all ranks in ([0-9.]+) s from .*\(step (\d+)\)")


def command(a, root: Path) -> list[str]:
    """The train command of one recovery run (module docstring)."""
    return ["python", "-m", "minidist", "train", "--dp", str(a.dp), "--zero", str(a.zero),
            "--n-layer", str(a.n_layer), "--n-embd", str(a.n_embd), "--n-head", str(a.n_head),
            "--length", str(a.length), "--batch", str(a.batch), "--dtype", a.dtype,
            "--steps", str(a.steps), "--every", "1", "--checkpoint-dir", str(root),
            "--checkpoint-every", str(a.every), "--max-restarts", "1",
            "--inject", f"sigkill:rank={1 if a.dp > 1 else 0}:step={a.kill_step}"]


def run_once(argv: list[str], timeout: float = 300.0) -> list[tuple[float, str]]:
    """Run `argv` (argv[0] "python": this interpreter), return (arrival time, line) of
    every line of its stdout and stderr; RuntimeError if it fails or outlives `timeout`
    seconds (then it is killed; its ranks die with it, PR_SET_PDEATHSIG)."""
    env = {k: v for k, v in os.environ.items() if k != "MINIDIST_INJECT"}
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, *argv[1:]], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, cwd=repo)
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    lines = []
    try:
        with proc.stdout:
            for raw in proc.stdout:
                lines.append((time.perf_counter(), raw.decode(errors="replace").rstrip("\n")))
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
    if code != 0:
        tail = "\n".join(line for _, line in lines[-15:])
        raise RuntimeError(f"recovery run exited with {code} (a run is killed after {timeout:g} "
                           f"s): {' '.join(argv)}\n{tail}")
    return lines


def parse(lines: list[tuple[float, str]], kill_step: int) -> dict[str, float]:
    """The moments of the module docstring's table, reduced to durations in seconds."""
    t: dict[str, float] = {}
    attempt, resume, backoff = 0, None, None
    for at, line in lines:
        m, r = _STEP.match(line), _RESTART.match(line)
        if line.startswith("no checkpoint in "):
            t["start"] = at
        elif m and attempt == 0 and int(m.group(1)) == 0:
            t["step0"] = at
        elif "injecting sigkill" in line:
            t["kill"] = at
        elif line.startswith("recovery: attempt 0 failed"):
            t["detect"], attempt = at, 1
        elif r:
            backoff, resume = float(r.group(1)), int(r.group(2))
        elif line.startswith("resuming from "):
            t["resume"] = at
        elif m and attempt == 1 and "first" not in t:
            t["first"] = at
        if m and attempt == 1 and int(m.group(1)) == kill_step - 1:
            t["caught_up"] = at
    missing = {"start", "step0", "kill", "detect", "resume", "first"} - set(t)
    if missing or backoff is None:
        raise RuntimeError(f"recovery run: no line for {sorted(missing)} in its output:\n"
                           + "\n".join(line for _, line in lines[-20:]))
    return {"detect": t["detect"] - t["kill"], "backoff": backoff,
            "read": t["resume"] - t["detect"] - backoff,
            "start": t["first"] - t["resume"], "fresh": t["step0"] - t["start"],
            "total": t["first"] - t["kill"], "resume_step": resume,
            "redone": kill_step - resume,
            "caught_up": t.get("caught_up", t["first"]) - t["kill"]}


def time_reads(root: Path, repeats: int = 3) -> tuple[float, float, int]:
    """(median seconds of latest(root), of load(its path), the checkpoint's bytes)."""
    found = ckpt.latest(root)
    t_latest, t_load = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ckpt.latest(root)
        t1 = time.perf_counter()
        ckpt.load(found.path)
        t_latest.append(t1 - t0)
        t_load.append(time.perf_counter() - t1)
    size = sum(f.stat().st_size for f in found.path.iterdir())
    return statistics.median(t_latest), statistics.median(t_load), size


def measure(a, root: Path) -> tuple[list[dict], tuple[float, float, int]]:
    """a.repeats recovery runs, each into a fresh directory under root: their parse()s,
    and time_reads() on the first run's checkpoints."""
    runs, reads = [], None
    for k in range(a.repeats):
        d = root / f"recovery{k}"
        runs.append(parse(run_once(command(a, d)), a.kill_step))
        if reads is None:
            reads = time_reads(d)
        shutil.rmtree(d, ignore_errors=True)
    return runs, reads


def report(a, root: Path, step_s: float) -> str:
    """Part 2's section of the report; step_s: the median step time without checkpoints."""
    runs, (t_latest, t_load, size) = measure(a, root)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    R, S = int(med["resume_step"]), a.kill_step
    shown = " ".join(command(a, Path("D")))
    ck = t_latest + t_load
    rows = [("detection (launcher: reap, abort, report; + one latest())", med["detect"],
             f"latest() alone {t_latest:.3f} s -> detection ~{med['detect'] - t_latest:.3f} s"),
            ("backoff", med["backoff"], "supervise(backoff=0.5): 0.5 x 2^attempt"),
            ("checkpoint find + verify + load (launcher)", med["read"],
             f"latest() + load() alone: {ck:.3f} s for {size / 1e6:.2f} MB"),
            ("process start + build + load state + step", med["start"],
             f"fresh start to step 0: {med['fresh']:.3f} s; one step {step_s:.3f} s")]
    lines = [f"== recovery time: median of {a.repeats} runs of ==", f"$ {shown}",
             f"kill (rank {1 if a.dp > 1 else 0} SIGKILLed at the start of step {S}) -> "
             f"training again (first step after the restart done, step {R}): "
             f"{med['total']:.3f} s"]
    lines += [f"  {name:<54}{sec:>7.3f} s   {note}" for name, sec, note in rows]
    lines.append(f"steps redone: {R}..{S - 1} ({S - R} steps, ~{(S - R) * step_s:.3f} s at "
                 f"{1e3 * step_s:.1f} ms/step); caught up with the killed run "
                 f"{med['caught_up']:.3f} s after the kill")
    limit = TARGET_S + med["read"]
    ok = "met" if med["total"] <= limit else "NOT met"
    lines.append(f"target (issue 13): kill -> training again <= {TARGET_S:g} s + checkpoint "
                 f"load ({med['read']:.3f} s) = {limit:.3f} s: measured {med['total']:.3f} s: "
                 f"{ok}")
    lines.append("per run (total s): " + " ".join(f"{r['total']:.3f}" for r in runs))
    return "\n".join(lines)
