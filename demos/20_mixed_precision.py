"""Mixed precision: one training run in fp32, bf16, fp16 and fp8, and fp16's loss scale at work.

What you will see: the tiny GPT trained on the sort task four times from the same seed, in
fp32 and with the model copy, activations and GEMMs in bf16, fp16 (dynamic loss scaling)
and fp8 (E4M3 forward, E5M2 gradients, delayed scaling), the update always on fp32 master
weights. A table puts the loss of every k-th step side by side: the curves lie on top of
each other. Then the bytes each run holds per parameter (grads summed in the format: 2 +
2 + 12, ZeRO's K = 12). Then fp16 on 2 ranks (dp=2) with an overflow injected into rank
1's backward at one step (its loss x 1e30): the all-reduced inf flag makes BOTH ranks skip
that step and halve the loss scale, and the replicas stay bitwise equal.

Run:       python demos/20_mixed_precision.py [--steps 100 --every 10 --overflow-step 6]
Read with: minidist/memory/precision.py, minidist/memory/master_weights.py,
           minidist/memory/mixed_precision.py, minidist/memory/loss_scale.py,
           minidist/memory/fp8.py
Paper:     Micikevicius et al. 2018, "Mixed Precision Training", arXiv:1710.03740, Sec. 3;
           Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433
"""

import argparse

import numpy as np

from minidist.cli import CliParser
from minidist.data import DataConfig, model_config_for
from minidist.runtime.launch import spawn
from minidist.train import OnStepEnd, OptimizerConfig, Plan, RunConfig, train_on_rank

# --- settings (each can be overridden on the command line) ---
STEPS, EVERY, BATCH, LR, SEED, OVERFLOW_STEP, SCALE_STEPS = 100, 10, 16, 3e-3, 0, 6, 10
RUNS = {"fp32": 0.0, "bf16": 0.05, "fp16": 0.05, "fp8": 0.08}   # precision: allowed gap
LAST = 10          # the gap: |mean loss of the last 10 steps - fp32's| / fp32's loss drop


# each number option's (low, high): the demo stays small
LIMITS = dict(steps=(LAST, 1000), every=(1, 1000), batch=(2, 64), lr=(0.0, 1.0),
              seed=(0, 2 ** 32), overflow_step=(1, 998), scale_steps=(3, 1000))


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(steps=STEPS, every=EVERY, batch=BATCH, lr=LR, seed=SEED,
                        overflow_step=OVERFLOW_STEP, scale_steps=SCALE_STEPS), LIMITS)
    a = ap.parse_args(argv)
    if a.overflow_step >= a.scale_steps - 1 or a.batch % 2:
        ap.error("need --overflow-step < --scale-steps - 1 and an even --batch (2 ranks)")
    return a


def configs(a):
    data = DataConfig(task="sort", length=6, seed=a.seed)
    return model_config_for(data, n_layer=2, n_head=4, n_embd=32, dtype="float32"), data


def rank_main(ctx, a, precision: str, steps: int, overflow: bool):
    """Every rank: train under `precision` (grads summed in the format); with `overflow`,
    rank 1's loss is x 1e30 at --overflow-step. Returns (result, [(scale used, stepped,
    scale after) per step] or None)."""
    cfg, data = configs(a)
    history = []

    def end(s):
        e = s.engine
        if getattr(e, "scaler", None) is not None:
            history.append(e.scaler.history[-1] + (e.scaler.scale,))
        if overflow and ctx.rank == 1 and s.step == a.overflow_step - 1:
            loss = e.model.loss                   # this model instance only, one step
            e.model.loss = lambda *args, **kw: loss(*args, **kw) * 1e30
        elif overflow and ctx.rank == 1 and s.step == a.overflow_step:
            del e.model.loss
    plan = Plan(dp=ctx.world_size, precision=precision,
                grad_reduce="fp32" if precision == "fp32" else "low")
    result = train_on_rank(ctx, cfg, data, plan,
                           RunConfig(steps=steps, global_batch=a.batch, seed=a.seed),
                           OptimizerConfig(lr=a.lr), hooks=[OnStepEnd(end)])
    return result, history or None


def show_curves(a) -> dict[str, float]:
    """Part 1: the four runs' loss curves; returns each run's gap to fp32 (a fraction)."""
    runs = {p: spawn(1, rank_main, a, p, a.steps, False)[0][0] for p in RUNS}
    print(f"\n== 1. loss every {a.every} steps (grads summed in the format) ==")
    print("step " + "".join(f"{p:>10}" for p in runs))
    for s in sorted(set(range(0, a.steps, a.every)) | {a.steps - 1}):
        print(f"{s:4d} " + "".join(f"{r.losses[s]:10.4f}" for r in runs.values()))
    ref = runs["fp32"].losses
    drop = ref[0] - np.mean(ref[-LAST:])
    gaps = {p: (np.mean(r.losses[-LAST:]) - np.mean(ref[-LAST:])) / drop
            for p, r in runs.items()}
    print(f"last-{LAST} mean vs fp32, as a share of fp32's loss drop {drop:.3f}: " +
          ", ".join(f"{p} {g:+.2%}" for p, g in gaps.items() if p != "fp32"))
    print("\n== 2. bytes held per parameter (model copy + grads + fp32 master, m, v) ==")
    n = sum(v.size for v in runs["fp32"].params.values())
    for p, r in runs.items():
        m = r.memory
        print(f"{p:>5}: params {m['params'] / n:g} + grads {m['grads'] / n:g} + optimizer "
              f"{m['optimizer'] / n:g} = {(m['params'] + m['grads'] + m['optimizer']) / n:g} "
              f"bytes  ({n} parameters)")
    return gaps


def show_overflow(a) -> tuple[bool, str]:
    """Part 3: fp16 on dp=2 with an overflow on rank 1; returns (as expected?, summary)."""
    (r0, h0), (r1, h1) = spawn(2, rank_main, a, "fp16", a.scale_steps, True)
    print(f"\n== 3. fp16 loss scale, dp=2, rank 1's backward overflows at step "
          f"{a.overflow_step} ==")
    print("step | rank 0: scale used, step taken, scale after | rank 1: the same")
    for s, (x, y) in enumerate(zip(h0, h1)):
        mark = "   <- inf in rank 1's gradients" if s == a.overflow_step else ""
        print(f"{s:4d} | {x[0]:8.0f} {'yes' if x[1] else 'SKIP':>4} {x[2]:8.0f}"
              f"          | {y[0]:8.0f} {'yes' if y[1] else 'SKIP':>4} {y[2]:8.0f}{mark}")
    want = [(65536.0 if s <= a.overflow_step else 32768.0, s != a.overflow_step,
             65536.0 if s < a.overflow_step else 32768.0) for s in range(a.scale_steps)]
    same = all(np.array_equal(r0.params[k], r1.params[k]) for k in r0.params)
    print(f"replicas bitwise equal after {a.scale_steps} steps: {same}")
    ok = h0 == h1 == want and same
    return ok, f"the overflow on rank 1 skipped step {a.overflow_step} on both ranks and " \
        f"halved the scale 65536 -> 32768"


def main(argv=None) -> int:
    a = parse_args(argv)
    print(f"demo 20 · mixed precision · GPT 2 layers, C=32, sort task, batch {a.batch}, "
          f"AdamW lr {a.lr}, {a.steps} steps")
    gaps = show_curves(a)
    overflow_ok, story = show_overflow(a)
    curves_ok = all(abs(g) <= RUNS[p] for p, g in gaps.items())
    worst = max(abs(g) for g in gaps.values())
    if curves_ok and overflow_ok:
        print(f"fp16: {story}\nOK: bf16, fp16, fp8 curves match fp32 (last-{LAST} mean within "
              f"{worst:.1%} of the loss drop); overflow skipped")
        return 0
    print(f"MISMATCH: curves within tolerance: {curves_ok} (worst gap {worst:.1%}); "
          f"overflow handled as expected: {overflow_ok}")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
