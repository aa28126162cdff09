"""Memory budget: every byte of a training step, estimated before it runs and counted after.

What you will see: a tiny GPT (float64) taking one training step under several plans on
real ranks: data parallelism with ZeRO 0-3, tensor parallelism with sequence parallelism,
a 1F1B pipeline, context parallelism, selective and full recomputation. Per plan and
pipeline stage, the bytes one rank holds by category, as the estimator predicts them
(memory/budget.py); a cell is marked `!=` where the step's own count differs (params,
grads, optimizer and ZeRO's buffers from engine.memory(), activations and the
recomputation's rebuilt arrays from the autograd graph). Then the ZeRO paper's Fig. 1
through the same formulas, and what one GPU holds for GPT-3 13B in bf16.

Run:       python demos/22_memory_budget.py [--plans "dp=2,zero=3;tp=2,sp=1"] [--n-layer 2]
           (the same, one plan: python -m minidist memory --plan dp=2,zero=3 --measure)
Read with: minidist/memory/budget.py, minidist/memory/budget_measure.py,
           minidist/parallel/zero/memory.py, minidist/parallel/tensor/memory.py
Paper:     Rajbhandari et al. 2020, "ZeRO", arXiv:1910.02054, Sec. 5 and Fig. 1;
           Korthikanti et al. 2022, arXiv:2205.05198, Table 2 and Sec. 5 (selective)
"""

import argparse
import textwrap

from minidist.cli import CliParser, like
from minidist.data import DataConfig, model_config_for
from minidist.memory.budget import MemoryPlan, estimate, zero_figure1
from minidist.memory.budget_cli import fmt, parse_plan
from minidist.memory.budget_measure import MEASURED, compare
from minidist.memory.budget_models import preset

# --- settings (each can be overridden on the command line) ---
PLANS = ("dp=2;dp=2,zero=1;dp=2,zero=2;dp=4,zero=3;tp=2,sp=1;pp=2,mb=4;cp=2;"
         "recompute=selective;dp=2,recompute=full")
N_LAYER, N_EMBD, N_HEAD, BATCH, SEED = 2, 32, 4, 8, 0
PAPER_FIG1 = (120, 31.4, 16.6, 1.9)                 # GB per device, ZeRO stages 0-3


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default=PLANS, help="plans separated by ';' (memory --plan)")
    for name, value in dict(n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD, batch=BATCH,
                            seed=SEED).items():
        ap.add_argument("--" + name.replace("_", "-"), type=like(value, name), default=value)
    return ap.parse_args(argv)


def cell(value) -> str:
    """A byte count, or "-" where the step does not measure it (ZeRO-3's own recompute)."""
    return "-" if value is None else f"{value:,}"


def main(argv=None) -> int:
    a = parse_args(argv)
    data = DataConfig(task="sort", length=6)
    cfg = model_config_for(data, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head)
    texts = [text.strip() for text in a.plans.split(";") if text.strip()]
    plans = [parse_plan(text) for text in texts]
    print(f"demo 22 · memory budget · GPT {cfg.n_layer} layers, C={cfg.n_embd}, "
          f"{cfg.n_head} heads, T={cfg.block_size}, float64 · global batch {a.batch}\n"
          "bytes per rank: each plan's estimate, and under it one step measured on its ranks "
          "(- : not\nmeasured, ZeRO-3 recomputes on its own)")
    print(f"{'plan':<20}{'stage':>6}" + "".join(f"{c:>12}" for c in MEASURED))
    wrong, ranks = [], 0
    for text, plan in zip(texts, plans):
        rows = compare(cfg, data, plan, a.batch, a.seed)
        ranks += plan.world_size
        for stage, cats in rows.items():
            print(f"{text:<20}{stage:>6}" + "".join(f"{cats[c][0]:>12,}" for c in MEASURED))
            print(f"{'  measured':<26}" + "".join(f"{cell(cats[c][1]):>12}" for c in MEASURED))
            wrong += [f"{text} stage {stage} {c}" for c, (e, g) in cats.items()
                      if g is not None and e != g]
    fig1 = zero_figure1()
    print("\n" + "\n".join(textwrap.wrap(
        "ZeRO Fig. 1 (Ψ = 7.5B on 64 GPUs, bf16 + fp32 Adam, K = 12), GB per GPU: "
        + ", ".join(f"stage {s} {v:.1f}" for s, v in fig1.items())
        + f" (paper: {', '.join(map(str, PAPER_FIG1))})", 100, subsequent_indent="  ")))
    big = estimate(preset("gpt3-13b"), MemoryPlan(tp=8, sp=True, precision="bf16",
                                                  recompute="selective"), batch=1)
    print("\n".join(textwrap.wrap(
        "GPT-3 13B, tp=8 + SP, selective recomputation, bf16, 1 x 2048 tokens, per GPU: "
        + ", ".join(f"{c} {fmt(v)}" for c, v in big.categories().items())
        + f"; total {fmt(big.total)} of an H200's 141 GB", 100, subsequent_indent="  ")))
    fig_ok = tuple(round(v, 1) for v in fig1.values()) == PAPER_FIG1
    if wrong or not fig_ok:
        print("MISMATCH: " + "; ".join(wrong + ([] if fig_ok else ["ZeRO Fig. 1"])))
        return 1
    print(f"OK: estimate = measured for {len(plans)} plan{'s' * (len(plans) > 1)} on {ranks} "
          "ranks, every category to the byte; ZeRO's Fig. 1 too")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
