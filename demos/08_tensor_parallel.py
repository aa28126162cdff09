"""Tensor parallelism (Megatron) on W ranks, checked against a 1-process run.

What you will see: which piece of each weight of block 0 every rank holds (the fused qkv
weight: columns of EACH of q, k and v); block 0's forward on every rank, with the shape
and placement of what enters and leaves f, the column-parallel layer, the row-parallel
layer and g, and the row layer's partial sums adding up to the 1-process value; the
vocabulary-parallel loss on a padded vocabulary (each rank's rows, the padding, the three
all-reduced quantities of one token, the loss next to the unsharded F.cross_entropy); then
a few float64 training steps next to the 1-process run.

Run:       python demos/08_tensor_parallel.py --tp 2 [--tp 3 or 4, --steps 3]
Read with: minidist/parallel/tensor/tensor_parallel.py, vocab.py, placement.py, minidist/train.py
Paper:     Shoeybi et al. 2019, "Megatron-LM", arXiv:1909.08053, Sec. 3 and Fig. 3
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")           # one BLAS thread per rank

import argparse                                # noqa: E402
import textwrap                                # noqa: E402
from dataclasses import dataclass, field       # noqa: E402

import numpy as np                             # noqa: E402

from minidist import collectives as C                                   # noqa: E402
from minidist.autograd import functional as F                           # noqa: E402
from minidist.baseline import train_single_process                      # noqa: E402
from minidist.cli import CliParser                                      # noqa: E402
from minidist.data import DataConfig, SyntheticData, model_config_for   # noqa: E402
from minidist.nn import GPT                                             # noqa: E402
from minidist.parallel import placement as pl                           # noqa: E402
from minidist.parallel.tensor.tensor_parallel import (TensorParallel, apply_tensor,  # noqa: E402
                                                      vocab_range)
from minidist.parallel.tensor.vocab import vocab_parallel_cross_entropy        # noqa: E402
from minidist.runtime.launch import spawn                               # noqa: E402
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank  # noqa: E402

# --- settings (each can be overridden on the command line) ---
TP, STEPS, GLOBAL_BATCH, SHOW_BATCH, LR, SEED = 2, 3, 8, 2, 3e-3, 0
N_LAYER, N_EMBD, N_HEAD, LENGTH = 2, 48, 12, 6        # 12 heads: tp 2, 3, 4 or 6 divide them
SHOWN = ("wte.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
         "mlp.fc.weight", "mlp.proj.weight")
STAGES = ("f", "column", "inside", "row @", "g")
LEGEND = """  f       forward: identity; backward: all-reduce of dx (B·T·C numbers)
  column  x @ W[C, F_tp] (+ b): this rank's output features, no communication
  inside  attention of my heads / GELU of my features: they are whole, no communication
  row @   x[B, T, F_tp] @ W[F_tp, C]: a partial sum over my features {U_tp}
  g       forward: all-reduce (B·T·C numbers), then + bias; backward: identity"""


# each number option's (low, high): the demo stays small
LIMITS = dict(tp=(1, 8), steps=(1, 10_000), global_batch=(1, 512), lr=(0.0, 1.0),
              seed=(0, 2 ** 32), n_layer=(1, 8), n_embd=(1, 256), n_head=(1, 64),
              length=(1, 16))


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(tp=TP, steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR, seed=SEED,
                        n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD,
                        length=LENGTH), LIMITS)
    a = ap.parse_args(argv)
    if a.n_embd % a.n_head:
        ap.error(f"--n-embd {a.n_embd} is not a multiple of --n-head {a.n_head}")
    data_cfg = DataConfig(task="sort", length=a.length, seed=a.seed)
    cfg = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head)
    try:
        Plan(tp=a.tp).validate(cfg, a.global_batch, data_cfg.block_size)
    except ValueError as e:
        ap.error(str(e))
    return a


@dataclass(frozen=True)
class TracedTP(TensorParallel):
    """TensorParallel that writes down (input, output) of f and g; traced() adds layers."""
    log: list = field(default_factory=list, compare=False)

    def enter(self, x):
        self.log.append((x, super().enter(x)))
        return self.log[-1][1]

    def exit(self, y):
        self.log.append((y, super().exit(y)))
        return self.log[-1][1]

    def traced(self, layer) -> None:
        """From now on, `layer` also writes (input, output) of each forward into the log."""
        forward = layer.forward

        def logged(x):
            self.log.append((x, forward(x)))
            return self.log[-1][1]
        layer.forward = logged


def desc(t) -> str:
    """'(B, T, C) Placement' of an activation (check mode tags it; untagged = Replicate)."""
    return f"{str(tuple(t.shape)):12s} {str(pl.placement_tag(t, 'tp') or pl.Replicate()):11s}"


def sublayer(tp, part, fn, x) -> tuple:
    """x + fn(x), and one line per stage: what enters and leaves f, column, row and g."""
    tp.log.clear()
    out = x + fn(x)
    (f_in, f_out), (_, col), (g_in, g_out), (row_in, row_out) = tp.log   # order of return
    ends = [(f_in, f_out), (f_out, col), (col, row_in), (row_in, g_in), (g_in, g_out)]
    lines = [f"  {part if i == 0 else '':4s} {STAGES[i]:6s} {desc(a)} -> {desc(b)}".rstrip()
             for i, (a, b) in enumerate(ends)]
    return out, lines, (float(g_in.data[0, 0, 0]), float(row_out.data[0, 0, 0]))


def vocab_loss(group, logits, y, V: int) -> dict:
    """The three all-reduced quantities by hand, the mean loss, and this rank's numbers."""
    lo, hi = vocab_range(V, TensorParallel(group))
    z = logits.numpy().reshape(-1, hi - lo)                # (N, V_tp)
    z = np.where(lo + np.arange(hi - lo) >= V, -np.inf, z)       # padding: never counted
    t = y.reshape(-1)
    counted, mine = t != -100, (t >= lo) & (t < hi)
    m_loc = z.max(1)
    m = C.all_reduce(m_loc, op="max", group=group)                          # (N,)
    s_loc = np.exp(z - m[:, None]).sum(1)
    s = C.all_reduce(s_loc, group=group)                                    # (N,)
    zt_loc = np.where(mine, z[np.arange(len(t)), np.where(mine, t - lo, 0)], 0.0)
    zt = C.all_reduce(zt_loc, group=group)                                  # (N,)
    k = int(np.argmax(counted))                            # the first counted token
    return dict(k=k, t=int(t[k]), lo=lo, hi=hi, n=int(counted.sum()), total=(m[k], s[k], zt[k]),
                local=(m_loc[k], s_loc[k], zt_loc[k]),
                by_hand=float(((np.log(s) + m - zt) * counted).sum() / counted.sum()))


def rank_main(ctx, cfg, data_cfg, args):
    """Everything here runs on every rank; ctx.rank says which one we are."""
    pl.set_checking(True)                                  # tag every activation's placement
    tp = TracedTP(ctx.world)
    model = apply_tensor(GPT(cfg, args.seed), tp)          # full draw, then keep my slices
    pieces = {n: (p.numpy(), pl.placement_of(p, "tp")) for n, p in model.named_parameters()}
    blk = model.blocks[0]
    for layer in (blk.attn.qkv, blk.attn.proj, blk.mlp.fc, blk.mlp.proj):
        tp.traced(layer)
    x, y = SyntheticData(data_cfg).global_batch(0, SHOW_BATCH)         # (B, T) each
    h = model.embed(x)                                     # (B, T, C) Replicate (after g)
    h, attn, partial = sublayer(tp, "attn", lambda a: blk.attn(blk.ln_1(a)), h)
    h, mlp, _ = sublayer(tp, "mlp", lambda a: blk.mlp(blk.ln_2(a)), h)
    show = dict(flow=attn + mlp, partial=partial, block=h.numpy())
    for b in list(model.blocks)[1:]:
        h, _ = b(h)
    logits = model.head(h)                                 # (B, T, V_tp) Shard(2)
    show["loss"] = vocab_loss(ctx.world, logits, y, cfg.vocab_size)
    show["loss"]["lib"] = vocab_parallel_cross_entropy(logits, y, tp, cfg.vocab_size).item() \
        / show["loss"]["n"]
    run = train_on_rank(ctx, cfg, data_cfg, Plan(tp=ctx.world_size, check_placements=True),
                        RunConfig(steps=args.steps, global_batch=args.global_batch, seed=args.seed),
                        OptimizerConfig(lr=args.lr))
    return pieces, show, run


def span(lo: int, hi: int) -> str:
    """[lo, hi) as text: 'lo-last', 'lo' or 'none'."""
    return f"{lo}-{hi - 1}" if hi > lo + 1 else f"{lo}" if hi > lo else "none"


def holds(p: pl.Shard, shape: tuple, W: int, r: int) -> str:
    """Which rows / columns of the full weight (of `shape`) rank r's piece of it is."""
    n, k = shape[p.dim], p.blocks
    L, parts = pl.piece_length(n, W, k), []
    for b in range(k):
        lo, hi = b * n // k + r * L, b * n // k + min((r + 1) * L, n // k)   # [lo, hi)
        pad = f" + {lo + L - max(hi, lo)} padding (zeros)" if lo + L > hi else ""
        parts.append(("qkv"[b] + " " if k == 3 else "") + span(lo, hi) + pad)
    return ("entries " if len(shape) == 1 else ("rows ", "columns ")[p.dim]) + ", ".join(parts)


def reference(cfg, data_cfg, seed) -> dict:
    """The same block 0 and loss in one process, on the whole model."""
    model, (x, y) = GPT(cfg, seed), SyntheticData(data_cfg).global_batch(0, SHOW_BATCH)
    blk, h = model.blocks[0], model.embed(x)
    attn = blk.attn(blk.ln_1(h))                           # (B, T, C)
    h = h + attn
    h = h + blk.mlp(blk.ln_2(h))
    out = dict(attn=float(attn.data[0, 0, 0]), block=h.numpy())
    for b in list(model.blocks)[1:]:
        h, _ = b(h)
    return dict(out, loss=F.cross_entropy(model.head(h), y).item(), T=x.shape[1])


def show_pieces(runs, full: dict, W: int) -> bool:
    """Each shown weight: placement, piece shape, what every rank holds; True if exact."""
    print("block 0's weights over tp: placement, piece shape on every rank, which part of "
          "the full weight")
    for key in [k if k.startswith("wte") else "blocks.0." + k for k in SHOWN]:
        piece, place = runs[0][0][key]
        print(f"  {key:26s} {place!s:19s} {piece.shape!s:9s} of {full[key].shape}")
        for r in range(W):
            print(f"      rank {r}: {holds(place, full[key].shape, W, r)}")
    print(textwrap.fill("Replicate (a full copy on every rank): " + ", ".join(
        n.replace("blocks.0.", "") for n, (_, p) in runs[0][0].items()
        if isinstance(p, pl.Replicate) and n.startswith(("blocks.0.", "wpe", "ln_f"))),
        width=96, initial_indent="  ", subsequent_indent="    "))
    exact = all(np.array_equal(pl.shard(full[n], p, W, r), a)
                for r, run in enumerate(runs) for n, (a, p) in run[0].items())
    print(f"  every piece is exactly its slice of the 1-process weight, padded with 0: {exact}")
    return exact


def show_flow(runs, ref, cfg, W: int) -> float:
    """Per rank, what enters and leaves f, column, row and g; returns max |Δ| of block 0."""
    H, Fh = cfg.n_head // W, cfg.mlp_ratio * cfg.n_embd // W
    print(f"block 0 forward, B={SHOW_BATCH}, T={ref['T']}, C={cfg.n_embd}, per rank: "
          f"(shape, placement over tp) in -> out\n{LEGEND}")
    for r, run in enumerate(runs):
        print(f"rank {r}: heads {span(r * H, (r + 1) * H)}, MLP features "
              f"{span(r * Fh, (r + 1) * Fh)}\n" + "\n".join(run[1]["flow"]))
    parts = [run[1]["partial"] for run in runs]
    print("attention output [0, 0, 0]: the row layer's partial sums, rank by rank,\n  "
          + " ".join(f"{p:+.6f}" for p, _ in parts)
          + f" add up to {sum(p for p, _ in parts):+.6f}")
    print("  after g every rank holds " + " ".join(f"{w:+.6f}" for _, w in parts)
          + f"\n  1 process                {ref['attn']:+.6f}")
    worst = max(float(np.max(np.abs(run[1]["block"] - ref["block"]))) for run in runs)
    print(f"block 0 output, every rank vs 1 process: max |Δ| = {worst:.1e}")
    return worst


def show_vocab(runs, ref, W: int, V: int) -> float:
    """Each rank's vocabulary rows, one token's three all-reduces, the loss; returns max |Δ|."""
    L = runs[0][1]["loss"]
    print(f"vocabulary-parallel loss: V = {V} over tp = {W}: V_tp = ceil({V}/{W}) = "
          f"{L['hi'] - L['lo']} rows of wte per rank\n  (= columns of the tied LM head), "
          f"padded V = {W * (L['hi'] - L['lo'])}")
    for r, run in enumerate(runs):
        lo, hi = run[1]["loss"]["lo"], run[1]["loss"]["hi"]
        pad = f" + padding {span(max(lo, V), hi)}: zero rows, logits set to -inf" * (hi > V)
        print(f"  rank {r}: token ids {span(lo, min(hi, V))}{pad}")
    b, t = divmod(L["k"], ref["T"])
    print(f"token (b={b}, t={t}), target {L['t']}: 3 all-reduces over tp, of N = B·T = "
          f"{SHOW_BATCH * ref['T']} numbers each; z = my logits")
    print(f"  {'':10s} {'m = max z':>10s} {'s = Σ exp(z - m)':>17s} {'z[target]':>10s}")
    for r, run in enumerate(runs):
        m, s, zt = run[1]["loss"]["local"]
        mine = "  (target is mine)" * (run[1]["loss"]["lo"] <= L["t"] < run[1]["loss"]["hi"])
        print(f"  rank {r:<5d} {m:+10.6f} {s:17.6f} {zt:+10.6f}{mine}")
    m, s, zt = L["total"]
    print(f"  {'all-reduce':10s} {m:+10.6f} {s:17.6f} {zt:+10.6f}  (max, sum, sum)\n"
          f"  this token's loss = log s + m - z[target] = {np.log(s) + m - zt:.6f}")
    worst = max(abs(run[1]["loss"][k] - ref["loss"]) for run in runs for k in ("by_hand", "lib"))
    print(f"loss = mean of log s + m - z[target] over the {L['n']} counted tokens:")
    for label, v in (("by hand (every rank)", L["by_hand"]),
                     ("vocab_parallel_cross_entropy (every rank)", L["lib"]),
                     (f"unsharded F.cross_entropy, logits ({SHOW_BATCH}, {ref['T']}, {V})",
                      ref["loss"])):
        print(f"  {label:46s} {v:.15f}")
    print(f"  max |Δ| over ranks = {worst:.1e}")
    return worst


def main(argv=None) -> int:
    args = parse_args(argv)
    W, data_cfg = args.tp, DataConfig(task="sort", length=args.length, seed=args.seed)
    cfg = model_config_for(data_cfg, n_layer=args.n_layer, n_embd=args.n_embd,
                           n_head=args.n_head, dtype="float64")
    print(f"demo 08 · tensor parallel · tp={W} · GPT {cfg.n_layer} layers, C={cfg.n_embd}, "
          f"H={cfg.n_head}, F={cfg.mlp_ratio * cfg.n_embd}, V={cfg.vocab_size} · float64")
    runs = spawn(W, rank_main, cfg, data_cfg, args)
    ref = reference(cfg, data_cfg, args.seed)
    exact = show_pieces(runs, GPT(cfg, args.seed).state_dict(), W)
    worst = max(show_flow(runs, ref, cfg, W), show_vocab(runs, ref, W, cfg.vocab_size))
    base = train_single_process(cfg, data_cfg, steps=args.steps, global_batch=args.global_batch,
                                lr=args.lr, seed=args.seed)
    for s, (a, b) in enumerate(zip(runs[0][2].losses, base.losses)):
        print(f"step {s} | loss tp={W} {a:.15f} | 1 process {b:.15f} | |Δ| {abs(a - b):.1e}")
        worst = max(worst, abs(a - b))
    d_param = max(float(np.max(np.abs(runs[0][2].params[k] - v))) for k, v in base.params.items())
    print(f"final parameters, gathered over tp, vs 1 process: max |Δ| = {d_param:.1e}")
    ok = exact and max(worst, d_param) < 1e-10
    print(f"{'OK' if ok else 'MISMATCH'}: tp={W} = 1 process (max |Δ| = {max(worst, d_param):.1e})"
          ": training, block 0, the vocab-parallel loss, every piece")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
