"""`train --check`: a run's verdict against the single process (baseline.py), one of three.

A layout computes the single process's function with its sums cut and ordered otherwise,
so what "equal" can mean depends on what the run rounds:
    exact methods, fp32 / float64   every loss within 1e-12 at step 0 and 1e-6 over the run,
                                    every final parameter within 1e-6 (float64: the layouts'
                                    ~1e-16 per step, grown by Adam's 1/sqrt(v));
    --deterministic                 every loss, parameter and routing bias equal (==);
    mixed precision                 against the single process under the same policy: the
                                    first step within R u (`rounding_budget`), then the
                                    loss curves (below);
    quantised communication         (ZeRO++'s qwZ or qgZ, --param-gather fp8) the loss
                                    curves: their 10-step moving averages within 10% of
                                    the initial loss (`_curve_gap`).
The reference is trained here, on this process, after the run (its cost: one more run of
the same steps). Returns the exit code: 0 OK, 1 MISMATCH.
Read next: baseline.py.
"""

from __future__ import annotations

import numpy as np

from minidist import baseline
from minidist.data import DataConfig
from minidist.nn import GPTConfig
from minidist.parallel.compose import Plan
from minidist.parallel.zero.zeropp import parse_parts
from minidist.train import RankResult


def check(a, cfg: GPTConfig, data_cfg: DataConfig, run: RankResult, layout: str,
          plan: Plan | None = None) -> int:
    """--check: train the single-process baseline, print the verdict; the exit code."""
    ref = baseline.train_single_process(cfg, data_cfg, steps=a.steps, global_batch=a.batch,
                                        lr=a.lr, seed=a.seed, grad_accum=a.grad_accum,
                                        optimizer=a.optimizer,
                                        deterministic=getattr(a, "deterministic", False),
                                        grain=getattr(a, "grain", 1),
                                        token_tiles=getattr(a, "token_tiles", None),
                                        precision=getattr(a, "precision", "fp32"),
                                        grad_reduce=getattr(a, "grad_reduce", "fp32"),
                                        fp8_recipe=getattr(a, "fp8_recipe", "delayed"))
    lossy = plan is not None and (plan.param_gather == "fp8" or (
        plan.zeropp and set(parse_parts(plan.zeropp_parts)) - {"hpz"}))
    if lossy and plan.policy() is None:          # (under a policy: _check_rounded below)
        return _check_quantized(a, run, ref, layout)
    d_bias = _bias_gap(run.routing_biases, ref.routing_biases)
    deterministic = getattr(a, "deterministic", False)
    if plan is not None and plan.policy() is not None and not deterministic:
        return _check_rounded(a, cfg, run, ref, layout, plan)
    if deterministic:                            # the same bits, or a mismatch
        same = run.losses == ref.losses and d_bias == 0.0 and all(
            np.array_equal(run.params[k], v) for k, v in ref.params.items())
        print(f"{'OK' if same else 'MISMATCH'}: {layout} training "
              f"{'equals' if same else 'differs from'} the deterministic single-process run "
              f"bit for bit ({cfg.dtype}; every loss and parameter"
              f"{', and every routing bias at every step,' if ref.routing_biases else ''} "
              f"compared with ==)")
        return 0 if same else 1
    d_loss = max((abs(x - y) for x, y in zip(run.losses, ref.losses)), default=0.0)
    d_param = max(float(np.max(np.abs(run.params[k] - v))) for k, v in ref.params.items())
    d_first = abs(run.losses[0] - ref.losses[0]) if ref.losses else 0.0
    # The layouts add the same numbers in a different order (partial sums over ranks,
    # then their sum), a ~1e-16 difference per step that Adam's 1/sqrt(v) amplifies over
    # many steps; hence a tight bound on the first step and a looser one over the run.
    # A routing bias moves by +-gamma from integer loads: equal, or a routing choice flipped.
    ok = d_first <= 1e-12 and max(d_loss, d_param) <= 1e-6 and d_bias == 0.0
    biases = f", routing biases max |Δ| over the steps = {d_bias:.1e}" \
        if ref.routing_biases else ""
    print(f"{'OK' if ok else 'MISMATCH'}: {layout} training "
          f"{'matches' if ok else 'differs from'} the single-process run (float64; |Δ| loss "
          f"at step 0 = {d_first:.1e}, max over {a.steps} steps = {d_loss:.1e}, final params "
          f"max |Δ| = {d_param:.1e}{biases})")
    return 0 if ok else 1


CURVE_WINDOW, CURVE_TOLERANCE = 10, 0.10


def _curve_gap(run: RankResult, ref) -> np.ndarray:
    """|run - ref| of the losses' 10-step moving averages, over the initial loss (one
    window per step from the 10th; the whole run as one window if shorter)."""
    r, b = np.asarray(run.losses), np.asarray(ref.losses)
    k = min(CURVE_WINDOW, len(b))
    mean = np.ones(k) / k
    return np.abs(np.convolve(r, mean, "valid") - np.convolve(b, mean, "valid")) / b[0]


def _check_quantized(a, run: RankResult, ref, layout: str) -> int:
    """--check of ZeRO++ with qwZ or qgZ, which round what they send on purpose, so no run
    equals the single process's: the loss curves must agree in their 10-step moving
    averages, within 10% of the initial loss at every window (measured on the task, dp = 4
    as 2 nodes of 2, every part: at most 2.5% over 100 steps, 3.5% over 300). The exact
    parts are tested exactly (tests/parallel/zero/test_zeropp.py: hpZ is ZeRO-3 bit for
    bit; the quantised collectives equal their one-process oracle)."""
    if not ref.losses:
        print(f"OK: {layout}: no step to compare")
        return 0
    gap = _curve_gap(run, ref)
    ok = bool(np.all(gap <= CURVE_TOLERANCE))
    print(f"{'OK' if ok else 'MISMATCH'}: {layout} training (quantised: not an exact method) "
          f"{'follows' if ok else 'departs from'} the single-process loss curve: "
          f"{CURVE_WINDOW}-step moving averages within {gap.max():.1%} of the initial loss "
          f"(tolerance {CURVE_TOLERANCE:.0%}; last window {gap[-1]:.1%}; |Δ| loss at step 0 "
          f"= {abs(run.losses[0] - ref.losses[0]):.1e})")
    return 0 if ok else 1


UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp8": 2.0 ** -4}   # E4M3's for fp8


def rounding_budget(plan: Plan, cfg: GPTConfig) -> float:
    """The first step's relative loss budget of a layout against the single process under
    the same precision policy: R u. u is the format's unit roundoff (2^-p, p its precision
    bits: bf16 8, fp16 11; fp8's GEMM inputs E4M3 4). R counts the roundings a layout may
    place otherwise: each GEMM output of the forward (6 a block: qkv, q k^T, p v, the
    projection, fc, its projection; 1 for the head) may round the other way once, when its
    fp32 sum was added in another order upstream; a row-parallel output (2 a block) is
    rounded on each tp rank before the sum, tp more times. R = 6 L + 1 + 2 L tp. It is a
    first-order budget (each rounding moves the loss by at most u of it), not a proof; under
    fp8 it is above 1, so there only the curve and --deterministic decide."""
    L = cfg.n_layer
    return (6 * L + 1 + 2 * L * plan.tp) * UNIT_ROUNDOFF[plan.precision]


def _check_rounded(a, cfg: GPTConfig, run: RankResult, ref, layout: str, plan: Plan) -> int:
    """--check under mixed precision, against the single process under the same policy
    (baseline.py's `precision`): the first step's loss within rounding_budget, and the
    loss curves' 10-step moving averages within 10% of the initial loss (rounding
    differences grow chaotically over the run, as in float32: measured on the task, 300
    steps, at most 0.8% for bf16 tp 2 x pp 2, 3.1% fp16 cp 2 x dp 2, 2.1% fp8 ZeRO-3, 5.4%
    bf16 ep 2, where a rounding flips a routing choice). Bit for bit: --deterministic."""
    if not ref.losses:
        print(f"OK: {layout}: no step to compare")
        return 0
    first = abs(run.losses[0] - ref.losses[0]) / abs(ref.losses[0])
    budget, gap = rounding_budget(plan, cfg), _curve_gap(run, ref)
    ok = first <= budget and bool(np.all(gap <= CURVE_TOLERANCE))
    print(f"{'OK' if ok else 'MISMATCH'}: {layout} training "
          f"{'matches' if ok else 'differs from'} the single-process run under the same "
          f"policy ({plan.precision}; |Δ| loss at step 0 = {first:.1e} of it, budget "
          f"{min(budget, 1.0):.1e}; {CURVE_WINDOW}-step moving averages within {gap.max():.1%} "
          f"of the initial loss, tolerance {CURVE_TOLERANCE:.0%})")
    return 0 if ok else 1


def _bias_gap(run: tuple, ref: tuple) -> float:
    """max |Δ| between two runs' routing biases over every step and layer (inf if the
    runs recorded different steps or layers)."""
    if len(run) != len(ref) or any(set(a) != set(b) for a, b in zip(run, ref)):
        return float("inf")
    return max((float(np.max(np.abs(np.asarray(a[n]) - b[n])))
                for a, b in zip(run, ref) for n in b), default=0.0)
