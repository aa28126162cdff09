"""Checkpointing: global state in pieces on disk, committed atomically, read by any layout.

What you will see: a tiny GPT trained on 2 ranks (dp=2, ZeRO-1) with a checkpoint every 4
steps: the files on disk and a few manifest entries (a piece's sha256 checked by hand); a
rank SIGKILLed halfway through writing its file, after which `latest` still names the
previous checkpoint and it loads; an asynchronous save whose snapshot returns before the
write is done; the crashed run resumed on 3 ranks (dp=3), within 1e-12 of the uninterrupted
run (float64).

Run:       python demos/14_checkpointing.py [--steps 8 --every 4 --batch 6]
           (or python -m minidist demo checkpointing)
Read with: minidist/reliability/checkpoint.py, minidist/reliability/checkpoint_format.py,
           minidist/reliability/recovery.py
Paper:     Mohan et al. 2021, "CheckFreq", FAST '21 (snapshot, then persist in the background);
           Pillai et al. 2014, "All File Systems Are Not Created Equal", OSDI (fsync, rename)
"""

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from minidist.cli import CliParser, echo, shell_command
from minidist.reliability import checkpoint as ckpt
from minidist.reliability.async_checkpoint import AsyncCheckpointer

# --- settings (each can be overridden on the command line) ---
STEPS, EVERY, BATCH, SEED = 8, 4, 6, 0         # BATCH divisible by dp=2 and dp=3
SHOW = ("step", "resuming", "[rank", "minidist train:", "  killed", "params sha256")
# each number option's (low, high): the demo stays small
LIMITS = dict(steps=(2, 1000), every=(1, 1000), batch=(6, 96), seed=(0, 2 ** 32))
WIDTH = 100                                    # characters a line


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(steps=STEPS, every=EVERY, batch=BATCH, seed=SEED), LIMITS)
    a = ap.parse_args(argv)
    if a.steps <= a.every or a.batch % 6:
        ap.error("need --steps > --every and --batch a multiple of 6 (for dp=2 and dp=3)")
    a.prev = (a.steps - 1) // a.every * a.every    # the last checkpoint before the end
    return a


def train(a, cwd: Path, *options: str, show=SHOW) -> int:
    """Run `python -m minidist train` in `cwd` as a user types it; print the lines of its
    output that start with one of `show`; return its exit code."""
    argv = ["train", "--zero", "1", "--steps", str(a.steps), "--batch", str(a.batch), "--dtype",
            "float64", "--seed", str(a.seed), "--every", "1", "--checkpoint-every", str(a.every),
            *options]
    print(shell_command(argv, WIDTH))
    done = subprocess.run([sys.executable, "-m", "minidist", *argv], cwd=cwd, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    print("\n".join(echo(line) for line in done.stdout.splitlines() if line.startswith(show)))
    return done.returncode


def tree(root: Path) -> None:
    """Every file under root with its size; `latest` with its content."""
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        text = f'  "{p.read_text().strip()}"' if p.name == "latest" else ""
        name = re.sub(r"-[0-9a-f]{16}\b", "-<token>", str(p.relative_to(root.parent)))
        print(f"  {name:<44} {p.stat().st_size:>7} B{text}")


def piece_sha(path: Path, name: str) -> str:
    """sha256 of tensor `name` in a safetensors file, read by hand: 8-byte header length N,
    N bytes of JSON {name: {dtype, shape, data_offsets}}, then the raw bytes."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    lo, hi = json.loads(raw[8:8 + n])[name]["data_offsets"]
    return hashlib.sha256(raw[8 + n + lo:8 + n + hi]).hexdigest()


def show_layout(a, d: Path) -> bool:
    print("\n== 1. on disk: rank r writes piece r of every (flattened) array;\n"
          "   rank 0 writes the manifest, then `latest` ==")
    train(a, d.parent, "--dp", "2", "--checkpoint-dir", d.name, show=("params sha256",))
    tree(d)
    step_dir = d / (d / "latest").read_text().strip()
    m = json.loads((step_dir / "manifest.json").read_text())
    print(f"{step_dir.name}/manifest.json: {m['format']} v{m['version']}, {m['writers']} writers"
          f",\n  {len(m['tensors'])} tensors (params, then AdamW's m and v), step {m['step']}, "
          f"{len(m['state']['losses'])} losses,\n  data_cursor {m['state']['data_cursor']}")
    ok = True
    for name in ("params/wte.weight", "params/ln_f.bias", "optimizer/v.0"):
        t = m["tensors"][name]
        print(f"  {name:<18} {t['dtype']} shape {t['shape']}:\n" + "\n".join(
            f"    {p['file']} [{p['range'][0]}, {p['range'][1]}) sha256 {p['sha256'][:12]}"
            for p in t["pieces"]))
        ok &= all(piece_sha(step_dir / p["file"], name) == p["sha256"] for p in t["pieces"])
    print(f"every piece above, hashed by hand from its safetensors file, matches: {ok}")
    return ok


def show_crash(a, tmp: Path) -> bool:
    print(f"\n== 2. atomic commit: rank 1 SIGKILLed with its file of step {a.steps} half written "
          "==")
    rc = train(a, tmp, "--dp", "2", "--checkpoint-dir", "crashed",
               "--inject", f"sigkill:rank=1:step={a.steps - 1}:point=save")
    print(f"exit code {rc}; on disk:")
    tree(tmp / "crashed")
    part = next((tmp / "crashed").glob(f".tmp-step{a.steps:08d}-*")) / "rank00001.safetensors"
    print(f"rank 1's file stopped at {part.stat().st_size} B; there is no manifest and no "
          "step directory:\na save writes under .tmp- names (with a random token: nothing can "
          "be planted there)\nand commits only when rank 0 replaces `latest` (temp file, "
          "fsync, rename),\nso the previous checkpoint is current")
    found = ckpt.latest(tmp / "crashed")
    state, old = (ckpt.load(d / found.path.name) for d in (tmp / "crashed", tmp / "full"))
    same = all(np.array_equal(v, old.params[k]) for k, v in state.params.items())
    print(f"checkpoint.latest: {found.path.name}, every byte checked against its manifest;\n"
          f"loaded: step {state.step}, params bitwise equal to run 1's {found.path.name}: {same}")
    return rc != 0 and found.step == a.prev and same


def show_async(tmp: Path, state) -> bool:
    print("\n== 3. async save (CheckFreq; train --async-checkpoint): snapshot() copies the "
          "arrays\n   and a thread writes them while the next step computes (a stand-in "
          "step here:\n   10 matmuls 200x200) ==")
    x, events = np.random.default_rng(0).standard_normal((200, 200)), []
    log = lambda what: events.append((time.perf_counter(), what))     # noqa: E731
    t0 = time.perf_counter()
    ckpt.save(state, tmp / "sync")
    t1 = time.perf_counter()
    writer = AsyncCheckpointer(tmp / "async", on_phase=log)
    writer.snapshot(state)
    t2 = time.perf_counter()
    log("<- snapshot() returned: the step starts")
    for _ in range(10):
        x @ x                                          # NumPy releases the GIL here
    log("<- the step is done")
    log("close(): rank 0 commits (after a barrier, in a job)")
    writer.close()
    print(f"training stalls for save() {1e3 * (t1 - t0):.1f} ms, for snapshot() "
          f"{1e3 * (t2 - t1):.1f} ms; the async save as a timeline (ms):")
    print("\n".join(f"  {1e3 * (t - t1):6.2f}  {what}" for t, what in sorted(events)))
    a, b = (ckpt.latest(tmp / d).path / "rank00000.safetensors" for d in ("sync", "async"))
    print(f"the async checkpoint holds the same bytes as the synchronous one: "
          f"{a.read_bytes() == b.read_bytes()}")
    return a.read_bytes() == b.read_bytes()


def show_reshard(a, tmp: Path) -> float:
    print("\n== 4. reshard: the crashed dp=2 run continues on 3 ranks (dp=3, ZeRO-1)\n"
          "   from its latest checkpoint ==")
    train(a, tmp, "--dp", "3", "--checkpoint-dir", "crashed")
    print("each rank cuts its ZeRO shard (1/3 of the flat optimizer state now) out of the full "
          "arrays\n(load_full_state), with no communication")
    new, ref = (ckpt.load(ckpt.latest(tmp / d).path) for d in ("crashed", "full"))
    dl = max(abs(x - y) for x, y in zip(new.losses, ref.losses))
    dp = max(float(np.abs(v - ref.params[k]).max()) for k, v in new.params.items())
    do = max(float(np.abs(v - ref.optimizer[k]).max()) for k, v in new.optimizer.items()
             if isinstance(v, np.ndarray))
    print(f"step {new.step}, dp=2 -> dp=3 vs uninterrupted dp=2: losses max |Δ| = {dl:.1e}, "
          f"params {dp:.1e},\nAdamW m, v {do:.1e} (float64; not bitwise, hence another sha256: "
          "3 ranks add the\ngradient in another order than 2)")
    files = sorted(p.name for p in ckpt.latest(tmp / "crashed").path.iterdir())
    print(f"step{a.steps:08d} now holds {', '.join(files[:2])},\n  {', '.join(files[2:])}; "
          f"the crash's .tmp-step{a.steps:08d}"
          f"-<token> is gone: {not any((tmp / 'crashed').glob(f'.tmp-step{a.steps:08d}-*'))}")
    return max(dl, dp, do)


def main(argv=None) -> int:
    a = parse_args(argv)
    print(f"demo 14 · checkpointing · dp=2 ZeRO-1, {a.steps} steps, a checkpoint every "
          f"{a.every}, float64\nlayout, atomic commit, async save, resume on dp=3 · train's "
          "lines after '  | ', step lines cut")
    with tempfile.TemporaryDirectory(prefix="minidist-demo14-") as name:
        tmp = Path(name)
        checks = {"pieces = manifest": show_layout(a, tmp / "full"),        # the reference
                  f"kill mid-save: step {a.prev} current, loads": show_crash(a, tmp),
                  "async = sync": show_async(tmp, ckpt.load(ckpt.latest(tmp / "full").path))}
        worst = show_reshard(a, tmp)
    checks["dp=2 -> dp=3 within 1e-12"] = worst <= 1e-12
    failed = [what for what, ok in checks.items() if not ok]
    print(f"MISMATCH: not {'; not '.join(failed)}" if failed else f"OK: {'; '.join(checks)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
