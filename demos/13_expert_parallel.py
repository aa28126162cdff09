"""Expert parallelism: a MoE layer's experts split over 2 ranks, tokens sent to them and back.

What you will see: one MoE layer (E=4 experts, top-2, routing groups of 4 tokens, capacity 2
per expert and group) on ep=2 ranks, each with 8 tokens of its own: every token's choices,
the rank holding each expert, what is dropped because its expert was full in that group;
the counts of the first all-to-all, dispatch and combine as BEFORE/AFTER; the outputs next to
the unsharded layer, the bytes sent next to the formula. Then a MoE GPT trained on 2 ranks
(dp=2, ep=2) beside 1 process: losses, a routing heatmap (experts x steps), drops, aux, z.

Run:       python demos/13_expert_parallel.py [--tokens 8 --group 4 --capacity-factor 1.0]
           [--steps 6 --png heatmap.png]      (or python -m minidist demo expert_parallel)
Read with: minidist/nn/moe.py, minidist/parallel/expert/expert_parallel.py, minidist/train.py
Paper:     Lepikhin et al. 2020, "GShard", arXiv:2006.16668, Sec. 2.2 (groups, capacity);
           Fedus et al. 2021, "Switch Transformers", arXiv:2101.03961, Sec. 2.2 (aux loss);
           Zoph et al. 2022, "ST-MoE", arXiv:2202.08906, Sec. 3.1 (router z-loss)
"""

import argparse
import textwrap

import numpy as np

from minidist import seed as seeding
from minidist.autograd import Tensor
from minidist.autograd import functional as F
from minidist.baseline import train_single_process
from minidist.cli import CliParser
from minidist.data import DataConfig, model_config_for
from minidist.nn.moe import MoE
from minidist.parallel.expert.expert_parallel import ExpertParallelMoE
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank

# --- settings (each can be overridden on the command line) ---
EP, EXPERTS, TOP_K, TOKENS, GROUP, CAPACITY_FACTOR, C, HIDDEN, SEED = 2, 4, 2, 8, 4, 1.0, 6, 8, 0
STEPS, GLOBAL_BATCH, LR, N_LAYER, N_EMBD, N_HEAD, LENGTH, Z_LOSS = 6, 8, 1e-2, 2, 32, 2, 6, 1e-3
PNG, RAMP = "", " .:-=+*#%@"                   # RAMP: share of tokens 0.0 .. 1.0 in tenths
# each number option's (low, high): the demo stays small, a step a column of the heatmap
LIMITS = dict(ep=(1, 8), experts=(1, 16), top_k=(1, 16), tokens=(1, 64), group=(1, 64),
              capacity_factor=(0.01, 16.0), c=(1, 256), hidden=(1, 1024), seed=(0, 2 ** 32),
              steps=(1, 10), global_batch=(1, 512), lr=(0.0, 1.0), n_layer=(1, 8),
              n_embd=(1, 256), n_head=(1, 64), length=(1, 16), z_loss=(0.0, 1.0))
WIDTH = 100                                     # characters a line


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--png", default=PNG, help="also draw the heatmap into this PNG file")
    ap.add_numbers(dict(ep=EP, experts=EXPERTS, top_k=TOP_K, tokens=TOKENS, group=GROUP,
                        capacity_factor=CAPACITY_FACTOR, c=C, hidden=HIDDEN, seed=SEED,
                        steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR, n_layer=N_LAYER,
                        n_embd=N_EMBD, n_head=N_HEAD, length=LENGTH,
                        z_loss=Z_LOSS), LIMITS)
    a = ap.parse_args(argv)
    if a.experts % a.ep or a.top_k > a.experts:
        ap.error(f"need --experts a multiple of --ep {a.ep} and --top-k <= --experts")
    if a.n_embd % a.n_head:
        ap.error(f"--n-embd {a.n_embd} is not a multiple of --n-head {a.n_head}")
    if a.global_batch % a.ep:
        ap.error(f"--global-batch {a.global_batch} must be a multiple of --ep {a.ep} (dp = ep "
                 "in part 2)")
    try:
        data_cfg, cfg = training_config(a)
        Plan(dp=a.ep, ep=a.ep).validate(cfg, a.global_batch, data_cfg.block_size)
    except ValueError as e:
        ap.error(str(e))
    return a


def training_config(a):
    """(DataConfig, GPTConfig) of part 2: a GPT whose every block is a MoE."""
    data_cfg = DataConfig(task="sort", length=a.length, seed=a.seed)
    return data_cfg, model_config_for(data_cfg, n_layer=a.n_layer, n_head=a.n_head,
                                      n_embd=a.n_embd, moe_every=1, n_experts=a.experts,
                                      top_k=a.top_k, dtype="float64",
                                      capacity_factor=a.capacity_factor, z_loss_coef=a.z_loss)


def fill(text: str, indent: str = "    ") -> str:
    """`text` in lines of at most WIDTH characters, the later ones indented."""
    return textwrap.fill(text, WIDTH, subsequent_indent=indent)


def make_moe(a) -> MoE:
    # grouped=False: the plain loop, one call per expert (part 1 records each call's rows);
    # the grouped fast path (nn/grouped_experts.py) gives the same bits in one node
    moe = MoE(a.c, a.hidden, n_experts=a.experts, top_k=a.top_k, group_size=a.group,
              capacity_factor=a.capacity_factor, z_loss_coef=a.z_loss, grouped=False)
    seeding.init_parameters(moe, seed=a.seed)          # the same weights on every rank
    return moe


def tokens_of_rank(a, rank: int) -> np.ndarray:
    return np.random.default_rng([a.seed, rank]).standard_normal((a.tokens, a.c))   # (N, C)


def rank_layer(ctx, a) -> dict:
    """Every ep rank: its own tokens through the expert-parallel layer, forward + backward."""
    g, seen = ctx.world, {}
    ep = ExpertParallelMoE(make_moe(a), g)
    for e in range(g.rank * ep.per_rank, (g.rank + 1) * ep.per_rank):    # my experts
        def record(x, e=e, forward=ep.experts[e].forward):
            seen[e] = x.data.copy()              # the rows expert e received (n_e, C)
            return forward(x)
        ep.experts[e].forward = record
    before = g.stats["bytes_sent"]
    out, aux = ep(Tensor(tokens_of_rank(a, g.rank)[None], requires_grad=True))   # (1, N, C)
    (out.sum() + aux).backward()                # the backward sends the same rows back
    return dict(out=out.data[0], routing=ep.last_routing, seen=seen,
                sent=g.stats["bytes_sent"] - before, formula=ep.take_traffic(8))


def show_layer(a, res: list[dict]) -> list[str]:
    """Part 1: routing, drops, the three all-to-alls, and the checks; returns problems."""
    W, E, G, per, problems = a.ep, a.experts, a.group, a.experts // a.ep, []
    xs, ref = [tokens_of_rank(a, r) for r in range(W)], make_moe(a)
    ids = [[r["routing"].tokens_of(e) for e in range(E)] for r in res]   # [rank][expert]
    mine = lambda s: range(s * per, (s + 1) * per)     # noqa: E731  (the experts of rank s)
    print(f"== 1. one MoE layer, E={E}, top-{a.top_k}, on ep={W} ranks: rank r holds experts "
          f"{per}r .. {per}r+{per - 1} ==\ncapacity per expert and routing group of {G} tokens ="
          f" min(G, ceil({a.capacity_factor} K G / E)) = {res[0]['routing'].capacity};\n"
          "a group admits all 1st choices, then all 2nd choices, ...")
    for r, rt in enumerate(out["routing"] for out in res):
        probs = F.softmax(ref.router(Tensor(xs[r])), axis=-1).data                # (N, E)
        print(f"rank {r}: tokens t0-t{a.tokens - 1}, choices best first: expert@rank (gate)")
        for n, choice in enumerate(rt.choice):
            cells = [f"e{e}@r{e // per} ({probs[n, e]:.3f})" for e in choice]
            for k in np.flatnonzero(~rt.kept[n]):
                held = [f"t{m} (choice {list(rt.choice[m]).index(choice[k]) + 1})"
                        for m in ids[r][choice[k]] if m // G == n // G]
                cells[k] += f" DROPPED: e{choice[k]} full in group {n // G}: {', '.join(held)}"
            line = f"  t{n}: " + " | ".join(cells)
            print(line if len(line) <= WIDTH else fill(line, " " * 6))
    print(f"all_to_all 1, counts: kept rows per expert; rank s gets those of its {per} experts")
    for r in range(W):
        print(fill(f"  rank {r} counts e0..e{E - 1} {[len(i) for i in ids[r]]} -> " + ", ".join(
            f"rank {s} gets {[len(ids[r][e]) for e in mine(s)]}" for s in range(W))))
    print("all_to_all 2, dispatch. BEFORE: each rank's send buffer, expert-major, slot order")
    for r in range(W):
        print(fill(f"  rank {r} " + " | ".join(f"to r{s}{' (stays)' * (s == r)}: " + " ".join(
            "e%d[%s]" % (e, " ".join(f"t{n}" for n in ids[r][e])) for e in mine(s))
            for s in range(W))))
    print("  AFTER: the rows each local expert received, source rank by source rank")
    for r, e in ((r, e) for r in range(W) for e in mine(r)):
        got = ["r%d:t%d" % tuple(np.argwhere((np.stack(xs) == row).all(-1))[0])
               for row in res[r]["seen"][e]]                 # found among all ranks' tokens
        want = [f"r{s}:t{n}" for s in range(W) for n in ids[s][e]]
        problems += [f"e{e} received {got}, not {want}"] * (got != want)
        print(fill(f"  rank {r} e{e} <- {' '.join(got)}", " " * 14))
    print("all_to_all 3, combine: results go back to the sender in its send order, then\n"
          "  out[n] = sum_k gate[n, k] row(n, k); a dropped (n, k) adds 0")
    for r in range(W):
        print(fill(f"  rank {r} gets back " + ", ".join(
            f"{sum(len(ids[r][e]) for e in mine(s))} rows from r{s}" for s in range(W))))
    for r, out in enumerate(res):
        delta = float(np.abs(out["out"] - ref(Tensor(xs[r][None]))[0].data[0]).max())
        S = sum(len(ids[r][e]) for s in range(W) if s != r for e in mine(s))
        R = sum(len(ids[s][e]) for s in range(W) if s != r for e in mine(r))
        print(f"rank {r}: out vs unsharded MoE max |Δ| = {delta:.1e}\n  ep bytes sent, fwd + bwd:"
              f" {out['sent']}, take_traffic 2 (S={S} + R={R}) C 8 + (W-1) E/W 8 = "
              f"{out['formula']}")
        problems += [f"rank {r}: outputs differ by {delta:.1e}"] * (delta > 1e-13)
        problems += [f"rank {r}: sent {out['sent']} B != {out['formula']} B"] * (
            out["sent"] != out["formula"])
    return problems


def rank_train(ctx, a, cfg, data_cfg):
    plan = Plan(dp=a.ep, ep=a.ep)                 # the ep ranks are the dp ranks
    return train_on_rank(ctx, cfg, data_cfg, plan,
                         RunConfig(steps=a.steps, global_batch=a.global_batch, seed=a.seed),
                         OptimizerConfig(lr=a.lr))


def show_training(a) -> float:
    """Part 2: dp+ep training beside 1 process, the routing per step; returns max |Δ|."""
    data_cfg, cfg = training_config(a)
    print(f"\n== 2. GPT, {cfg.n_layer} MoE blocks, on {a.ep} ranks, dp={a.ep} and ep={a.ep} (the "
          f"dp ranks share out the experts),\nvs 1 process; global batch {a.global_batch}, "
          f"routing groups of {cfg.block_size} tokens; ep: bytes a rank's all-to-alls sent ==")
    base = train_single_process(cfg, data_cfg, steps=a.steps, global_batch=a.global_batch,
                                lr=a.lr, seed=a.seed)
    runs = spawn(a.ep, rank_train, a, cfg, data_cfg)
    for s, (x, y) in enumerate(zip(runs[0].losses, base.losses)):
        print(f"step {s} | loss dp+ep {x:.15f} | 1 process {y:.15f} | |Δ| {abs(x - y):.1e} "
              f"| ep {runs[0].bytes_by_axis[s]['ep']:,} B")
    per, moe, shares = a.experts // a.ep, runs[0].moe, {}   # moe[step][layer], over dp
    print(f"routing heatmap, experts x steps: share of the tokens routed to each (before drops;"
          f"\ntop-{a.top_k}: they sum to {a.top_k}) as '{RAMP}' = 0.0 .. 1.0, then numbers")
    for n in moe[0]:
        shares[n] = share = np.array([[a.top_k * v / sum(st[n]["load"]) for v in st[n]["load"]]
                                      for st in moe]).T                         # (E, steps)
        print(f"  {n}, steps 0..{a.steps - 1}")
        for e, row in enumerate(share):
            cells = "".join(RAMP[min(9, int(10 * v))] for v in row)      # one char a step
            print(f"    expert {e} (r{e // per})  {cells} " + " ".join(f"{v:5.2f}" for v in row))
        for what, fmt in (("drop_rate", "{:5.1%}"), ("aux", "{:5.3f}"), ("z", "{:5.3f}")):
            print(f"    {what:<{a.steps + 17}}" + " ".join(fmt.format(st[n][what]) for st in moe))
    if a.png:
        save_png(a.png, shares)
    return max(abs(x - y) for r in runs for x, y in zip(r.losses, base.losses))


def save_png(path: str, shares: dict) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return print("no PNG: matplotlib is missing (pip install -e '.[plot]')")
    fig = Figure(figsize=(4 * len(shares), 3), layout="constrained")
    for ax, (name, share) in zip(fig.subplots(1, len(shares), squeeze=False)[0], shares.items()):
        ax.set(title=name, xlabel="step", ylabel="expert", xticks=range(share.shape[1]),
               yticks=range(share.shape[0]))
        fig.colorbar(ax.imshow(share, vmin=0, vmax=1, aspect="auto"), ax=ax, label="share")
    fig.savefig(path)
    print(f"heatmap written to {path}")


def main(argv=None) -> int:
    a = parse_args(argv)
    print(f"demo 13 · expert parallel · E={a.experts}, top-{a.top_k}, ep={a.ep}: one layer "
          f"by hand,\nthen training with dp={a.ep}, ep={a.ep} vs 1 process")
    problems = show_layer(a, spawn(a.ep, rank_layer, a))
    worst = show_training(a)
    if worst > 1e-12 or problems:
        print(f"MISMATCH: {'; '.join(problems) or f'losses differ by {worst:.1e}'}")
        return 1
    print(f"OK: ep={a.ep} layer = unsharded MoE, bytes = take_traffic, dp+ep losses = 1 process "
          f"(max |Δ| = {worst:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
