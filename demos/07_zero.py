"""ZeRO stages 0-3 on W ranks: the memory each rank holds, measured and predicted.

What you will see: the paper's worked example (7.5B parameters on 64 GPUs), the same
formulas for this tiny GPT in float64, a map of which rank owns which elements of which
parameter, then the same training run under stages 0 (DDP), 1, 2 and 3: the bytes each
rank holds (measured from its arrays) next to the exact formula, the bytes each rank sent
per step next to the formula, and the final loss of every stage next to the 1-process
run's.

Run:       python demos/07_zero.py --world-size 4 [--steps 3 --micro-batches 2 --algo direct]
Read with: minidist/parallel/zero/flat.py, engine.py, stage3.py, memory.py, minidist/train.py
Paper:     Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
           Parameter Models", arXiv:1910.02054, Sec. 5 and Fig. 1
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")           # one BLAS thread per rank

import argparse                                # noqa: E402
import textwrap                                # noqa: E402

import numpy as np                             # noqa: E402

from minidist.baseline import train_single_process                      # noqa: E402
from minidist.cli import CliParser                                      # noqa: E402
from minidist.data import DataConfig, model_config_for                  # noqa: E402
from minidist.nn import GPT                                             # noqa: E402
from minidist.parallel.zero import memory as zm                         # noqa: E402
from minidist.parallel.zero.flat import ownership_map, split_units           # noqa: E402
from minidist.runtime.launch import spawn                               # noqa: E402
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank  # noqa: E402

# --- settings (each can be overridden on the command line) ---
WORLD_SIZE, STEPS, GLOBAL_BATCH, MICRO_BATCHES, LR, SEED = 4, 3, 16, 1, 3e-3, 0
N_LAYER, N_EMBD, N_HEAD, ALGO, MAP_LINES = 2, 32, 2, "ring", 8
# each number option's (low, high): the demo stays small
LIMITS = dict(world_size=(1, 8), steps=(1, 10_000), global_batch=(1, 512),
              micro_batches=(1, 64), lr=(0.0, 1.0), seed=(0, 2 ** 32), n_layer=(1, 8),
              n_embd=(1, 256), n_head=(1, 64), map_lines=(0, 10_000))


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(world_size=WORLD_SIZE, steps=STEPS, global_batch=GLOBAL_BATCH,
                        micro_batches=MICRO_BATCHES, lr=LR, seed=SEED, n_layer=N_LAYER,
                        n_embd=N_EMBD, n_head=N_HEAD, map_lines=MAP_LINES), LIMITS)
    ap.add_argument("--algo", default=ALGO, choices=["ring", "direct", "halving", "auto"])
    a = ap.parse_args(argv)
    if a.n_embd % a.n_head:
        ap.error(f"--n-embd {a.n_embd} is not a multiple of --n-head {a.n_head}")
    if a.global_batch % (a.world_size * a.micro_batches):
        ap.error(f"--global-batch {a.global_batch} must be a multiple of --world-size x "
                 f"--micro-batches = {a.world_size * a.micro_batches}")
    data_cfg = DataConfig(task="sort", length=4, seed=a.seed)
    cfg = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head)
    try:
        for stage in range(4):
            Plan(dp=a.world_size, zero=stage, micro_batches=a.micro_batches,
                 algo=a.algo).validate(cfg, a.global_batch, data_cfg.block_size)
    except ValueError as e:
        ap.error(str(e))
    return a


def rank_main(ctx, cfg, data_cfg, plan, args):
    """Every rank runs train.py's loop; the engine (DDP or ZeRO) is chosen by plan.zero."""
    return train_on_rank(ctx, cfg, data_cfg, plan,
                         RunConfig(steps=args.steps, global_batch=args.global_batch,
                                   seed=args.seed),
                         OptimizerConfig(lr=args.lr))


def show_formulas(psi: int, W: int) -> None:
    gb = zm.paper_example()
    print("paper, Ψ = 7.5B, N_d = 64, K = 12 (mixed-precision Adam), per GPU:\n  "
          + " | ".join(f"stage {s} {gb[s]:.1f} GB" for s in range(4)))
    smooth = [zm.formula_bytes(s, psi, W, param_bytes=8, grad_bytes=8, k=16)["total"]
              for s in range(4)]
    print(f"same formulas here, Ψ = {psi}, N_d = {W}, b = 8, K = 2b = 16 (AdamW m, v), "
          "per rank:\n  " + " | ".join(f"stage {s} {v:,.0f} B" for s, v in enumerate(smooth)))


def show_memory(runs, numels, W, M) -> bool:
    """The bytes table; True if every rank's measured bytes equal the exact formula."""
    ok = True
    print("bytes per rank (measured from the arrays = exact formula); every rank the same:")
    print("  stage |     params |      grads |  optimizer |      total | formula total")
    for s, rs in runs.items():
        want = zm.exact_bytes(s, numels, W, 8, micro_batches=M)
        ok &= all(r.memory == want for r in rs)
        m = rs[0].memory
        total = m["params"] + m["grads"] + m["optimizer"]
        print(f"  {s:5d} | {m['params']:10,} | {m['grads']:10,} | {m['optimizer']:10,} | "
              f"{total:10,} | {want['params'] + want['grads'] + want['optimizer']:13,}")
        if s == 3:
            print(f"  ZeRO-3's peak of gathered parameters: {m['peak_gathered_params']:,} B "
                  f"(formula {want['peak_gathered_params']:,})")
    return ok


def show_bytes(runs, numels, W, M, algo) -> bool:
    """Bytes sent per rank per step next to the formula (exact for the ring algorithms)."""
    ok = True
    print("bytes sent per rank per step (stages 1-3, formula (W-1)(passes·S + 1)·8 B):")
    for s in (1, 2, 3):
        sent = {t["sent"] for r in runs[s] for t in r.bytes_per_step}
        want = 8 * zm.comm_elements(s, numels, W, M)
        exact = algo == "ring"               # direct reduces in shared memory: no messages
        ok &= sent == {want} or not exact
        print(f"  stage {s}: {sorted(sent)} (formula {want}{'' if exact else ', ring only'})")
    return ok


def main() -> None:
    args = parse_args()
    W, M = args.world_size, args.micro_batches
    data_cfg = DataConfig(task="sort", length=4, seed=args.seed)
    cfg = model_config_for(data_cfg, n_layer=args.n_layer, n_embd=args.n_embd,
                           n_head=args.n_head)
    units = split_units(GPT(cfg, seed=None), W)
    numels = [u.numel for u in units]
    print(f"demo 07 · ZeRO stages 0-3 · world_size={W} · GPT {cfg.n_layer} layers, "
          f"C={cfg.n_embd} · Ψ = {sum(numels)} params\nfloat64 · AdamW · algo {args.algo}")
    show_formulas(sum(numels), W)
    print("who owns what: each unit is one flat vector padded to a multiple of W;\n"
          "rank r owns elements [r S, (r+1) S) of it:")
    lines = ownership_map(units)
    for line in lines[:args.map_lines]:
        print(textwrap.fill(line, 100, initial_indent="  ", subsequent_indent="        "))
    if len(lines) > args.map_lines:
        print(f"  ... ({len(lines) - args.map_lines} more lines; --map-lines 999 shows all)")

    ref = train_single_process(cfg, data_cfg, steps=args.steps, global_batch=args.global_batch,
                               lr=args.lr, seed=args.seed, grad_accum=M)
    runs = {s: spawn(W, rank_main, cfg, data_cfg,
                     Plan(dp=W, zero=s, micro_batches=M, algo=args.algo), args)
            for s in range(4)}
    ok = show_memory(runs, numels, W, M) & show_bytes(runs, numels, W, M, args.algo)
    worst = 0.0
    for s, rs in runs.items():
        final = rs[0].params
        worst = max([worst] + [float(np.max(np.abs(final[k] - v))) for k, v in ref.params.items()])
        print(f"  stage {s}: final loss {rs[0].losses[-1]:.15f}")
    print(f"  1-process: final loss {ref.losses[-1]:.15f}")
    same = all(np.array_equal(runs[s][0].params[k], runs[0][0].params[k])
               for s in (1, 2, 3) for k in ref.params)
    direct = args.algo in ("direct", "auto")
    print(f"stages 0-3 bitwise identical parameters: {same}" + (
        "" if direct else "\n  (the ring adds each chunk in its own order; with --algo direct "
                          "they are)"))
    ok &= worst < 1e-12 and (same or not direct)
    verdict = "OK" if ok else "MISMATCH"
    extra = "stages bitwise equal" if direct else "bytes sent = formula"
    print(f"{verdict}: ZeRO 0-3 on {W} ranks match 1 process (max |Δ| = {worst:.1e}); "
          f"memory = formula; {extra}")
    raise SystemExit(verdict != "OK")


if __name__ == "__main__":
    main()
