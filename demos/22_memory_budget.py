"""Memory budget: every byte of a training step, estimated before it runs and counted after.

What you will see: a tiny GPT (float64) taking one training step under several plans on
real ranks: data parallelism with ZeRO 0-3, tensor parallelism with sequence parallelism,
a 1F1B pipeline, context parallelism, selective and full recomputation. Per plan and
pipeline stage, the bytes one rank holds by category, two rows: as the estimator predicts
them (est, memory/budget.py) and as one training step on real ranks holds them (meas:
params, grads, optimizer and ZeRO's buffers from engine.memory(), activations and the
recomputation's rebuilt arrays from the autograd graph); a measured cell that differs from
its estimate is marked `!`. Then the ZeRO paper's Fig. 1 through the same formulas, and
what one GPU holds for GPT-3 13B in bf16.

Run:       python demos/22_memory_budget.py [--plans "dp=2,zero=3;tp=2,sp=1"] [--n-layer 2]
           (the same, one plan: python -m minidist memory --plan dp=2,zero=3 --measure)
Read with: minidist/memory/budget.py, minidist/memory/budget_measure.py,
           minidist/parallel/zero/memory.py, minidist/parallel/tensor/memory.py
Paper:     Rajbhandari et al. 2020, "ZeRO", arXiv:1910.02054, Sec. 5 and Fig. 1;
           Korthikanti et al. 2022, arXiv:2205.05198, Table 2 and Sec. 5 (selective)
"""

import argparse

from minidist.cli import CliParser
from minidist.data import DataConfig, model_config_for
from minidist.memory.budget import MemoryPlan, estimate, estimate_stages, zero_figure1
from minidist.memory.budget_cli import fmt, parse_plan
from minidist.memory.budget_measure import MEASURED, check_measurable, compare
from minidist.memory.budget_models import preset

# --- settings (each can be overridden on the command line) ---
PLANS = ("dp=2;dp=2,zero=1;dp=2,zero=2;dp=4,zero=3;tp=2,sp=1;pp=2,mb=4;cp=2;"
         "recompute=selective;dp=2,recompute=full")
N_LAYER, N_EMBD, N_HEAD, BATCH, SEED = 2, 32, 4, 8, 0
PAPER_FIG1 = (120, 31.4, 16.6, 1.9)                 # GB per device, ZeRO stages 0-3
# each number option's (low, high): the demo stays small
LIMITS = dict(n_layer=(1, 8), n_embd=(1, 256), n_head=(1, 64), batch=(1, 64),
              seed=(0, 2 ** 32))
DATA = DataConfig(task="sort", length=6)
PLAN, WIDTH = 20, {c: 13 if c == "activations" else 11 for c in MEASURED}   # column widths


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default=PLANS, help="plans separated by ';' (memory --plan)")
    ap.add_numbers(dict(n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD, batch=BATCH,
                        seed=SEED), LIMITS)
    a = ap.parse_args(argv)
    if a.n_embd % a.n_head:
        ap.error(f"--n-embd {a.n_embd} is not a multiple of --n-head {a.n_head}")
    cfg = model_config_for(DATA, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head)
    a.texts = [text.strip() for text in a.plans.split(";") if text.strip()]
    try:
        a.parsed = [parse_plan(text) for text in a.texts]
        for text, plan in zip(a.texts, a.parsed):
            if plan.world_size > 8:
                raise ValueError(f"--plans: {text} needs {plan.world_size} ranks; the demo "
                                 "runs at most 8")
            if plan.precision != "fp64":
                raise ValueError(f"--plans: {text}: precision={plan.precision} is estimated "
                                 "only (python -m minidist memory); this demo measures every "
                                 "plan, in fp64: drop precision=")
            check_measurable(cfg, plan)
            estimate_stages(cfg, plan, a.batch, DATA.block_size)    # ValueError: cannot run
    except ValueError as e:
        ap.error(str(e))
    if not a.parsed:
        ap.error("--plans is empty; give plans like 'dp=2;tp=2,sp=1'")
    return a


def cells(values: dict, marks: dict | None = None) -> str:
    """One row's numbers by category: exact bytes below 10 MB, else rounded (1.23 GB);
    a category in `marks` gets '!' (differs from the estimate)."""
    out = ""
    for c in MEASURED:
        v = values[c]
        text = f"{v:,}" if v < 10 ** 7 else fmt(v)
        out += f"{text + ('!' if marks and c in marks else ''):>{WIDTH[c]}}"
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    data, texts, plans = DATA, a.texts, a.parsed
    cfg = model_config_for(data, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head)
    print(f"demo 22 · memory budget · GPT {cfg.n_layer} layers, C={cfg.n_embd}, "
          f"{cfg.n_head} heads, T={cfg.block_size}, float64 · global batch {a.batch}")
    print("bytes one rank holds: est = the estimate (memory/budget.py), meas = counted in one "
          "step\non real ranks; '!' where meas differs from est")
    print(f"{'plan':<{PLAN}}{'stage':>6}{'':6}" + "".join(f"{c:>{WIDTH[c]}}" for c in MEASURED))
    wrong, ranks = [], 0
    for text, plan in zip(texts, plans):
        rows = compare(cfg, data, plan, a.batch, a.seed)
        ranks += plan.world_size
        if len(text) >= PLAN:                        # a long plan gets a line of its own
            print(text)
        for stage, cats in rows.items():
            differ = {c for c, (e, g) in cats.items() if e != g}
            name = "" if len(text) >= PLAN else text
            print(f"{name:<{PLAN}}{stage:>6}{'est':>6}"
                  + cells({c: e for c, (e, _) in cats.items()}))
            print(f"{'':<{PLAN}}{'':>6}{'meas':>6}"
                  + cells({c: g for c, (_, g) in cats.items()}, differ))
            wrong += [f"{text} stage {stage} {c}" for c in sorted(differ)]
    fig1 = zero_figure1()
    print("\nZeRO Fig. 1 (Ψ = 7.5B on 64 GPUs, bf16 + fp32 Adam, K = 12), GB per GPU:\n  "
          + ", ".join(f"stage {s} {v:.1f}" for s, v in fig1.items())
          + f"  (paper: {', '.join(map(str, PAPER_FIG1))})")
    big = estimate(preset("gpt3-13b"), MemoryPlan(tp=8, sp=True, precision="bf16",
                                                  recompute="selective"), batch=1)
    print("GPT-3 13B, tp=8 + SP, selective recomputation, bf16, 1 x 2048 tokens, per GPU "
          "(estimated):")
    parts = [f"{c} {fmt(v)}" for c, v in big.categories().items()]
    print(f"  {', '.join(parts[:3])},\n  {', '.join(parts[3:])}; total {fmt(big.total)} of an "
          "H200's 141 GB")
    fig_ok = tuple(round(v, 1) for v in fig1.values()) == PAPER_FIG1
    if wrong or not fig_ok:
        print("MISMATCH: " + "; ".join(wrong + ([] if fig_ok else ["ZeRO Fig. 1"])))
        return 1
    print(f"OK: estimated bytes = measured, to the byte, for {len(plans)} "
          f"plan{'s' * (len(plans) > 1)} on {ranks} ranks; ZeRO's Fig. 1 = the paper's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
