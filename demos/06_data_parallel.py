"""Data parallelism on W ranks, checked against a 1-process run.

What you will see: each rank reads its own slice of every global batch (by global sample
index), computes gradients on it into flat buckets that live in shared memory, and the
buckets are summed across the ranks while backward is still running. The W-rank loss
curve is printed next to the one a single process gets on the whole batch, then the bytes
each rank sent per step next to the formula 2(W-1)/W·Ψ, and a check that the W replicas
ended bitwise identical. The loss is divided by the token count of the GLOBAL batch on
every rank, which is why the ranks SUM their gradients.

Run:       python demos/06_data_parallel.py --world-size 4 [--steps 5 --micro-batches 2]
Read with: minidist/parallel/data/ddp.py, minidist/parallel/data/buckets.py (the fast path),
           minidist/collectives/direct.py (all_reduce_shared),
           minidist/train.py
Paper:     Li et al. 2020, "PyTorch Distributed", arXiv:2006.15704
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")           # one BLAS thread per rank

import argparse                                # noqa: E402
import contextlib                              # noqa: E402
import hashlib                                 # noqa: E402
import textwrap                                # noqa: E402

import numpy as np                             # noqa: E402

from minidist.baseline import train_single_process                      # noqa: E402
from minidist.cli import CliParser                                      # noqa: E402
from minidist.data import DataConfig, SyntheticData, model_config_for   # noqa: E402
from minidist.nn import GPT, DropoutKey                                 # noqa: E402
from minidist.parallel.data.buckets import BucketedDataParallel         # noqa: E402
from minidist.runtime.launch import spawn                               # noqa: E402

# --- settings (each can be overridden on the command line) ---
WORLD_SIZE, STEPS, GLOBAL_BATCH, MICRO_BATCHES, LR, SEED = 4, 5, 16, 1, 3e-3, 0
N_LAYER, N_EMBD, N_HEAD, BUCKET_BYTES, ALGO = 2, 32, 2, 64 * 1024, "direct"
# each number option's (low, high): the demo stays small
LIMITS = dict(world_size=(1, 8), steps=(1, 10_000), global_batch=(1, 512),
              micro_batches=(1, 64), lr=(0.0, 1.0), seed=(0, 2 ** 32), n_layer=(1, 8),
              n_embd=(1, 256), n_head=(1, 64), bucket_bytes=(1, 2 ** 31))


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(world_size=WORLD_SIZE, steps=STEPS, global_batch=GLOBAL_BATCH,
                        micro_batches=MICRO_BATCHES, lr=LR, seed=SEED, n_layer=N_LAYER,
                        n_embd=N_EMBD, n_head=N_HEAD, bucket_bytes=BUCKET_BYTES), LIMITS)
    ap.add_argument("--algo", default=ALGO, choices=["direct", "ring", "tree", "halving"])
    a = ap.parse_args(argv)
    if a.n_embd % a.n_head:
        ap.error(f"--n-embd {a.n_embd} is not a multiple of --n-head {a.n_head}")
    if a.global_batch % (a.world_size * a.micro_batches):
        ap.error(f"--global-batch {a.global_batch} must be a multiple of --world-size x "
                 f"--micro-batches = {a.world_size * a.micro_batches}")
    return a


def rank_main(ctx, cfg, data_cfg, args):
    """Everything here runs on every rank; ctx.rank says which one we are."""
    W, r = ctx.world_size, ctx.rank
    model = GPT(cfg, args.seed)                           # same seed: same numbers everywhere
    dp = BucketedDataParallel(model, ctx.world, lr=args.lr, bucket_bytes=args.bucket_bytes,
                              algo=args.algo)
    data, B, M = SyntheticData(data_cfg), args.global_batch, args.micro_batches
    rows = B // (W * M)                                   # rows per micro-batch on this rank
    losses, sent = [], []
    for step in range(args.steps):
        ids = data.global_indices(step, B)                # the same B indices on every rank
        x, y = data.batch(ids)                            # (B, T) each
        n_tokens = int((y != -100).sum())                 # GLOBAL count: the key line
        before, local = ctx.world.stats["bytes_sent"], 0.0
        for m in range(M):
            part = slice((r * M + m) * rows, (r * M + m + 1) * rows)   # my rows only
            quiet = dp.no_sync() if m < M - 1 else contextlib.nullcontext()
            with quiet:                                   # the last backward starts the sync
                key = DropoutKey(args.seed, step, tuple(int(i) for i in ids[part]))
                _, loss = dp.forward(x[part], y[part], n_tokens=n_tokens,
                                     aux_weight=rows / B, dropout_key=key)
                loss.backward()
            local += loss.item()
        dp.step(args.lr)                                  # wait for the buckets, AdamW
        losses.append(local)
        sent.append(ctx.world.stats["bytes_sent"] - before)
    digest = hashlib.sha256(b"".join(p.data.tobytes() for p in model.parameters()))
    buckets = [(b.params[0], b.params[-1], b.count) for b in dp.buckets]
    names = {id(p): n for n, p in model.named_parameters()}
    return losses, sent, digest.hexdigest()[:16], [(names[id(a)], names[id(z)], n)
                                                   for a, z, n in buckets]


def main(argv=None) -> int:
    args = parse_args(argv)
    W, B, M = args.world_size, args.global_batch, args.micro_batches
    data_cfg = DataConfig(task="sort", length=5, seed=args.seed)
    cfg = model_config_for(data_cfg, n_layer=args.n_layer, n_embd=args.n_embd,
                           n_head=args.n_head, dtype="float64")
    psi = GPT(cfg, args.seed).num_parameters()
    print(f"demo 06 · data parallel · world_size={W} · GPT {psi / 1e3:.1f}k params · float64\n"
          f"global batch {B} · {M} micro-batch(es) per rank · all-reduce {args.algo}")
    per = B // W
    print(textwrap.fill(f"rank 0 reads rows 0-{per - 1} of each global batch of {B} (" + ", ".join(
        f"rank {r}: {r * per}-{(r + 1) * per - 1}" for r in range(1, W)) + ")", 100,
        subsequent_indent="  "))
    runs = spawn(W, rank_main, cfg, data_cfg, args)
    ref = train_single_process(cfg, data_cfg, steps=args.steps, global_batch=B, lr=args.lr,
                               seed=args.seed, grad_accum=M)
    for i, (first, last, n) in enumerate(runs[0][3]):    # reverse registration order
        print(f"bucket {i}: {n:6d} grads in shared memory, {first} ... {last}")
    dp_losses = [sum(run[0][s] for run in runs) for s in range(args.steps)]   # rank order
    for s, (a, b) in enumerate(zip(dp_losses, ref.losses)):
        print(f"step {s} | loss {W} ranks {a:.12f} | 1 process {b:.12f} | |Δ| {abs(a - b):.1e}")
    formula = 2 * (W - 1) / W * psi * 8
    sent = [run[1][-1] for run in runs]
    print(textwrap.fill("bytes sent in the last step by rank 0, 1, ...: " + ", ".join(
        f"{s:,d}" for s in sent), 100, subsequent_indent="  "))
    print(f"  mean {np.mean(sent):,.0f}; predicted 2(W-1)/W·Ψ·8 B = {formula:,.0f}")
    digests = [run[2] for run in runs]
    print(textwrap.fill("parameter digests: " + " ".join(digests), 100, subsequent_indent="  "))
    worst = max(abs(a - b) for a, b in zip(dp_losses, ref.losses))
    same = len(set(digests)) == 1
    ok = worst < 1e-9 and same and abs(np.mean(sent) - formula) < 1e-6 * max(formula, 1)
    verdict = "OK" if ok else "MISMATCH"
    print(f"{verdict}: {W}-rank loss curve = 1-process run's (max |Δ| = {worst:.1e}); "
          f"{'identical' if same else 'DIFFERENT'} replicas; bytes as predicted")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
