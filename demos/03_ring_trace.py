"""A ring all-reduce, step by step: which chunk goes where, and what each rank holds after.

What you will see: W ranks (default 4) each cut their vector into W chunks c0..c{W-1}.
Reduce-scatter: W-1 steps, each rank sends one partial sum to its right neighbour and
adds the one arriving from its left. All-gather: W-1 more steps pass the finished
chunks round. One trace line per rank and step, then a grid of which ranks' numbers
each chunk holds. The schedule is re-derived from ring.py's documented rule; the real
ring (minidist.collectives, algo="ring") runs with its messages recorded, and every
recorded message must equal the derived one. The timeline is written as a Chrome
trace: open it at https://ui.perfetto.dev (or chrome://tracing).

Inputs: rank r holds 10^r * (j % 9 + 1) at index j, so the decimal digits of a
partial sum name the ranks in it (1011 = ranks 0, 1 and 3); the grid shows those
ranks, with * on the chunk just received (past 4 ranks, three or more as the arc of the
ring they form: 6..1 = ranks 6, 7, 0, 1).

Run:       python demos/03_ring_trace.py [--world-size 4] [--n 8] [--trace PATH]
Read with: minidist/collectives/ring.py, minidist/runtime/p2p.py, minidist/observe/trace.py
Paper:     Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
           workstations", J. Parallel Distrib. Comput. 69(2), Sec. 3
"""

import os
import tempfile

import numpy as np

from minidist.cli import CliParser, at_least
from minidist.collectives import api, simulated
from minidist.observe.trace import Trace, now_us
from minidist.runtime.launch import spawn

# --- settings (each can be overridden on the command line) ---
WORLD_SIZE, N, MAX_N = 4, 8, 64


class RecordingGroup:
    """This rank's real group with every sendrecv recorded: to and from whom, what was
    sent, what arrived (also when the ring adds it straight out of the mailbox with
    `combine`), what `out` holds afterwards, and when."""

    def __init__(self, group):
        self._g, self.log = group, []

    def __getattr__(self, name):                  # rank, size, collective, ... from the group
        return getattr(self._g, name)

    def sendrecv(self, x, dst, src, out=None, combine=None):
        pieces = []                               # a long message arrives in several pieces

        def spy(acc, incoming, out=None):
            pieces.append(incoming.copy())
            return combine(acc, incoming, out=out)

        t0 = now_us()
        out = self._g.sendrecv(x, dst=dst, src=src, out=out,
                               combine=None if combine is None else spy)
        got = np.concatenate(pieces) if combine is not None else out.copy()
        self.log.append((dst, src, x.copy(), got, out.copy(), t0, now_us()))
        return out


def rank_main(ctx, xs):
    """Everything here runs on every rank: the real ring all_reduce, recorded."""
    g = RecordingGroup(ctx.world)
    t0 = now_us()
    result = api.all_reduce(xs[ctx.rank], group=g, algo="ring")
    return result, g.log, (t0, now_us())


def schedule(r: int, step: int, W: int) -> tuple[str, int, int]:
    """ring.py's rule for rank r at global step `step` (0..2W-3): (phase, send c, recv c)."""
    if step < W - 1:
        return "reduce-scatter", (r - step - 1) % W, (r - step - 2) % W
    s = step - (W - 1)
    return "all-gather", (r - s) % W, (r - s - 1) % W


def simulate(xs, W: int):
    """Lockstep re-derivation: per step, what each rank sends and holds afterwards."""
    chunks = [[c.copy() for c in np.array_split(x, W)] for x in xs]
    steps = []
    for step in range(2 * (W - 1)):
        sent = [chunks[r][schedule(r, step, W)[1]].copy() for r in range(W)]
        for r in range(W):
            phase, _, c = schedule(r, step, W)
            got = sent[(r - 1) % W]
            chunks[r][c] = got + chunks[r][c] if phase == "reduce-scatter" else got.copy()
        steps.append((sent, [[c.copy() for c in row] for row in chunks]))
    return steps, [np.concatenate(row) for row in chunks]


def who(chunk: np.ndarray, W: int) -> str:
    """Ranks whose numbers are in a partial sum, read from the decimal digits of element 0:
    "0+1+2"; past 4 ranks, three or more are the arc of the ring they form, "6..1" for
    6+7+0+1 (a ring's partial sums always are one)."""
    if chunk.size == 0:
        return "-"
    digits = int(round(chunk[0]))             # m (10^a + 10^b + ...), m <= 9: no carries
    ranks = [k for k in range(W) if digits // 10 ** k % 10]
    arcs = [a for a in ranks if {(a + i) % W for i in range(len(ranks))} == set(ranks)]
    if W > 4 and len(ranks) > 2 and arcs:
        return f"{arcs[0]}..{(arcs[0] + len(ranks) - 1) % W}"
    return "+".join(map(str, ranks))


def build_trace(runs, W: int) -> Trace:
    trace = Trace()
    for r, (_, log, (t0, t1)) in enumerate(runs):
        trace.add("all_reduce (ring)", r, t0, t1, {"W": W}, cat="collective")
        for step, (dst, src, sent, _, _, a, b) in enumerate(log):
            phase, c_out, c_in = schedule(r, step, W)
            k = step % (W - 1) + 1
            trace.add(f"{phase} {k}: c{c_out}->{dst}, c{c_in}<-{src}", r, a, b,
                      {"step": step + 1, "send_chunk": c_out, "recv_chunk": c_in, "dst": dst,
                       "src": src, "bytes": int(sent.nbytes)}, cat=phase)
    return trace.shifted()


def show_steps(runs, steps, W: int) -> list[str]:
    """Print each step (one trace line per rank, then who holds what); return the steps
    where the real run's message differs from the derived one."""
    problems = []
    for step, (sent, held) in enumerate(steps):
        phase, k = schedule(0, step, W)[0], step % (W - 1) + 1
        print(f"\n-- {phase} step {k}/{W - 1} --")
        for r in range(W):
            _, c_out, c_in = schedule(r, step, W)
            dst, src, real_sent, real_got, real_held, _, _ = runs[r][1][step]
            print(f"[rank {r}] world ring.all_reduce step {k}/{W - 1} ({phase}): send c{c_out} "
                  f"({sent[r].nbytes} B) -> {dst}, recv c{c_in} <- {src}")
            if (dst, src) != ((r + 1) % W, (r - 1) % W) or not (
                    np.array_equal(real_sent, sent[r]) and np.array_equal(real_got, sent[src])
                    and np.array_equal(real_held, held[r][c_in])):
                problems.append(f"rank {r} step {step + 1}: the real message differs")
        for r in range(W):
            c_in = schedule(r, step, W)[2]
            cells = [f"c{c}={who(ch, W) + ('*' if c == c_in else ''):<{min(2 * W, 6)}}"
                     for c, ch in enumerate(held[r])]
            print(f"  rank {r} holds " + " ".join(cells).rstrip())
    return problems


def parse_args(argv=None):
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=at_least(2), default=WORLD_SIZE, help="ranks (2..8)")
    ap.add_argument("--n", type=at_least(1), default=N, help=f"elements per rank (1..{MAX_N})")
    ap.add_argument("--trace", default=os.path.join(tempfile.gettempdir(),
                                                    "minidist_ring_trace.json"))
    args = ap.parse_args(argv)
    if args.world_size > 8 or args.n > MAX_N:
        ap.error(f"need --world-size <= 8 and --n <= {MAX_N}, got {args.world_size} and "
                 f"{args.n}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    W, n = args.world_size, args.n
    xs = [10.0 ** r * (np.arange(n) % 9 + 1) for r in range(W)]
    print(f"demo 03 · ring all_reduce trace · {W} ranks · {n} float64 per rank")
    print(f"chunks c0..c{W - 1} of {[len(c) for c in np.array_split(np.arange(n), W)]} elements")
    runs = spawn(W, rank_main, xs)
    steps, derived = simulate(xs, W)
    counts = [len(run[1]) for run in runs]
    if counts != [2 * (W - 1)] * W:
        print(f"MISMATCH: the ranks sent {counts} messages, the ring rule says {2 * (W - 1)} each")
        return 1
    problems = show_steps(runs, steps, W)
    expected = simulated.all_reduce(xs)
    worst = max(float(np.max(np.abs(run[0] - e))) for run, e in zip(runs, expected))
    problems += [f"rank {r}: derived result differs" for r in range(W)
                 if not np.array_equal(derived[r], expected[r])]
    path = build_trace(runs, W).write(args.trace)
    if len(Trace.read(path)) != W * (2 * W - 1):
        problems.append(f"{path} does not hold {W * (2 * W - 1)} events")
    print(f"\nresult on every rank: {runs[0][0]}")
    print(f"Chrome trace, to open at https://ui.perfetto.dev or chrome://tracing:\n  {path}")
    if worst > 0 or problems:
        print(f"MISMATCH: {'; '.join(problems) or f'max |Δ| = {worst:.1e}'}")
        return 1
    print(f"OK: ring all_reduce on {W} ranks matches the oracle (max |Δ| = {worst:.1e}); "
          f"its {W * 2 * (W - 1)} messages as derived")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
