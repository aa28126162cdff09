"""Activation recomputation: the memory of one training step without, selective and full.

What you will see: one forward and backward of a 4-layer GPT (dropout on, every second
block a mixture of experts), run three times: recompute = none, selective (the attention
core is rebuilt in the backward) and full (every block is run again in the backward). A
table follows the bytes the autograd keeps for the backward after each block's forward,
and during the backward of each block, where recomputation rebuilds that block's arrays
for a moment. This autograd frees the graph when the backward ends, so what is kept stays
until then. Bars compare the peaks; then the bytes one dense layer adds, measured and by
formula, and the step times (information only: a tiny model is Python overhead). The
three gradients must be bitwise equal, the MoE routing counted once.

Run:       python demos/19_recompute.py [--n-layer 4 --n-embd 32 --dropout 0.1 ...]
Read with: minidist/memory/recompute.py, minidist/nn/gpt.py (Block), minidist/nn/attention.py,
           minidist/autograd/saved.py
Paper:     Chen et al. 2016, arXiv:1604.06174 (full); Korthikanti et al. 2022,
           arXiv:2205.05198, Sec. 5 (selective)
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")           # one BLAS thread: faster for tiny matrices

import argparse                                # noqa: E402
import dataclasses                             # noqa: E402
import statistics                              # noqa: E402
import time                                    # noqa: E402

import numpy as np                             # noqa: E402

from minidist.autograd.saved import saved_bytes                        # noqa: E402
from minidist.cli import CliParser                                     # noqa: E402
from minidist.data import DataConfig, SyntheticData, model_config_for  # noqa: E402
from minidist.memory import recompute as rc                            # noqa: E402
from minidist.nn import GPT, DropoutKey                                # noqa: E402

# --- settings (each can be overridden on the command line) ---
N_LAYER, N_EMBD, N_HEAD, LENGTH, BATCH, DROPOUT, MOE_EVERY, SEED = 4, 32, 4, 8, 8, 0.1, 2, 0
REPEATS = 5
# each number option's (low, high): the demo stays small
LIMITS = dict(n_layer=(1, 8), n_embd=(1, 256), n_head=(1, 64), length=(1, 16), batch=(1, 64),
              dropout=(0.0, 0.99), moe_every=(0, 8), seed=(0, 2 ** 32), repeats=(1, 100))


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD, length=LENGTH,
                        batch=BATCH, dropout=DROPOUT, moe_every=MOE_EVERY, seed=SEED,
                        repeats=REPEATS), LIMITS)
    a = ap.parse_args(argv)
    if a.n_embd % a.n_head:
        ap.error(f"--n-embd {a.n_embd} is not a multiple of --n-head {a.n_head}")
    if a.moe_every == 1:
        ap.error("--moe-every 1 leaves no dense block to measure; use 0 (no MoE) or >= 2")
    return a


def one_step(cfg, idx, targets, key, seed):
    """Forward block by block, then backward; returns (loss, grads, timeline, MoE totals).
    timeline: [(phase, where, bytes kept)] after each forward piece and at each rebuild."""
    model = GPT(cfg, seed)
    params = model.parameters()
    x = model.embed(idx, key)
    timeline, aux_terms = [("forward", "embed", saved_bytes(x, exclude=params))], []
    for j, block in enumerate(model.blocks):
        x, aux = block(x, key)
        aux_terms += [aux] if aux is not None else []
        timeline.append(("forward", f"block {j}", saved_bytes([x, *aux_terms], exclude=params)))
    loss = model.loss(model.head(x), targets, None, aux_terms)
    timeline.append(("forward", "head + loss", saved_bytes(loss, exclude=params)))
    rebuilt = []                    # kept + the arrays a recomputation rebuilds, at its peak
    with rc.on_recompute(lambda name, out: rebuilt.append(saved_bytes([loss, out], params))):
        loss.backward()
    kept = timeline[-1][2]
    for j in reversed(range(cfg.n_layer)):       # the rebuilds come in backward order
        timeline.append(("backward", f"block {j}", rebuilt.pop(0) if rebuilt else kept))
    totals = [b.moe.take_totals() for b in model.blocks if hasattr(b, "moe")]
    return loss.item(), [p.grad for p in params], timeline, totals


def step_time(cfg, idx, targets, key, seed) -> float:
    model = GPT(cfg, seed)
    t0 = time.perf_counter()
    model(idx, targets, dropout_key=key)[1].backward()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    a = parse_args(argv)
    data_cfg = DataConfig(task="sort", length=a.length, seed=a.seed)
    base = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head,
                            dropout=a.dropout, moe_every=a.moe_every, top_k=2)
    cfgs = {m: dataclasses.replace(base, recompute=m) for m in rc.MODES}
    idx, targets = SyntheticData(data_cfg).global_batch(0, a.batch)
    key = DropoutKey(a.seed, 0, tuple(range(a.batch)))
    moe = [j for j in range(base.n_layer) if base.is_moe(j)]
    print(f"demo 19 · activation recomputation · GPT {base.n_layer} layers (MoE: blocks "
          f"{moe or 'none'})\nC={base.n_embd}, H={base.n_head}, T={base.block_size}, batch "
          f"{a.batch}, dropout {base.dropout}, {base.dtype}")
    runs = {m: one_step(cfg, idx, targets, key, a.seed) for m, cfg in cfgs.items()}

    print("\nKB kept for the backward (parameters excluded), one step:")
    print(f"{'':<22}" + "".join(f"{m:>12}" for m in rc.MODES))
    for i, (phase, where, _) in enumerate(runs["none"][2]):
        cells = "".join(f"{runs[m][2][i][2] / 1024:>12.1f}" for m in rc.MODES)
        print(f"{phase if i in (0, base.n_layer + 2) else '':<9}{where:<13}{cells}")
    peaks = {m: max(t[2] for t in runs[m][2]) for m in rc.MODES}
    for m in rc.MODES:
        print(f"peak {m:<10}|{'#' * round(40 * peaks[m] / peaks['none']):<40}| "
              f"{peaks[m] / 1024:6.1f} KB ({peaks[m] / peaks['none']:.0%})")

    dense = next(j for j in range(base.n_layer) if not base.is_moe(j))
    kept = {m: runs[m][2][dense + 1][2] - runs[m][2][dense][2] for m in rc.MODES}
    formula = {m: rc.kept_bytes(m, a.batch, base.block_size, base.n_embd, base.n_head,
                                base.mlp_ratio * base.n_embd, dropout=base.dropout > 0)
               for m in rc.MODES}
    print(f"\nbytes dense block {dense} adds, measured vs formula (recompute.kept_bytes):\n  " +
          "; ".join(f"{m} {kept[m]:,} {'=' if kept[m] == formula[m] else '!='} {formula[m]:,}"
                    for m in rc.MODES))
    times = {m: statistics.median(step_time(cfgs[m], idx, targets, key, a.seed)
                                  for _ in range(a.repeats)) for m in rc.MODES}
    print(f"step time, median of {a.repeats} (information only):\n  " + "; ".join(
        f"{m} {times[m] * 1e3:.1f} ms ({times[m] / times['none'] - 1:+.0%})" for m in rc.MODES))

    worst, n = 0.0, 0
    for m in ("selective", "full"):
        worst = max([worst, abs(runs[m][0] - runs["none"][0])] + [
            float(np.max(np.abs(g - r))) for g, r in zip(runs[m][1], runs["none"][1])])
        n += len(runs[m][1])
    exact = all(runs[m][0] == runs["none"][0] and all(
        np.array_equal(g, r) for g, r in zip(runs[m][1], runs["none"][1])) for m in rc.MODES)
    once = all(np.array_equal(t, r) for m in rc.MODES for t, r in zip(runs[m][3],
                                                                      runs["none"][3]))
    print(f"selective and full vs the plain backward: max |Δ| = {worst:.1e} over {n} gradients "
          "and the loss")
    if exact and once and kept == formula:
        print("OK: recomputed gradients = the plain backward's, bitwise; MoE routed once; "
              "kept bytes = formula")
        return 0
    print(f"MISMATCH: bitwise {exact} (max |Δ| = {worst:.1e}), MoE counted once {once}, "
          f"kept {kept} vs formula {formula}")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
