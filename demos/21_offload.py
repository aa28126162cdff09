"""Offloading: the optimizer state (and ZeRO-3's parameter shards) leave the device.

What you will see: a tiny GPT (float64) trained on 2 ranks under ZeRO-3 three times, with
--offload none, host and disk. First where rank 0's arrays live in each run: the parameter
shards w and AdamW's m and v on the device, in host memory, or in memmap files (their names
are listed; the run's directory is gone when it ends). Then the ledger's device peak per
run: it drops by exactly the bytes that moved. Then the step time of each (information
only: on a tiny model it is noise) and the verdict: every loss, parameter and optimizer
number of the offloaded runs equals the plain run's, bit for bit.

Run:       python demos/21_offload.py [--zero 3 --steps 4 --n-embd 32 ...]
Read with: minidist/memory/offload.py, minidist/memory/ledger.py, minidist/parallel/zero/engine.py
Paper:     Ren et al. 2021, "ZeRO-Offload", arXiv:2101.06840; Rajbhandari et al. 2021,
           "ZeRO-Infinity", arXiv:2104.07857
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")           # one BLAS thread: faster for tiny matrices

import argparse                                # noqa: E402
import shutil                                  # noqa: E402
import statistics                              # noqa: E402
import tempfile                                # noqa: E402

import numpy as np                             # noqa: E402

from minidist.cli import CliParser                                     # noqa: E402
from minidist.data import DataConfig, model_config_for                 # noqa: E402
from minidist.memory.ledger import format_bytes                        # noqa: E402
from minidist.memory.offload import PREFIX, TIERS                      # noqa: E402
from minidist.runtime.launch import spawn                              # noqa: E402
from minidist.train import OnStepEnd, OptimizerConfig, Plan, RunConfig, train_on_rank  # noqa: E402

# --- settings (each can be overridden on the command line) ---
WORLD_SIZE, ZERO, STEPS, N_LAYER, N_EMBD, N_HEAD, LENGTH, BATCH, SEED = 2, 3, 4, 2, 32, 4, 6, 16, 0


# each number option's (low, high): the demo stays small
LIMITS = dict(world_size=(1, 8), zero=(0, 3), steps=(1, 1000), n_layer=(1, 8),
              n_embd=(1, 256), n_head=(1, 64), length=(1, 16), batch=(1, 512),
              seed=(0, 2 ** 32))


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(world_size=WORLD_SIZE, zero=ZERO, steps=STEPS, n_layer=N_LAYER,
                        n_embd=N_EMBD, n_head=N_HEAD, length=LENGTH, batch=BATCH,
                        seed=SEED), LIMITS)
    a = ap.parse_args(argv)
    if a.n_embd % a.n_head:
        ap.error(f"--n-embd {a.n_embd} is not a multiple of --n-head {a.n_head}")
    if a.batch % a.world_size:
        ap.error(f"--batch {a.batch} must be a multiple of --world-size {a.world_size}")
    data_cfg = DataConfig(task="sort", length=a.length, seed=a.seed)
    cfg = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head)
    try:
        Plan(dp=a.world_size, zero=a.zero, offload="host").validate(cfg, a.batch,
                                                                    data_cfg.block_size)
    except ValueError as e:
        ap.error(str(e))
    return a


def where(opt) -> dict:
    """{kind: (bytes, place)} for w, m, v of this rank's optimizer, and the disk files."""
    store = getattr(opt, "store", None)
    place = lambda a: store.tier if store is not None and store.holds(a) else "device"  # noqa
    out = {}
    for kind, arrays in (("parameters w", [p.data for p in opt.params]),
                         ("optimizer m", opt.m), ("optimizer v", opt.v)):
        out[kind] = (sum(a.nbytes for a in arrays), "/".join(sorted({place(a) for a in arrays})))
    files = [f for *_, f in opt.placement() if f] if store is not None else []
    names = [os.path.basename(f).split(".") for f in files]     # m.10.bin -> m, 10, bin
    out["files"] = [".".join(n) for n in sorted(names, key=lambda n: (n[0], int(n[1])))]
    out["dir"] = os.path.dirname(files[0]) if files else None
    return out


def rank_main(ctx, cfg, data_cfg, plan: Plan, a):
    """Every rank trains; the arrays' places are read after step 0 (StepEnd's engine)."""
    seen = {}

    def look(end):
        if end.step == 0:
            seen.update(where(end.engine.opt))
    run = train_on_rank(ctx, cfg, data_cfg, plan,
                        RunConfig(steps=a.steps, global_batch=a.batch, seed=a.seed,
                                  memory_ledger=True),
                        OptimizerConfig(lr=1e-2), hooks=[OnStepEnd(look)])
    return run, seen


def main(argv=None) -> int:
    a = parse_args(argv)
    data_cfg = DataConfig(task="sort", length=a.length, seed=a.seed)
    cfg = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head,
                           dtype="float64")
    print(f"demo 21 · offload · ZeRO-{a.zero}, dp={a.world_size}, GPT {a.n_layer} layers "
          f"C={a.n_embd}, {a.steps} steps, float64, AdamW")
    root = tempfile.mkdtemp(prefix="minidist-demo21-")
    try:
        runs = {t: spawn(a.world_size, rank_main, cfg, data_cfg,
                         Plan(dp=a.world_size, zero=a.zero, offload=t,
                              offload_dir=root if t == "disk" else None), a) for t in TIERS}
        left = [d for d in os.listdir(root) if d.startswith(PREFIX)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    seen = {t: runs[t][0][1] for t in TIERS}

    print(f"\n== where rank 0's arrays live after step 0 ==\n{'array':<15}{'bytes':>10}"
          + "".join(f"{'--offload ' + t:>17}" for t in TIERS))
    for kind in ("parameters w", "optimizer m", "optimizer v"):
        print(f"{kind:<15}{format_bytes(seen['none'][kind][0]):>10}"
              + "".join(f"{seen[t][kind][1]:>17}" for t in TIERS))
    files = seen["disk"]["files"]
    shown = files if len(files) <= 9 else files[:4] + ["..."] + files[-4:]
    print(f"disk files ({len(files)}) in {seen['disk']['dir']}/:\n  {' '.join(shown)}")
    print(f"left in {root} after the runs: {len(left)} run directories")

    peaks = {t: runs[t][0][0].memory["ledger"]["peak"] for t in TIERS}
    mem = runs["none"][0][0].memory
    moved = mem["optimizer"] + (mem["params"] if a.zero == 3 else 0)
    print("\n== the ledger's device peak, rank 0 (memory/ledger.py) ==")
    for t in TIERS:
        bar = "#" * round(40 * peaks[t] / peaks["none"])
        print(f"{t:<6}{format_bytes(peaks[t]):>10}  {bar}")
    drops = {t: peaks["none"] - peaks[t] for t in TIERS[1:]}
    print(f"drop: host {format_bytes(drops['host'])}, disk {format_bytes(drops['disk'])}; "
          f"moved off the device: m + v{' + w' if a.zero == 3 else ''} = {format_bytes(moved)}")

    print("\n== step time, median over ranks' steps (information only) ==")
    step = {t: statistics.median(s for run, _ in runs[t] for s in run.timing["step"])
            for t in TIERS}
    print("  ".join(f"{t} {step[t] * 1e3:.1f} ms ({step[t] / step['none']:.2f}x)" for t in TIERS))

    same = all(_equal(runs[t][r][0], runs["none"][r][0]) for t in TIERS[1:]
               for r in range(a.world_size))
    ok = same and not left and all(d == moved for d in drops.values())
    print(f"\n{'OK' if ok else 'MISMATCH'}: host and disk runs {'=' if same else '!='} the "
          f"plain run, bitwise; device peak -{format_bytes(drops['disk'])} "
          f"{'=' if all(d == moved for d in drops.values()) else '!='} the bytes moved; "
          f"{len(left)} dirs left")
    return 0 if ok else 1


def _equal(run, ref) -> bool:
    """Losses, parameters and optimizer state equal with ==."""
    return run.losses == ref.losses and all(
        np.array_equal(run.params[k], v) for k, v in ref.params.items()) and all(
        np.array_equal(run.optimizer_state[k], v) for k, v in ref.optimizer_state.items())


if __name__ == "__main__":
    raise SystemExit(main())
