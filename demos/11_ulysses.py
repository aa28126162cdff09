"""DeepSpeed-Ulysses on cp ranks: two all-to-alls swap sequence shards for head shards.

What you will see: per rank, the shape of what it holds and which heads and global positions
that is, at four points: before the first all-to-all (all H heads, my positions), after it
(my H/cp heads, all T positions, in source-rank order), after attention on those heads, and
after the second all-to-all (all heads again, my positions), each checked against the same
slice of the 1-process tensor; the bytes each all-to-all sends next to the formula; the
real ulysses_attention's output and dQ, dK, dV next to attention_core on the whole
sequence; a few float64 training steps with Plan(cp=W, cp_algo="ulysses") next to 1 process.

Run:       python demos/11_ulysses.py [--cp 2 (or 3, 4)] [--layout zigzag|contiguous]
Read with: minidist/parallel/context/ulysses.py, context_parallel.py,
           minidist/collectives/all_to_all.py
Paper:     Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv:2309.14509, Sec. 3.1 and Fig. 2
"""

import argparse
import textwrap

import numpy as np

from minidist.autograd import Tensor
from minidist.baseline import train_single_process
from minidist.cli import CliParser
from minidist.data import DataConfig, model_config_for
from minidist.nn.attention import attention_core
from minidist.nn.layers import Dropout
from minidist.parallel.context.ring_attention import LAYOUTS, sequence_layout
from minidist.parallel.context.ulysses import heads_to_seq, seq_to_heads, ulysses_attention
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank

# --- settings (each can be overridden on the command line; T = 0: 4 cp, H = 0: 2 cp) ---
CP, LAYOUT, T, H, B, D, SEED, STEPS, GLOBAL_BATCH, LR = 2, "zigzag", 0, 0, 1, 4, 0, 3, 4, 3e-3
# each number option's (low, high): the demo stays small
LIMITS = dict(cp=(2, 8), T=(0, 64), H=(0, 32), steps=(1, 10_000), global_batch=(1, 512),
              lr=(0.0, 1.0), seed=(0, 2 ** 32))
WIDTH = 100                                      # characters a line


def rank_main(ctx, args, arrays, cfg, data_cfg):
    """Everything here runs on every rank: the two all-to-alls by hand, the real
    ulysses_attention forward and backward, then a few training steps."""
    g, r, W, Tn = ctx.world, ctx.rank, ctx.world_size, args.T
    P = sequence_layout(Tn, W, args.layout)
    lengths, pos, h = [len(p) for p in P], np.concatenate(P), args.H // W
    q, k, v, dy = (a[:, :, P[r]] for a in arrays)                 # (B, H, T_r, D): my positions
    sent = [g.stats["bytes_sent"]]
    qkv = seq_to_heads(np.stack([q, k, v]), g, lengths)           # (3, B, h, T, D): my heads
    sent.append(g.stats["bytes_sent"])
    y_h = attention_core(*(Tensor(a) for a in qkv), pos, pos, Dropout(0.0), None, r * h,
                         args.H, Tn).data                         # (B, h, T, D)
    sent.append(g.stats["bytes_sent"])
    y = heads_to_seq(y_h, g, lengths)                             # (B, H, T_r, D)
    sent.append(g.stats["bytes_sent"])
    qt, kt, vt = (Tensor(a.copy(), requires_grad=True) for a in (q, k, v))
    y_lib = ulysses_attention(qt, kt, vt, g, positions=P, T=Tn, drop=Dropout(0.0), key=None,
                              first_head=0, n_head=args.H)        # (B, H, T_r, D)
    sent.append(g.stats["bytes_sent"])
    y_lib.backward(dy)
    sent.append(g.stats["bytes_sent"])
    run = train_on_rank(ctx, cfg, data_cfg, Plan(cp=W, cp_algo="ulysses", cp_layout=args.layout),
                        RunConfig(steps=args.steps, global_batch=args.global_batch, seed=args.seed),
                        OptimizerConfig(lr=args.lr))
    held = [np.stack([q, k, v]), qkv, y_h, y]
    sent = np.diff(sent).tolist()
    return held, (sent[0], sent[2], sent[3], sent[4]), (y_lib.data, qt.grad, kt.grad, vt.grad), run


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default=LAYOUT, choices=LAYOUTS)
    ap.add_numbers(dict(cp=CP, T=T, H=H, steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR,
                        seed=SEED), LIMITS)
    args = ap.parse_args(argv)
    args.T, args.H = args.T or 4 * args.cp, args.H or 2 * args.cp
    chunks = 2 * args.cp if args.layout == "zigzag" else args.cp
    if args.T % chunks or args.T % 2 or args.H % args.cp:
        ap.error(f"need --T an even multiple of {chunks} ({args.layout}) and --H a multiple of "
                 f"--cp {args.cp}")
    return args


def gap(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - b)))


def heads(lo: int, n: int) -> str:
    return f"{lo}-{lo + n - 1}" if n > 1 else f"{lo}"


def main(argv=None) -> int:
    args = parse_args(argv)
    W, Tn, Hn = args.cp, args.T, args.H
    h, Tr, rng = Hn // W, Tn // W, np.random.default_rng(args.seed)
    arrays = [rng.standard_normal((B, Hn, Tn, D)) for _ in range(4)]      # q, k, v, dy
    data_cfg = DataConfig(task="sort", length=Tn // 2, seed=args.seed)   # block_size = T
    cfg = model_config_for(data_cfg, n_layer=2, n_embd=8 * Hn, n_head=Hn, dtype="float64")
    P = sequence_layout(Tn, W, args.layout)
    print(f"demo 11 · Ulysses · cp={W} · {args.layout} · T={Tn}, H={Hn} heads, D={D}, B={B} · "
          "float64")
    runs = spawn(W, rank_main, args, arrays, cfg, data_cfg)

    q, k, v = (Tensor(a.copy(), requires_grad=True) for a in arrays[:3])      # 1 process
    y = attention_core(q, k, v, np.arange(Tn), np.arange(Tn), Dropout(0.0), None, 0, Hn, Tn)
    y.backward(arrays[3])
    ref, qkv = (y.data, q.grad, k.grad, v.grad), np.stack(arrays[:3])
    src = " | ".join(" ".join(map(str, p)) for p in P)                  # source-rank order
    by_rank = " | ".join(heads(s * h, h) for s in range(W))
    print("per rank, at each point: shape ([3 for q, k, v,] B, heads, positions, D), which heads "
          f"(H/cp = {h}\ninside attention), which global positions, and |Δ| vs the same slice of "
          "the 1-process q, k, v or y")
    worst, pw, hw = 0.0, len(src) + 1, len(by_rank) + 7
    for r, run in enumerate(runs):
        mine, hs = " ".join(map(str, P[r])), slice(r * h, (r + 1) * h)
        want = [qkv[:, :, :, P[r]], qkv[:, :, hs][:, :, :, np.concatenate(P)],
                ref[0][:, hs][:, :, np.concatenate(P)], ref[0][:, :, P[r]]]
        rows = [("before all-to-all 1", "q, k, v", f"heads {heads(0, Hn)}", mine),
                ("after it", "q, k, v", f"heads {heads(r * h, h)}", src),
                ("after attention", "y", f"heads {heads(r * h, h)}", src),
                ("after all-to-all 2", "y", f"heads {by_rank}", mine)]
        print(f"rank {r}")
        for (when, what, hd, ps), got, w in zip(rows, run[0], want):
            line = (f"  {when:20s}{what:7s} {str(got.shape):17s} {hd:{hw}s} pos {ps:{pw}s} "
                    f"|Δ| {gap(got, w):.0e}")
            if len(line) > WIDTH:                   # too wide: heads and positions below
                line = "\n".join([f"  {when:20s}{what:7s} {str(got.shape):17s} |Δ| "
                                  f"{gap(got, w):.0e}"] + [textwrap.fill(
                                      text, WIDTH, initial_indent=" " * 6,
                                      subsequent_indent=" " * 10) for text in (hd, "pos " + ps)])
            print(line)
            worst = max(worst, gap(got, w))
    more = " | ..." * (W > 2)
    print(f"  (after all-to-all 1 the positions are in source-rank order: rank 0's | rank "
          f"1's{more};\n  after all-to-all 2 the heads are too: from rank 0 | rank 1{more})")

    n = B * Hn * Tr * D * 8                                       # bytes of one of q, k, v, y
    want = (3 * n * (W - 1) // W, B * h * (Tn - Tr) * D * 8)
    want += (sum(want), n * (W - 1) // W + 3 * B * h * (Tn - Tr) * D * 8)
    sent = [run[1] for run in runs]
    print(f"bytes sent per rank (T_r = T/cp = {Tr} positions, 8 bytes a number):\n"
          f"  all-to-all 1, q, k, v stacked   {want[0]:6d} = 3·B·H·T_r·D·8·(cp-1)/cp\n"
          f"  all-to-all 2, y                 {want[1]:6d} = B·(H/cp)·(T-T_r)·D·8\n"
          f"  ulysses_attention forward {want[2]}, backward {want[3]}\n  (the backward sends dy, "
          f"then dq, dk, dv: the same all-to-alls reversed)\n"
          f"  measured, the same on every rank: {sent == [want] * W}")
    problems = [] if sent == [want] * W else [f"bytes sent {sent}, formula {want}"]
    d = [max(gap(run[2][i], a[:, :, p]) for p, run in zip(P, runs)) for i, a in enumerate(ref)]
    by_hand = max(gap(run[0][3], run[2][0]) for run in runs)
    print(f"y on every rank: by hand above vs ulysses_attention, max |Δ| = {by_hand:.1e}; vs "
          f"attention_core over\n  the whole sequence, max |Δ| = {d[0]:.1e}; dQ, dK, dV vs its "
          f"backward: {d[1]:.1e}, {d[2]:.1e}, {d[3]:.1e}")

    base = train_single_process(cfg, data_cfg, steps=args.steps, global_batch=args.global_batch,
                                lr=args.lr, seed=args.seed)
    for s, (a, b) in enumerate(zip(runs[0][3].losses, base.losses)):
        print(f"step {s} | loss cp={W} Ulysses {a:.15f} | 1 process {b:.15f} | |Δ| "
              f"{abs(a - b):.1e}")
    d_param = max(gap(run[3].params[n], p) for run in runs for n, p in base.params.items())
    print(f"final parameters, every rank vs 1 process: max |Δ| = {d_param:.1e}")
    worst = max(worst, by_hand, *d, gap(runs[0][3].losses, base.losses), d_param)
    if worst > 1e-10 or problems:
        print(f"MISMATCH: {'; '.join(problems) or f'max |Δ| = {worst:.1e}'}")
        return 1
    print(f"OK: cp={W} Ulysses attention ({args.layout}) = 1-process attention and training "
          f"(max |Δ| = {worst:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
