"""Benchmark: synchronising less, or in fewer bits, against DDP on the task: loss and bytes.

`python -m minidist bench sync` trains the same model, data and seed on dp ranks with
    DDP                  the gradients summed every step (parallel/data/ddp.py)
    local SGD, H = 4     each replica alone for 4 steps, then the replicas' mean (DiLoCo's
                         engine with an outer lr of 1 and no momentum: model averaging)
    DiLoCo, H = 4, 16    each replica alone for H steps, then an outer Nesterov step on the
                         replicas' mean progress (lr 0.7, momentum 0.9; parallel/data/diloco.py)
    1-bit Adam           Adam on summed gradients for the first fifth of the steps, then
                         the momentum as signs + scales with error feedback
                         (parallel/data/onebit_adam.py)
    PowerSGD, rank 1, 4  each gradient matrix summed as a rank-r factorisation with error
                         feedback (parallel/data/powersgd.py)
and prints, per method: the loss at the end (mean of the last 10 steps' global losses),
the bytes rank 0 sent per step for the gradient sync (the dp axis' counters less the
steps' loss sums, measured on a run that never syncs), that figure over DDP's, and the
steps' median time. These methods are not exact: the table is their behaviour on this
task, next to the exact one's. The textbook algorithms (ring, one collective per tensor)
are used by every row, so the bytes compare like for like.

    python -m minidist bench sync [--dp 2 --steps 200 --batch 32 --lr 3e-3]
Read next: parallel/data/diloco.py, parallel/data/onebit_adam.py, parallel/data/powersgd.py.
"""

from __future__ import annotations

import argparse
import statistics

from minidist.cli import at_least
from minidist.data import DataConfig, model_config_for
from minidist.optim import OptimizerConfig
from minidist.runtime.launch import spawn
from minidist.train import Plan, RunConfig, train_on_rank


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m minidist bench sync",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=at_least(2), default=2)
    ap.add_argument("--steps", type=at_least(20), default=200)
    ap.add_argument("--batch", type=at_least(1), default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    a = ap.parse_args(argv)
    if a.batch % a.dp:
        ap.error(f"--batch {a.batch} does not split over --dp {a.dp}")
    return a


def methods(a) -> list[tuple[str, dict]]:
    """(name, Plan fields) of the rows."""
    warm = max(1, a.steps // 5)
    return [("DDP", {}),
            ("local SGD, H = 4", {"local_steps": 4, "outer_lr": 1.0, "outer_momentum": 0.0}),
            ("DiLoCo, H = 4", {"local_steps": 4}),
            ("DiLoCo, H = 16", {"local_steps": 16}),
            (f"1-bit Adam, warm-up {warm}", {"onebit_warmup": warm}),
            ("PowerSGD, rank 1", {"powersgd_rank": 1}),
            ("PowerSGD, rank 4", {"powersgd_rank": 4})]


def _train(a, fields: dict, steps: int):
    data = DataConfig(task="sort")
    cfg = model_config_for(data, dtype="float32")
    plan = Plan(dp=a.dp, algo="ring", buckets=False, **fields)
    return spawn(a.dp, train_on_rank, cfg, data, plan,
                 RunConfig(steps=steps, global_batch=a.batch, seed=0),
                 OptimizerConfig(lr=a.lr))[0]


def main(argv=None) -> int:
    a = parse_args(argv)
    print(f"bench sync · dp={a.dp}, GPT (the main job's), float32, batch {a.batch}, "
          f"{a.steps} steps, lr {a.lr}\nreductions: ring, one collective per tensor")
    quiet = _train(a, {"local_steps": a.steps + 1}, 2)          # the loss sums alone
    loss_bytes = quiet.bytes_by_axis[-1]["dp"]
    rows = []
    for name, fields in methods(a):
        r = _train(a, fields, a.steps)
        sync = statistics.mean(b["dp"] - loss_bytes for b in r.bytes_by_axis)
        rows.append((name, statistics.mean(r.losses[-10:]), sync,
                     statistics.median(r.timing["step"])))
    ddp = rows[0][2]
    print(f"  {'method':<26}{'loss (last 10)':>15}{'sync B/step':>13}{'vs DDP':>9}"
          f"{'step ms':>9}")
    for name, loss, sync, step in rows:
        print(f"  {name:<26}{loss:>15.4f}{sync:>13,.0f}{sync / ddp:>9.4f}{step * 1e3:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
