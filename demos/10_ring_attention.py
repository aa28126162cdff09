"""Ring attention (context parallelism) on cp ranks, step by step, checked against 1 process.

What you will see: the global positions of each rank (zig-zag or contiguous); per ring step
the K/V block every rank holds and whether the causal mask skips it, keeps it whole (full)
or masks some of it (partial); the running max m and sum l of the last query's online
softmax after each merge (redone here in NumPy) next to the 1-process softmax; the work per
rank of both layouts; the real ring's output and dQ, dK, dV next to
attention_core on the whole sequence; a Chrome trace of each rank's ring; a few float64
training steps with Plan(cp=W) next to the 1-process run.

Run:       python demos/10_ring_attention.py [--cp 4] [--layout zigzag|contiguous] [--trace PATH]
Read with: minidist/parallel/context/ring_attention.py, context_parallel.py,
           minidist/nn/attention.py
Paper:     Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers",
           arXiv:2310.01889, Sec. 3; Milakov & Gimelshein 2018, arXiv:1805.02867 (online softmax)
"""

import argparse
import os
import tempfile

import numpy as np

from minidist.autograd import Tensor
from minidist.baseline import train_single_process
from minidist.cli import CliParser
from minidist.data import DataConfig, model_config_for
from minidist.nn.attention import attention_core
from minidist.nn.layers import Dropout
from minidist.observe.trace import Event, Trace, now_us
from minidist.parallel.context.ring_attention import (LAYOUTS, attention_work, imbalance,
                                                      ring_attention, sequence_layout)
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank

# --- settings (each can be overridden on the command line; T = 0 means 4 cp) ---
CP, LAYOUT, T, B, H, D, SEED, STEPS, GLOBAL_BATCH, LR = 4, "zigzag", 0, 1, 2, 4, 0, 3, 4, 3e-3
TRACE = os.path.join(tempfile.gettempdir(), "minidist_ring_attention.json")
# each number option's (low, high): the demo stays small
LIMITS = dict(cp=(2, 8), T=(0, 64), steps=(1, 10_000), global_batch=(1, 512), lr=(0.0, 1.0),
              seed=(0, 2 ** 32))
COLUMNS = 4                                    # ranks per row of the ring-step table


class TimedGroup:
    """The cp group with the ring's times written down: each pass of a block (on the group's
    worker thread) under ring_attention's own label ("forward K/V, step 0"), and each wait."""

    def __init__(self, group):
        self._g, self._label, self.sends, self.waits = group, "", [], []

    def __getattr__(self, name):                 # rank, size, stats, prefix: the group's
        return getattr(self._g, name)

    def collective(self, op, x, **kw):
        self._label = kw.get("algo") or op
        return self._g.collective(op, x, **kw)

    def sendrecv(self, x, dst, src, **kw):
        t0, out = now_us(), self._g.sendrecv(x, dst=dst, src=src, **kw)
        self.sends.append(Event(f"send {self._label} -> rank {dst}", self.rank, t0, now_us(),
                                {"bytes": int(x.nbytes)}, "send", lane=1))      # worker thread
        return out

    def submit(self, fn):
        work, waits = self._g.submit(lambda: (fn(), self._label)), self.waits

        class Timed:
            def wait(self, timeout=None):
                t0 = now_us()
                out, label = work.wait(timeout)
                waits.append((label, t0, now_us()))
                return out
        return Timed()

    def timeline(self, windows) -> list[Event]:
        """Lane 0: forward, backward, the compute of each ring step (up to the wait for the
        next K/V block), every wait; lane 1: every pass of a block."""
        r, W, ev = self.rank, self.size, list(self.sends)
        for phase, (a, b) in zip(("forward", "backward"), windows):
            waits = [w for w in self.waits if a <= w[1] <= b]
            ends = [a] + [t for w in waits if "dK" not in w[0] for t in w[1:]] + [b]
            ev += [Event(phase, r, a, b, cat=phase)] + [
                Event(f"{phase} step {s}: my Q x K/V of rank {(r - s) % W}", r, ends[2 * s],
                      ends[2 * s + 1], {"step": s}, "compute") for s in range(len(ends) // 2)]
            ev += [Event("wait: " + lab, r, t0, t1, cat="wait") for lab, t0, t1 in waits]
        return ev


def rank_main(ctx, args, arrays, cfg, data_cfg):
    """Everything here runs on every rank: the real ring, timed, then a few training steps."""
    P = sequence_layout(args.T, ctx.world_size, args.layout)
    mine, g = P[ctx.rank], TimedGroup(ctx.world)
    q, k, v = (Tensor(a[:, :, mine].copy(), requires_grad=True) for a in arrays[:3])
    t0 = now_us()
    y = ring_attention(q, k, v, g, positions=P, T=args.T)        # (B, H, T_loc, D)
    t1 = now_us()
    y.backward(arrays[3][:, :, mine])                            # dy: my rows of the global dy
    t2 = now_us()
    run = train_on_rank(ctx, cfg, data_cfg, Plan(cp=ctx.world_size, cp_layout=args.layout),
                        RunConfig(steps=args.steps, global_batch=args.global_batch, seed=args.seed),
                        OptimizerConfig(lr=args.lr))
    return (y.data, q.grad, k.grad, v.grad), g.timeline(((t0, t1), (t1, t2))), run


def ring_by_hand(Q, K, V, P, track):
    """The forward ring in plain NumPy, blocks in ring order: per (step, rank) the block's
    (source, status, R, C); the tracked row's (step, keys, block max, m, l); every rank's y."""
    W, scale = len(P), 1.0 / np.sqrt(Q.shape[-1])
    cells, row, ys = [[None] * W for _ in range(W)], [], []
    for r in range(W):
        q = Q[:, :, P[r]]                                        # (B, H, T_loc, D)
        m, l, acc = np.full(q.shape[:3], -np.inf), np.zeros(q.shape[:3]), np.zeros_like(q)
        for s in range(W):
            src = (r - s) % W
            future = P[src][None, :] > P[r][:, None]             # (T_loc, T_loc): masked
            R, C = np.nonzero(~future.all(1))[0], np.nonzero(~future.all(0))[0]
            sub = future[np.ix_(R, C)]                           # the R x C scores computed
            status = "skip" if not len(R) else "partial" if sub.any() else "full"
            cells[s][r] = (src, status, len(R), len(C))
            if not len(R):
                continue                                         # all in my future
            k, v = K[:, :, P[src][C]], V[:, :, P[src][C]]        # (B, H, C, D)
            sc = np.where(sub, -np.inf, q[:, :, R] @ k.swapaxes(-1, -2) * scale)
            m_new = np.maximum(m[:, :, R], sc.max(-1))           # (B, H, R)
            alpha, p = np.exp(m[:, :, R] - m_new), np.exp(sc - m_new[..., None])
            l[:, :, R] = alpha * l[:, :, R] + p.sum(-1)
            acc[:, :, R] = alpha[..., None] * acc[:, :, R] + p @ v
            m[:, :, R] = m_new
            if r == track[0] and track[1] in R:
                i = track[1]
                row.append((s, P[src], sc[0, 0, list(R).index(i)].max(), m[0, 0, i], l[0, 0, i]))
        ys.append(acc / l[..., None])
    return cells, row, ys


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default=LAYOUT, choices=LAYOUTS)
    ap.add_argument("--trace", default=TRACE, help="where the Chrome trace is written")
    ap.add_numbers(dict(cp=CP, T=T, steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR,
                        seed=SEED), LIMITS)
    args = ap.parse_args(argv)
    args.T = args.T or 4 * args.cp
    chunks = 2 * args.cp if args.layout == "zigzag" else args.cp
    if args.T % chunks or args.T % 2 or args.T > 8 * args.cp:
        ap.error(f"need --T an even multiple of {chunks} ({args.layout}), at most 8 positions "
                 f"a rank ({8 * args.cp})")
    return args


def wrapped(parts: list[str], sep: str = " | ", indent: str = "  ", width: int = 100) -> str:
    """parts joined by sep, in lines of at most `width` characters, each indented."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1] + sep + part) <= width:
            lines[-1] += sep + part
        else:
            lines.append(indent + part)
    return "\n".join(lines)


def gap(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - b)))


def main(argv=None) -> int:
    args = parse_args(argv)
    W, Tn, lay = args.cp, args.T, args.layout
    rng = np.random.default_rng(args.seed)
    arrays = [rng.standard_normal((B, H, Tn, D)) for _ in range(4)]       # q, k, v, dy
    data_cfg = DataConfig(task="sort", length=Tn // 2, seed=args.seed)   # block_size = T
    cfg = model_config_for(data_cfg, n_layer=2, n_embd=32, n_head=2, dtype="float64")
    P, Tl = sequence_layout(Tn, W, lay), Tn // W
    print(f"demo 10 · ring attention · cp={W} · {lay} · T={Tn}, {Tl} positions per rank · "
          f"B={B}, H={H}, D={D} · float64\npositions ({2 * W if lay == 'zigzag' else W} "
          "chunks" + f", rank r holds chunks r and {2 * W - 1}-r" * (lay == "zigzag") + "):\n"
          + wrapped([f"rank {r}: " + " ".join(map(str, p)) for r, p in enumerate(P)]))
    runs = spawn(W, rank_main, args, arrays, cfg, data_cfg)

    owner = next(r for r in range(W) if Tn - 1 in P[r])
    cells, row, ys = ring_by_hand(*arrays[:3], P, (owner, int(np.argmax(P[owner]))))
    print(f"step s: rank r holds the K/V block of rank (r - s) mod {W}, computes its queries "
          "against it\n(R x C scores) and passes it on to rank r+1")
    for first in range(0, W, COLUMNS):                  # at most COLUMNS ranks side by side
        ranks = range(first, min(first + COLUMNS, W))
        print("step | " + " | ".join(f"rank {r:<13d}" for r in ranks).rstrip())
        for s, line in enumerate(cells):
            print((f"{s:4d} | " + " | ".join(
                f"K/V {src} {st:7s} {R}x{C}".ljust(18) if R else f"K/V {src} skip".ljust(18)
                for src, st, R, C in (line[r] for r in ranks))).rstrip())
    print("  full: no score masked; partial: some masked (the diagonal); skip: all keys in the "
          "future.\n  Rows that see no key of the block and keys no row sees are not computed.")

    print(f"query at position {Tn - 1} (rank {owner}), head 0: online softmax, blocks in ring "
          f"order,\n  m = max(m, block max), l = l·exp(m_old - m) + Σ exp(s - m)\n"
          f"  step  keys{' ' * (3 * Tl - 3)}block max  {'m':>10s}  l")
    for s, keys, bmax, m, l in row:
        print(f"  {s:4d}  {' '.join(f'{k:2d}' for k in keys)}  {bmax:+9.6f}  {m:+10.6f}  {l:<.6f}")
    sc = arrays[1][0, 0] @ arrays[0][0, 0, Tn - 1] / np.sqrt(D)           # all keys <= T-1
    ref_ml = (sc.max(), np.exp(sc - sc.max()).sum())
    print(f"  1 process: softmax over keys 0-{Tn - 1}: max {ref_ml[0]:+.6f}, sum {ref_ml[1]:.6f}"
          f" (|Δ| = {gap(row[-1][3], ref_ml[0]):.1e}, {gap(row[-1][4], ref_ml[1]):.1e})")
    worst = gap(row[-1][3:], ref_ml)

    print("scores computed per rank (attention_work = the table's R x C summed over steps):")
    for name in LAYOUTS[::-1]:
        work = attention_work(Tn, W, name)
        print(f"  {name:10s} " + " ".join(f"{w:4d}" for w in work) +
              f"   max/mean = {imbalance(work):.2f}" + ("   <- this run" if name == lay else ""))
    table = [sum(c[r][2] * c[r][3] for c in cells) for r in range(W)]
    problems = [] if table == attention_work(Tn, W, lay) else [f"the table sums to {table}"]

    q, k, v = (Tensor(a.copy(), requires_grad=True) for a in arrays[:3])       # 1 process
    y = attention_core(q, k, v, np.arange(Tn), np.arange(Tn), Dropout(0.0), None, 0, H, Tn)
    y.backward(arrays[3])
    by_hand = max(gap(ys[r], run[0][0]) for r, run in enumerate(runs))
    d = [max(gap(run[0][i], ref[:, :, p]) for p, run in zip(P, runs))
         for i, ref in enumerate((y.data, q.grad, k.grad, v.grad))]
    print(f"y on every rank: the NumPy merge above vs ring_attention, max |Δ| = {by_hand:.1e}; "
          f"vs attention_core\n  over the whole sequence, max |Δ| = {d[0]:.1e}; dQ, dK, dV vs "
          f"its backward: {d[1]:.1e}, {d[2]:.1e}, {d[3]:.1e}")
    path = Trace(e for run in runs for e in run[1]).shifted().write(args.trace)
    print(f"Chrome trace, to open at https://ui.perfetto.dev:\n  {path}\n  lane 0: compute "
          "and waits of each ring step; lane 1: the sends")

    base = train_single_process(cfg, data_cfg, steps=args.steps, global_batch=args.global_batch,
                                lr=args.lr, seed=args.seed)
    for s, (a, b) in enumerate(zip(runs[0][2].losses, base.losses)):
        print(f"step {s} | loss cp={W} ring {a:.15f} | 1 process {b:.15f} | |Δ| {abs(a - b):.1e}")
    d_param = max(gap(run[2].params[n], p) for run in runs for n, p in base.params.items())
    print(f"final parameters, every rank vs 1 process: max |Δ| = {d_param:.1e}")
    worst = max(worst, by_hand, *d, gap(runs[0][2].losses, base.losses), d_param)
    if worst > 1e-10 or problems:
        print(f"MISMATCH: {'; '.join(problems) or f'max |Δ| = {worst:.1e}'}")
        return 1
    print(f"OK: cp={W} ring attention ({lay}) = 1-process attention and training "
          f"(max |Δ| = {worst:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
