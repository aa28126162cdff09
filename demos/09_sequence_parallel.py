"""Sequence parallelism (Megatron SP) on W tensor-parallel ranks, checked against 1 process.

What you will see: outside the tensor-parallel regions every rank holds only T/W of the
positions, x[B, T_tp, C]; block 0's forward on every rank, with the shape, placement and
positions of what enters and leaves each region (LayerNorm on my positions -> all-gather
along T -> x[B, T, C] -> column- and row-parallel layers -> reduce-scatter along T ->
x[B, T_tp, C]); then the LayerNorm gain's gradient of each rank from its own positions
only, and after f sums it over tp, next to the 1-process gradient; then a few float64
training steps with Plan(tp=W, sequence_parallel=True) next to the 1-process run.

Run:       python demos/09_sequence_parallel.py --tp 2 [--tp 3 or 4, --steps 3, --length 6]
Read with: minidist/parallel/tensor/sequence.py, tensor_parallel.py
           (TensorParallel.enter/exit/sum_grad)
Paper:     Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
           Models", arXiv:2205.05198, Sec. 4.2.2 and Fig. 5
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")           # one BLAS thread per rank

import argparse                                # noqa: E402
from dataclasses import dataclass, field       # noqa: E402

import numpy as np                             # noqa: E402

from minidist.baseline import train_single_process                      # noqa: E402
from minidist.cli import CliParser                                      # noqa: E402
from minidist.data import DataConfig, SyntheticData, model_config_for   # noqa: E402
from minidist.nn import GPT                                             # noqa: E402
from minidist.parallel import placement as pl                           # noqa: E402
from minidist.parallel.tensor.tensor_parallel import TensorParallel, apply_tensor       # noqa: E402
from minidist.runtime.launch import spawn                               # noqa: E402
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank  # noqa: E402

# --- settings (each can be overridden on the command line) ---
TP, STEPS, GLOBAL_BATCH, SHOW_BATCH, LR, SEED = 2, 3, 8, 2, 3e-3, 0
N_LAYER, N_EMBD, N_HEAD, LENGTH = 2, 48, 12, 6   # T = 2 * LENGTH = 12: tp 2, 3, 4, 6 divide it
GRAD = "blocks.0.ln_1.weight"                     # the LayerNorm gain whose gradient we follow
STAGES = ("LN", "all-gather, column", "inside", "row @", "reduce-scatter", "+ residual")
LEGEND = """  LN              LayerNorm of my positions only (no communication)
  all-gather, column  along T, ring: B·T·C (W-1)/W numbers sent per rank, fused with the
                      column-parallel matmul: its backward keeps only my positions and
                      all-gathers them again (then reduce-scatters dx)
  inside, row @       as in demo 08 (tensor parallelism): on all T positions
  reduce-scatter      along T: sum the partial sums over tp, keep my positions (backward:
                      all-gather), the same bytes as the all-gather
  + residual          dropout and residual add on my positions only"""


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
        Plan(tp=a.tp, sequence_parallel=True).validate(cfg, a.global_batch, data_cfg.block_size)
    except ValueError as e:
        ap.error(str(e))
    return a


@dataclass(frozen=True)
class TracedTP(TensorParallel):
    """TensorParallel that writes down (input, output) of the all-gather fused with the
    column matmul and of the reduce-scatter (exit); traced() adds a layer's forward."""
    log: list = field(default_factory=list, compare=False)

    def matmul(self, x, w):
        self.log.append((x, super().matmul(x, w)))
        return self.log[-1][1]

    def exit(self, y):
        self.log.append((y, super().exit(y)))
        return self.log[-1][1]

    def traced(self, layer) -> None:
        forward = layer.forward

        def logged(x):
            self.log.append((x, forward(x)))
            return self.log[-1][1]
        layer.forward = logged


class Unsummed(TensorParallel):
    """The classic SP bug, on purpose: replicated parameters skip f, so their .grad keeps
    only the part from this rank's positions."""

    def sum_grad(self, p):
        return p


def desc(t, lo: int) -> str:
    """'(B, T, C) Placement positions a-b' of an activation (untagged = Replicate)."""
    where = pl.placement_tag(t, "tp") or pl.Replicate()
    pos = f"pos {lo}-{lo + t.shape[1] - 1}" if where == pl.Shard(1) else ""
    return f"{str(tuple(t.shape)):11s} {str(where):11s} {pos:9s}"


def region(tp, part: str, ln, body, x, lo: int) -> tuple:
    """x + body(ln(x)) on my positions, and one line per stage of the region."""
    tp.log.clear()
    a = ln(x)                                              # (B, T_tp, C)
    out = x + body(a)                                      # (B, T_tp, C)
    (g_in, _), (_, col), (s_in, s_out), (row_in, _) = tp.log         # order of return
    ends = [(x, a), (g_in, col), (col, row_in), (row_in, s_in), (s_in, s_out), (s_out, out)]
    return out, [f"  {part if i == 0 else '':4s} {STAGES[i]:18s} {desc(i_, lo)} -> "
                 f"{desc(o, lo)}".rstrip() for i, (i_, o) in enumerate(ends)]


def rank_main(ctx, cfg, data_cfg, args):
    """Everything here runs on every rank; ctx.rank says which one we are."""
    pl.set_checking(True)                                  # tag every activation's placement
    x, y = SyntheticData(data_cfg).global_batch(0, SHOW_BATCH)         # (B, T) each
    tp = TracedTP(ctx.world, sequence_parallel=True)
    model = apply_tensor(GPT(cfg, args.seed), tp)
    lo = int(model.layout.positions(x.shape[1])[0])        # my positions: lo .. lo + T_tp - 1
    blk = model.blocks[0]
    for layer in (blk.attn.qkv, blk.attn.proj, blk.mlp.fc, blk.mlp.proj):
        tp.traced(layer)
    h = model.embed(x)                                     # (B, T_tp, C): reduce-scattered
    show = dict(lo=lo, embed=h.numpy(), embed_desc=desc(h, lo))
    h, attn = region(tp, "attn", blk.ln_1, blk.attn, h, lo)
    h, mlp = region(tp, "mlp", blk.ln_2, blk.mlp, h, lo)
    show.update(flow=attn + mlp, block=h.numpy())
    _, loss = model(x, y)                                  # the whole model, my positions
    loss.backward()
    show["grads"] = {n: (p.grad.copy(), pl.placement_of(p, "tp"))
                     for n, p in model.named_parameters()}
    buggy = apply_tensor(GPT(cfg, args.seed), Unsummed(ctx.world, sequence_parallel=True))
    _, loss = buggy(x, y)
    loss.backward()
    show["unsummed"] = {n: p.grad.copy() for n, p in buggy.named_parameters()
                        if isinstance(pl.placement_of(p, "tp"), pl.Replicate)}
    run = train_on_rank(ctx, cfg, data_cfg,
                        Plan(tp=ctx.world_size, sequence_parallel=True,
                                                  check_placements=True),
                        RunConfig(steps=args.steps, global_batch=args.global_batch, seed=args.seed),
                        OptimizerConfig(lr=args.lr))
    return show, run


def reference(cfg, data_cfg, seed) -> dict:
    """Block 0 and every gradient in one process, on the whole sequence."""
    model, (x, y) = GPT(cfg, seed), SyntheticData(data_cfg).global_batch(0, SHOW_BATCH)
    blk, e = model.blocks[0], model.embed(x)                # (B, T, C)
    h = e + blk.attn(blk.ln_1(e))
    h = h + blk.mlp(blk.ln_2(h))
    _, loss = model(x, y)
    loss.backward()
    return dict(T=x.shape[1], embed=e.numpy(), block=h.numpy(),
                grads={n: p.grad for n, p in model.named_parameters()})


def show_grads(runs, ref, W: int, T_tp: int) -> float:
    """The LayerNorm gain's gradient: per rank from its positions, summed, 1 process."""
    print(f"{GRAD}.grad, first entries; each rank's LayerNorm saw only its {T_tp} positions:")
    rows = [(f"rank {r}, from positions {r * T_tp}-{(r + 1) * T_tp - 1} only (no f)",
             show["unsummed"][GRAD]) for r, (show, _) in enumerate(runs)]
    rows.append(("their sum over the tp ranks", sum(s["unsummed"][GRAD] for s, _ in runs)))
    rows += [(f"rank {r}, .grad after f's all-reduce", show["grads"][GRAD][0])
             for r, (show, _) in enumerate(runs)]
    for label, g in rows + [("1 process", ref["grads"][GRAD])]:
        print(f"  {label:40s} [" + " ".join(f"{v:+.6f}" for v in g[:4]) + " ...]")
    worst = max(float(np.max(np.abs(g - pl.shard(ref["grads"][n], p, W, r))))
                for r, (show, _) in enumerate(runs) for n, (g, p) in show["grads"].items())
    bug = max(float(np.max(np.abs(g - ref["grads"][n])))
              for show, _ in runs for n, g in show["unsummed"].items())
    print(f"every gradient on every rank (of a sharded parameter: my slice) vs 1 process: max "
          f"|Δ| = {worst:.1e}\n  (without f, the replicated ones would be off by up to "
          f"{bug:.1e})")
    return worst


def main(argv=None) -> int:
    args = parse_args(argv)
    W, data_cfg = args.tp, DataConfig(task="sort", length=args.length, seed=args.seed)
    cfg = model_config_for(data_cfg, n_layer=args.n_layer, n_embd=args.n_embd,
                           n_head=args.n_head, dtype="float64")
    T = data_cfg.block_size
    B, T_tp, C = SHOW_BATCH, T // W, cfg.n_embd
    print(f"demo 09 · sequence parallel · tp={W} · T={T} positions, T_tp={T_tp} per rank\n"
          f"GPT {cfg.n_layer} layers, C={C}, H={cfg.n_head} · float64")
    print(f"outside the tensor-parallel regions rank r holds x[B, T_tp, C], positions "
          f"r·{T_tp} .. r·{T_tp} + {T_tp - 1}:\n  each LayerNorm, dropout and residual add "
          f"keeps B·T_tp·C = {B * T_tp * C} numbers per rank, not B·T·C = {B * T * C}")
    runs = spawn(W, rank_main, cfg, data_cfg, args)
    ref = reference(cfg, data_cfg, args.seed)
    print(f"block 0 forward, B={B}, T={T}, C={C}, per rank: (shape, placement over tp, "
          f"positions) in -> out\n{LEGEND}")
    worst = 0.0
    for r, (show, _) in enumerate(runs):
        lo = show["lo"]
        print(f"rank {r}: the embedding's output (after its reduce-scatter) {show['embed_desc']}"
              .rstrip())
        print("\n".join(show["flow"]))
        for key in ("embed", "block"):                    # my positions of the 1-process run
            worst = max(worst, float(np.max(np.abs(show[key] - ref[key][:, lo:lo + T_tp]))))
    print(f"embedding and block 0 output, each rank vs the same positions of 1 process: "
          f"max |Δ| = {worst:.1e}")
    worst = max(worst, show_grads(runs, ref, W, T_tp))
    base = train_single_process(cfg, data_cfg, steps=args.steps, global_batch=args.global_batch,
                                lr=args.lr, seed=args.seed)
    for s, (a, b) in enumerate(zip(runs[0][1].losses, base.losses)):
        print(f"step {s} | loss tp={W} SP {a:.15f} | 1 process {b:.15f} | |Δ| {abs(a - b):.1e}")
        worst = max(worst, abs(a - b))
    d_param = max(float(np.max(np.abs(runs[0][1].params[k] - v))) for k, v in base.params.items())
    print(f"final parameters, gathered over tp, vs 1 process: max |Δ| = {d_param:.1e}\n  (check "
          "mode compared every replicated gradient across the tp ranks after each backward)")
    ok = max(worst, d_param) < 1e-10
    print(f"{'OK' if ok else 'MISMATCH'}: tp={W} sequence-parallel = 1 process (max |Δ| = "
          f"{max(worst, d_param):.1e}): training, the shards, the gradients")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
