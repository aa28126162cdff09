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

import numpy as np                             # noqa: E402

from minidist.baseline import train_single_process                      # noqa: E402
from minidist.cli import CliParser, like                                # noqa: E402
from minidist.data import DataConfig, SyntheticData, model_config_for   # noqa: E402
from minidist.nn import GPT, DropoutKey                                 # noqa: E402
from minidist.parallel.data.buckets import BucketedDataParallel         # noqa: E402
from minidist.parallel.data.ddp import ALGOS                            # noqa: E402
from minidist.runtime.launch import spawn                               # noqa: E402

# --- settings (each can be overridden on the command line) ---
WORLD_SIZE, STEPS, GLOBAL_BATCH, MICRO_BATCHES, LR, SEED = 4, 5, 16, 1, 3e-3, 0
N_LAYER, N_EMBD, N_HEAD, BUCKET_BYTES, ALGO = 2, 32, 2, 64 * 1024, "direct"


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    for name, value in dict(world_size=WORLD_SIZE, steps=STEPS, global_batch=GLOBAL_BATCH,
                            micro_batches=MICRO_BATCHES, lr=LR, seed=SEED, n_layer=N_LAYER,
                            n_embd=N_EMBD, n_head=N_HEAD, bucket_bytes=BUCKET_BYTES,
                            algo=ALGO).items():
        ap.add_argument("--" + name.replace("_", "-"), type=like(value, name), default=value,
                        **{"choices": ALGOS} if name == "algo" else {})
    return ap.parse_args(argv)


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
    if B % (W * M):
        raise SystemExit(f"--global-batch {B} must be a multiple of world size x micro-batches"
                         f" = {W * M}")
    data_cfg = DataConfig(task="sort", length=5, seed=args.seed)
    cfg = model_config_for(data_cfg, n_layer=args.n_layer, n_embd=args.n_embd,
                           n_head=args.n_head, dtype="float64")
    psi = GPT(cfg, args.seed).num_parameters()
    print(f"demo 06 · data parallel · world_size={W} · GPT {psi / 1e3:.1f}k params · float64 "
          f"· global batch {B} · {M} micro-batch(es) per rank · all-reduce {args.algo}")
    per = B // W
    print(f"rank 0 reads rows 0-{per - 1} of each global batch of {B} (" + ", ".join(
        f"rank {r}: {r * per}-{(r + 1) * per - 1}" for r in range(1, W)) + ")")
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
    print("bytes sent per step: " + ", ".join(f"rank {r} {s:,d}" for r, s in enumerate(sent))
          + f"; mean {np.mean(sent):,.0f} (predicted 2(W-1)/W·Ψ·8 B = {formula:,.0f})")
    digests = [run[2] for run in runs]
    print("parameter digests: " + " ".join(digests))
    worst = max(abs(a - b) for a, b in zip(dp_losses, ref.losses))
    same = len(set(digests)) == 1
    ok = worst < 1e-9 and same and abs(np.mean(sent) - formula) < 1e-6 * max(formula, 1)
    verdict = "OK" if ok else "MISMATCH"
    print(f"{verdict}: {W}-rank loss curve matches 1-process run (max |Δ| = {worst:.1e}); "
          f"replicas {'bitwise identical' if same else 'DIFFER'}; bytes/rank = 2(W-1)/W·Ψ")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
