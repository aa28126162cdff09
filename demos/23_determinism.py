"""Determinism: the same training run under several layouts, bit for bit.

What you will see: a small GPT (dropout on, gradient clipping) trained for a few steps by
the single process and by several layouts (dp = 2 and 3, ZeRO-1 and -3, pipelines with
three schedules, tensor parallelism alone, with SP and with dp and pp, context
parallelism by ring and Ulysses, alone and with tp and SP: 13 layouts), first as usual
and then with --deterministic; then a MoE GPT the same way, by its single process and 6
layouts under expert and pipeline parallelism. For each run the sha256 of its final
parameters (in name order, as `params sha256:` prints it). As
usual, the layouts agree to ~1e-15 but their hashes differ: each groups its sums
differently. Deterministic, every hash is the same, and equal to the deterministic single
process's: each sample is its own micro-batch and the samples' gradients are added in one
fixed tree over their global indices, whoever holds them; tensor-parallel matmuls run
over fixed tiles of the weights (minidist/deterministic/matmul.py); every sum over positions
runs over fixed runs of positions (--token-tiles, what context parallelism needs); experts
run each sample's tokens in a call of their own. The step times (information only) show
what that costs.

Run:       python demos/23_determinism.py [--steps 3 --batch 12 --dtype float32]
Read with: minidist/deterministic/ (its __init__ is the map: tree_sum.py, matmul.py,
           layers.py, apply.py, step.py, expert.py)
Paper:     Demmel & Nguyen 2013, "Fast reproducible floating-point summation" (the
           problem); Higham 1993 (pairwise summation)
"""

import argparse
import time

import numpy as np

from minidist.baseline import train_single_process
from minidist.cli import CliParser, at_least
from minidist.data import DataConfig
from minidist.deterministic.digest import params_digest
from minidist.nn import GPTConfig
from minidist.parallel.compose import Plan
from minidist.runtime import spawn
from minidist.train import OptimizerConfig, RunConfig, train_on_rank

# --- settings (each can be overridden on the command line) ---
STEPS, BATCH, DTYPE, SEED = 3, 12, "float64", 0
LAYOUTS = [("dp=2", dict(dp=2)), ("dp=3 ZeRO-1", dict(dp=3, zero=1)),
           ("dp=2 ZeRO-3 M=2", dict(dp=2, zero=3, micro_batches=2)),
           ("pp=2 1f1b", dict(pp=2, micro_batches=2)),
           ("pp=2 interleaved", dict(pp=2, micro_batches=2, schedule="interleaved")),
           ("dp=2 x pp=2 ZeRO-2 zb-h1", dict(dp=2, pp=2, zero=2, micro_batches=2,
                                             schedule="zb-h1")),
           ("tp=2", dict(tp=2)), ("dp=2 x tp=2 ZeRO-3", dict(dp=2, tp=2, zero=3)),
           ("pp=2 x tp=2 gpipe", dict(pp=2, tp=2, micro_batches=2, schedule="gpipe")),
           ("tp=2 SP", dict(tp=2, sequence_parallel=True)),
           ("cp=2 ring zig-zag", dict(cp=2)),
           ("dp=2 x cp=2 ulysses ZeRO-1", dict(dp=2, cp=2, cp_algo="ulysses", zero=1)),
           ("cp=2 x tp=2 SP", dict(cp=2, tp=2, sequence_parallel=True))]
MOE_LAYOUTS = [("dp=2 ep=2", dict(dp=2, ep=2)), ("dp=4 ep=2 ZeRO-1", dict(dp=4, ep=2, zero=1)),
               ("dp=2 ep=2 ZeRO-3", dict(dp=2, ep=2, zero=3)),
               ("dp=2 ep=2 x tp=2", dict(dp=2, ep=2, tp=2)),
               ("pp=2 1f1b", dict(pp=2, micro_batches=2)),
               ("dp=2 ep=2 x pp=2", dict(dp=2, ep=2, pp=2, micro_batches=2))]
TOKEN_TILES = 8      # --deterministic: sums over positions in runs of T / 8 (cp needs them)


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=at_least(1), default=STEPS, help="1..100")
    ap.add_argument("--batch", type=at_least(12), default=BATCH,
                    help="a multiple of 12 (dp = 2 and 3, M = 2), at most 96")
    ap.add_argument("--dtype", default=DTYPE, choices=["float64", "float32"])
    ap.add_argument("--seed", type=at_least(0), default=SEED)
    a = ap.parse_args(argv)
    if a.steps > 100 or a.batch > 96 or a.batch % 12 or a.seed >= 2 ** 32:
        ap.error("need --steps <= 100, --batch a multiple of 12 (dp = 2 and 3, M = 2) up to 96 "
                 "and --seed < 2^32")
    return a


def rank_main(ctx, cfg, data, plan, a, deterministic):
    return train_on_rank(ctx, cfg, data, plan,
                         RunConfig(steps=a.steps, global_batch=a.batch, seed=a.seed,
                                   deterministic=deterministic,
                                   token_tiles=TOKEN_TILES if deterministic else None),
                         OptimizerConfig(lr=1e-2, clip_grad=0.5))


def run(name, cfg, data, a, deterministic, kwargs=None):
    """(name, params sha256, seconds per step, params): the single process if kwargs is
    None; raises SystemExit (exit code 1) if the ranks of a layout hold different params."""
    t0 = time.perf_counter()
    if kwargs is None:
        res = train_single_process(cfg, data, steps=a.steps, global_batch=a.batch, lr=1e-2,
                                   seed=a.seed, clip_grad=0.5, deterministic=deterministic,
                                   token_tiles=TOKEN_TILES if deterministic else None)
        digests, params = {params_digest(res.params)}, res.params
    else:
        plan = Plan(**kwargs)
        results = spawn(plan.world_size, rank_main, cfg, data, plan, a, deterministic)
        digests = {params_digest(r.params) for r in results}       # every rank's view
        params = results[0].params
    if len(digests) != 1:
        raise SystemExit(f"MISMATCH: {name}: the ranks hold different parameters")
    return name, digests.pop(), (time.perf_counter() - t0) / a.steps, params


def main(argv=None) -> int:
    a = parse_args(argv)
    data = DataConfig("sort", length=4)
    dense = GPTConfig(vocab_size=11, block_size=9, n_layer=4, n_head=2, n_embd=16,
                      dropout=0.1, dtype=a.dtype)
    moe = GPTConfig(**{**dense.__dict__, "n_layer": 2, "moe_every": 1, "n_experts": 4,
                       "moe_group_size": 8})
    print(f"demo 23 · determinism · GPT 4 layers, C=16, {a.dtype}, dropout 0.1, clip 0.5 · "
          f"batch {a.batch}, {a.steps} steps")
    runs = same = 0
    for title, cfg, layouts in (("GPT", dense, LAYOUTS), ("MoE GPT, 4 experts", moe,
                                                          MOE_LAYOUTS)):
        table = {}
        for det in (False, True):
            rows = [run("single process", cfg, data, a, det)]
            rows += [run(name, cfg, data, a, det, kw) for name, kw in layouts]
            table[det] = rows
            print(f"\n== {title}, {'--deterministic' if det else 'as usual'} ==")
            print(f"  {'layout':<26} {'params sha256':<20} {'s per step (information)':>24}")
            for name, digest, sec, _ in rows:
                mark = "=" if digest == rows[0][1] else "≠"
                print(f"  {name:<26} {digest[:16]}... {mark} {sec:>12.3f}")
        usual = {d for _, d, _, _ in table[False]}
        hashes = {d for _, d, _, _ in table[True]}
        one = table[False][0][3]                          # the single process's parameters
        gap = max(float(np.max(np.abs(p[k] - v))) for *_, p in table[False]
                  for k, v in one.items())
        print(f"\n  as usual: {len(usual)} different hashes over {len(table[False])} runs, "
              f"the parameters within {gap:.1e}\n  of the single process's: the same numbers,"
              " summed in other orders")
        print(f"  deterministic: {len(hashes)} hash over {len(table[True])} runs")
        if len(hashes) != 1:
            print(f"MISMATCH: --deterministic gave {len(hashes)} different parameter hashes "
                  f"for the {title}")
            return 1
        runs, same = runs + len(layouts), same + 1
    print(f"OK: {runs} layouts' parameters match their deterministic single process bit "
          f"for bit ({same} models)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
