"""MoE balancing as trained today: the load-balancing loss against aux-loss-free bias balancing.

What you will see: the routers of nn/routing.py on one routing group of 6 tokens (softmax
top-2, sigmoid top-2 with the gates normalised over the two, sigmoid limited to 1 of 2
expert groups, expert choice): each token's experts and gates. Then the same MoE GPT (8
sigmoid-routed experts per block, top-2, dropless) trained twice on the sort task: with the
load-balancing loss (alpha 0.01), and aux-loss-free (a routing bias moved by +-gamma after
every step from the global batch's load, beside DeepSeek-V3's small sequence-wise loss):
the max violation of every step (max load / mean load - 1, 0 = balanced) as a sparkline,
the bias of block 0 moving, its loads with and without the bias, and the loss and balance
of both runs side by side. Last, the aux-loss-free run's first steps on dp=2 x ep=2 ranks:
its routing biases equal the single process's at every step, because the load they read is
summed over the whole global batch.

Run:       python demos/30_moe_balancing.py [--steps 200 --gamma 0.001 --aux 0.01]
           [--png balance.png]                (or python -m minidist demo moe_balancing)
Read with: minidist/nn/routing.py, minidist/nn/moe.py, minidist/parallel/expert/balancing.py
Paper:     DeepSeek-AI 2024, "DeepSeek-V3", arXiv:2412.19437, Sec. 2.1.2 (sigmoid gates,
           aux-loss-free balancing, sequence-wise loss, node-limited routing);
           Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for
           Mixture-of-Experts", arXiv:2408.15664 (the bias rule, MaxVio);
           Zhou et al. 2022, "Mixture-of-Experts with Expert Choice Routing", arXiv:2202.09368
"""

import argparse

import numpy as np

from minidist import seed as seeding
from minidist.autograd import Tensor
from minidist.baseline import train_single_process
from minidist.cli import CliParser
from minidist.data import DataConfig, model_config_for
from minidist.nn import MoE, RoutingRule
from minidist.nn import routing
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, max_violation, train_on_rank

# --- settings (each can be overridden on the command line) ---
STEPS, BATCH, LR, EXPERTS, TOP_K, N_EMBD, N_LAYER, LENGTH, SEED = 200, 16, 3e-3, 8, 2, 32, 2, 6, 0
AUX, GAMMA, SEQ_ALPHA, LAST, LAYOUT_STEPS, PNG = 0.01, 0.001, 1e-4, 20, 3, ""
LIMITS = dict(steps=(1, 2000), batch=(4, 256), lr=(0.0, 1.0), experts=(2, 32),
              top_k=(1, 8), n_embd=(8, 128), n_layer=(1, 4), length=(2, 12), seed=(0, 2 ** 32),
              aux=(0.0, 1.0), gamma=(0.0, 0.1), seq_alpha=(0.0, 1.0), last=(1, 200),
              layout_steps=(1, 10))
SPARK = " .:-=+*#%@"                            # max violation 0 .. >= 1.8 in ninths


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--png", default=PNG, help="also draw loss, balance and bias into this PNG")
    ap.add_numbers(dict(steps=STEPS, batch=BATCH, lr=LR, experts=EXPERTS, top_k=TOP_K,
                        n_embd=N_EMBD, n_layer=N_LAYER, length=LENGTH, seed=SEED, aux=AUX,
                        gamma=GAMMA, seq_alpha=SEQ_ALPHA, last=LAST,
                        layout_steps=LAYOUT_STEPS), LIMITS)
    a = ap.parse_args(argv)
    if a.top_k > a.experts or a.experts % 2 or a.batch % 2 or a.n_embd % 4:
        ap.error("need --top-k <= --experts, an even --experts and --batch (ep=2, dp=2), "
                 "and --n-embd a multiple of 4 (heads)")
    if a.last > a.steps:
        ap.error(f"--last {a.last} must be <= --steps {a.steps}")
    return a


def show_routers() -> None:
    """One routing group of 6 tokens and 4 experts (2 groups of 2) through each router."""
    moe = MoE(4, 3, n_experts=4, top_k=2, capacity_factor=0)
    seeding.init_parameters(moe, seed=6)
    x = np.random.default_rng(6).normal(size=(6, 4)) * 3
    logits = x @ moe.router.weight.data
    print("part 1: one group of 6 tokens, 4 experts (groups {e0 e1} {e2 e3}), top-2: each "
          "token's\nexperts and gates (softmax: the probabilities; sigmoid: the scores "
          "normalised over the two;\nexpert choice: each expert takes its 3 best tokens, so a "
          "token may get 0 to 4)")
    rules = [("softmax", RoutingRule("softmax")), ("sigmoid", RoutingRule("sigmoid")),
             ("sigmoid, 1 group", RoutingRule("sigmoid", groups=2, limit=1)),
             ("expert choice", RoutingRule("expert-choice"))]
    table = []
    for name, rule in rules:
        s = routing.scores(Tensor(logits), rule.kind)
        r = routing.route_groups(s.data, 2, 6, 1.0 if rule.kind == "expert-choice" else 0,
                                 rule)[0]
        g = routing.gates(s, r, rule.kind).data
        table.append([" ".join(f"e{int(e)} {g[n, k]:.2f}" for k, e in enumerate(r.choice[n])
                               if r.kept[n, k]) or "-" for n in range(6)])
    print(("  token  " + "".join(f"{name:<18}" for name, _ in rules)).rstrip())
    for n in range(6):
        print((f"  t{n}     " + "".join(f"{table[i][n]:<18}" for i in range(len(rules)))
               ).rstrip())


def config(a, bias: bool):
    data = DataConfig(task="sort", length=a.length, seed=a.seed)
    return data, model_config_for(data, n_layer=a.n_layer, n_head=4, n_embd=a.n_embd,
                                  moe_every=1, n_experts=a.experts, top_k=a.top_k,
                                  capacity_factor=0, router="sigmoid", dtype="float32",
                                  aux_loss_coef=a.seq_alpha if bias else a.aux,
                                  bias_rate=a.gamma if bias else 0.0)


def train(a, bias: bool) -> dict:
    """One run: per step the loss, each layer's max violation with and without the bias,
    block 0's bias and (last step) its loads."""
    data, cfg = config(a, bias)
    rec = {"loss": [], "vio": [], "unbiased_vio": [], "bias": []}

    def on_step(step, loss, model):
        layers = [m for _, m in model.named_modules() if hasattr(m, "take_totals")]
        E = a.experts
        totals = [m.take_totals() for m in layers]
        rec["loss"].append(loss)
        rec["vio"].append(np.mean([max_violation(t[:E]) for t in totals]))
        rec["unbiased_vio"].append(np.mean([max_violation(t[2 * E:3 * E]) for t in totals]))
        rec["bias"].append(layers[0].score_bias.copy())
        rec["load"], rec["unbiased_load"] = totals[0][:E], totals[0][2 * E:3 * E]

    train_single_process(cfg, data, steps=a.steps, global_batch=a.batch, lr=a.lr, seed=a.seed,
                         on_step=on_step)
    return rec


def spark(values) -> str:
    return "".join(SPARK[min(9, int(v / 0.2))] for v in values)


def show_training(a) -> tuple[dict, dict]:
    print(f"\npart 2: the same MoE GPT ({a.n_layer} blocks, E={a.experts} sigmoid experts, "
          f"top-{a.top_k}, dropless),\n{a.steps} steps of sort, batch {a.batch}")
    aux, free = train(a, False), train(a, True)
    width = 80
    per = max(1, -(-a.steps // width))
    print(f"max violation per step (mean over blocks; '{SPARK}' = 0 .. 1.8+, "
          f"{per} step{'s' if per > 1 else ''} a character):")
    for name, rec in ((f"aux loss a={a.aux:g}", aux), (f"bias g={a.gamma:g}", free)):
        v = np.array(rec["vio"])
        cells = [v[i:i + per].mean() for i in range(0, len(v), per)]
        print(f"  {name:<16} {spark(cells)}")
    print(f"block 0's bias b (aux-loss-free), every {max(1, a.steps // 5)} steps:")
    for s in range(0, a.steps, max(1, a.steps // 5)):
        print(f"  step {s:4d}  " + " ".join(f"{b:+.3f}" for b in free["bias"][s]))
    print(f"  step {a.steps - 1:4d}  " + " ".join(f"{b:+.3f}" for b in free["bias"][-1]))
    print("block 0's loads at the last step, without the bias -> with it:")
    print("  " + "  ".join(f"e{e} {int(u)}->{int(v)}" for e, (u, v) in
                           enumerate(zip(free["unbiased_load"], free["load"]))))
    return aux, free


def rank_run(ctx, a, cfg, data):
    return train_on_rank(ctx, cfg, data, Plan(dp=2, ep=2),
                         RunConfig(steps=a.layout_steps, global_batch=a.batch, seed=a.seed),
                         OptimizerConfig(lr=a.lr))


def show_layout(a) -> bool:
    """The aux-loss-free run's first steps on dp=2 x ep=2: biases bitwise the same."""
    data, cfg = config(a, True)
    ref = train_single_process(cfg, data, steps=a.layout_steps, global_batch=a.batch,
                               lr=a.lr, seed=a.seed)
    runs = spawn(2, rank_run, a, cfg, data)
    print(f"\npart 3: the aux-loss-free run on dp=2 x ep=2, {a.layout_steps} steps: "
          "block 0's bias after\neach step (1 process), and whether both ranks hold it "
          "bit for bit")
    same = True
    for s, want in enumerate(ref.routing_biases):
        got = [r.routing_biases[s]["blocks.0.moe"] for r in runs]
        equal = all(all(np.array_equal(r.routing_biases[s][n], want[n]) for n in want)
                    for r in runs)
        same &= equal
        print(f"  step {s}  " + " ".join(f"{b:+.3f}" for b in want["blocks.0.moe"])
              + f"  rank 0 = rank 1 = 1 process: {equal and np.array_equal(got[0], got[1])}")
    return same


def save_png(path: str, a, aux: dict, free: dict) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return print("no PNG: matplotlib is missing (pip install -e '.[plot]')")
    fig = Figure(figsize=(13, 3.4), layout="constrained")
    ax = fig.subplots(1, 3)
    for rec, label in ((aux, f"aux loss {a.aux:g}"), (free, f"bias {a.gamma:g}")):
        ax[0].plot(rec["loss"], label=label)
        ax[1].plot(rec["vio"], label=label)
    ax[0].set(title="loss", xlabel="step", yscale="log")
    ax[1].set(title="max violation (max / mean load - 1)", xlabel="step")
    ax[2].plot(np.array(free["bias"]))
    ax[2].set(title="block 0 bias per expert (aux-loss-free)", xlabel="step")
    for x in ax[:2]:
        x.legend()
    fig.savefig(path)
    print(f"plot written to {path}")


def main(argv=None) -> int:
    a = parse_args(argv)
    print(f"demo 30 · MoE balancing · E={a.experts}, top-{a.top_k}: routers on one group, then "
          f"the aux loss\nvs aux-loss-free bias balancing over {a.steps} steps, then the bias "
          f"on dp=2 x ep=2")
    show_routers()
    aux, free = show_training(a)
    last = slice(-a.last, None)
    rows = [(f"aux loss (alpha {a.aux:g})", aux), (f"aux-loss-free (gamma {a.gamma:g})", free)]
    print(f"\nover the last {a.last} steps          loss     max violation   "
          "(without the bias)")
    for name, rec in rows:
        print(f"  {name:<30} {np.mean(rec['loss'][last]):.4f}   {np.mean(rec['vio'][last]):.3f}"
              f"           {np.mean(rec['unbiased_vio'][last]):.3f}")
    same = show_layout(a)
    if a.png:
        save_png(a.png, a, aux, free)
    loss_aux, loss_free = (float(np.mean(r["loss"][last])) for _, r in rows)
    vio_aux, vio_free = (float(np.mean(r["vio"][last])) for _, r in rows)
    if not same:
        print("MISMATCH: the dp=2 x ep=2 routing biases differ from the single process's")
        return 1
    verdict = "OK" if vio_free < vio_aux and loss_free <= loss_aux else "NOT REACHED"
    print(f"{verdict}: aux-loss-free max violation {vio_free:.3f} < aux loss {vio_aux:.3f} at "
          f"loss {loss_free:.4f} <= {loss_aux:.4f}\n(last {a.last} steps); dp=2 x ep=2 biases "
          "= 1 process at every step")
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    raise SystemExit(main())
