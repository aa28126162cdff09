"""Benchmark: minidist beside PyTorch, what a CPU user would pick instead, in one table.

`python -m minidist bench compare` runs both systems on the same GPT (4 layers, C=256,
4 heads, T=128, float32, tied head; the sort task's vocabulary: 3,195,136 parameters) and
the same ranks, one BLAS / OpenMP thread per rank and each rank on a core of its own
(minidist's ranks bind themselves, runtime/process_setup.py; PyTorch's are bound here the
same way), and prints one row per measure:

    all_reduce 8 B, 2 ranks        minidist's all_reduce (algo "auto") vs torch.distributed
    all_reduce 16 MiB, 2 ranks     over gloo: per call the slower rank's time, median
    data parallelism's own cost    t(2 ranks each training alone on 4 rows) / t(dp=2 step on
                                   a global batch of 8): 1.00 means dp is free; minidist's
                                   DDP vs torch DistributedDataParallel
    ZeRO-3 step / DDP step         minidist's ZeRO-3 vs FSDP2 (fully_shard on every block,
                                   then the root), each over its own system's DDP step
    one rank's training step       4 rows, minidist's autograd vs PyTorch eager in ONE
                                   process, steps interleaved (bench/autograd.py)
    dp=2 step, global batch 8      minidist's dp=2 vs DDP over gloo

A training step is the forward, the backward, the gradient norm (minidist's training
loop computes it every step; PyTorch's side calls clip_grad_norm_ with an infinite limit)
and AdamW, timed per step on each rank; a row is the median over steps of the slower
rank. The whole set runs --rounds times (default 3), minidist then PyTorch in each round,
and every cell is the median of its rounds: the machine's load drifts, and alternating
makes both systems see the same drift.

The ratio column is minidist / PyTorch; "better" names the system with the better value
(lower, except for the data-parallel row, where higher means less lost to communication),
or "same" within half a percent.
Without PyTorch installed the command says so in one line and exits 0.

Read next: bench/autograd.py (the op-for-op PyTorch twin of the GPT), bench/train_runs.py.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from minidist.bench import autograd as ag
from minidist.bench import collectives as cb
from minidist.bench.train_runs import measure
from minidist.cli import CliParser, at_least
from minidist.data import DataConfig, model_config_for
from minidist.nn import GPT, GPTConfig
from minidist.train import Plan

DATA = DataConfig("sort", length=64)                           # T = 128
SIZES = {"8 B": 8, "16 MiB": 16 << 20}
ROWS_PER_RANK = 4


def model_config() -> GPTConfig:
    return model_config_for(DATA, n_layer=4, n_head=4, n_embd=256, dtype="float32")


@dataclass(frozen=True)
class Measures:
    """One round of one system, in seconds."""

    all_reduce: dict                 # {"8 B": s, "16 MiB": s}
    alone: float                     # step of one of 2 ranks training alone, 4 rows
    ddp: float                       # dp=2 step, global batch 8
    zero3: float                     # ZeRO-3 (FSDP2) dp=2 step, global batch 8
    one_rank: float                  # one rank's step, 4 rows, in one process


# --- minidist ------------------------------------------------------------------------

def minidist_round(steps: int, warmup: int, one_rank: float) -> Measures:
    """One round of minidist's measures (one_rank: measured beside PyTorch's, in-process)."""
    plan = cb.Plan(ops=("all_reduce",), algos={"all_reduce": ("auto",)},
                   sizes=tuple(SIZES.values()), dtype="float32", iters=0, shared=False)
    by_size = {p.size: p.seconds for p in cb.run(2, plan)}
    common = dict(model_cfg=model_config(), data_cfg=DATA, steps=steps, warmup=warmup)
    p = lambda **kw: Plan(check_placements=False, **kw)                  # noqa: E731
    alone = measure("alone", plan=p(dp=1), alone=2, global_batch=ROWS_PER_RANK, **common)
    ddp = measure("dp=2", plan=p(dp=2), global_batch=2 * ROWS_PER_RANK, **common)
    z3 = measure("zero-3", plan=p(dp=2, zero=3), global_batch=2 * ROWS_PER_RANK, **common)
    return Measures({k: by_size[n] for k, n in SIZES.items()}, alone.step, ddp.step,
                    z3.step, one_rank)


def one_rank_steps(repeats: int) -> tuple[float, float]:
    """(minidist, PyTorch) seconds of one training step on 4 rows, interleaved in this
    process (bench/autograd.py's step functions and twin)."""
    cfg = model_config()
    x, y = ag.make_batch(cfg, batch=ROWS_PER_RANK)
    model = GPT(cfg, seed=0)
    steps = {"minidist": ag.minidist_step_fn(model, x, y),
             "torch": ag.torch_step_fn(model, x, y)[0]}
    t = ag.median_phases(steps, repeats)
    return t["minidist"].total, t["torch"].total


# --- PyTorch -------------------------------------------------------------------------

def torch_gpt(cfg: GPTConfig, state: dict):
    """The GPT as a torch.nn.Module, one submodule per block (FSDP2 shards per module), with
    minidist's initial weights; its forward is bench/autograd.py's twin, op for op."""
    import torch

    def params(names: list, prefix: str = ""):
        return torch.nn.ParameterDict({n[len(prefix):].replace(".", "/"):
                                       torch.nn.Parameter(torch.tensor(state[n]))
                                       for n in names})

    class Block(torch.nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.prefix = f"blocks.{i}."
            self.p = params([n for n in state if n.startswith(self.prefix)], self.prefix)

        def forward(self, h):
            return ag.torch_block(_Named(self.p, self.prefix), self.prefix, h, cfg)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = params([n for n in state if not n.startswith("blocks.")])
            self.blocks = torch.nn.ModuleList(Block(i) for i in range(cfg.n_layer))

        def forward(self, x, y):
            return ag.torch_loss(_Named(self.p), x, y, cfg, lambda i, h: self.blocks[i](h))

    return Model()


class _Named:
    """P[minidist name] -> the parameter of a ParameterDict keyed without `prefix`."""

    def __init__(self, p, prefix: str = "") -> None:
        self.p, self.prefix = p, prefix

    def __getitem__(self, name: str):
        return self.p[name[len(self.prefix):].replace(".", "/")]


def _torch_rank(rank: int, world: int, port: int, steps: int, warmup: int) -> dict:
    """One PyTorch rank: all_reduce, then 2-alone, DDP and FSDP2 steps -> {row: seconds}."""
    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    times: dict = {}
    for name, nbytes in SIZES.items():
        x = torch.ones(nbytes // 4)
        warm, iters = (20, 300) if nbytes < 1 << 20 else (3, 15)
        t = []
        for i in range(warm + iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            t.append(time.perf_counter() - t0)
        times[name] = t[warm:]
    cfg = model_config()
    state = GPT(cfg, seed=0).state_dict()
    rng = np.random.default_rng(rank)
    xb = torch.tensor(rng.integers(0, cfg.vocab_size, (ROWS_PER_RANK, cfg.block_size)))
    yb = torch.roll(xb, -1, 1)
    for kind in ("alone", "ddp", "zero3"):
        model = torch_gpt(cfg, state)
        if kind == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif kind == "zero3":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        t = []
        for i in range(warmup + steps):
            if kind != "alone":
                dist.barrier()
            t0 = time.perf_counter()
            model(xb, yb).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
            t.append(time.perf_counter() - t0)
        times[kind] = t[warmup:]
    dist.destroy_process_group()
    return times


def torch_round(steps: int, warmup: int, one_rank: float) -> Measures:
    """One round of PyTorch's measures: 2 rank processes over gloo (`python -m
    minidist.bench.compare --torch-rank R ...`, each writing its times as JSON)."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="minidist-compare-") as tmp:
        files = [os.path.join(tmp, f"rank{r}.json") for r in range(2)]
        procs = [subprocess.Popen([sys.executable, "-m", "minidist.bench.compare",
                                   "--torch-rank", str(r), "--port", str(port), "--steps",
                                   str(steps), "--warmup", str(warmup), "--out", files[r]])
                 for r in range(2)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"bench compare: a PyTorch rank failed (exit codes {codes}); "
                               "its error is printed above.")
        per_rank = []
        for f in files:
            with open(f) as fh:
                per_rank.append(json.load(fh))
    slowest = {k: statistics.median(max(ts) for ts in zip(per_rank[0][k], per_rank[1][k]))
               for k in per_rank[0]}
    return Measures({k: slowest[k] for k in SIZES}, slowest["alone"], slowest["ddp"],
                    slowest["zero3"], one_rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the table -------------------------------------------------------------------------

ROWS = [  # (label, value of a Measures, unit scale, unit, PyTorch's system, higher is better)
    ("all_reduce 8 B, 2 ranks", lambda m: m.all_reduce["8 B"], 1e6, "us", "gloo", False),
    ("all_reduce 16 MiB, 2 ranks", lambda m: m.all_reduce["16 MiB"], 1e3, "ms", "gloo", False),
    ("data parallelism's own cost, t(2 alone) / t(dp=2)", lambda m: m.alone / m.ddp, 1, "x",
     "DDP", True),
    ("ZeRO-3 step / DDP step, dp=2", lambda m: m.zero3 / m.ddp, 1, "x", "FSDP2", False),
    ("one rank's training step, 4 rows", lambda m: m.one_rank, 1e3, "ms", "eager", False),
    ("dp=2 step, global batch 8", lambda m: m.ddp, 1e3, "ms", "DDP, gloo", False),
]


def table(ours: list[Measures], theirs: list[Measures]) -> str:
    """The side-by-side table: each cell the median of its rounds."""
    lines = [f"{'measure':<52}{'minidist':>12}{'PyTorch':>12}  {'system':<10}{'ratio':>7}"
             f"  better"]
    for label, value, scale, unit, system, higher in ROWS:
        a = statistics.median(value(m) for m in ours)
        b = statistics.median(value(m) for m in theirs)
        if abs(a / b - 1) < 0.005:
            best = "same"                                      # within half a percent
        else:
            best = "minidist" if (a > b) == higher else "PyTorch"
        lines.append(f"{label:<52}{a * scale:>9.2f} {unit:<2}{b * scale:>9.2f} {unit:<2}  "
                     f"{system:<10}{a / b:>7.2f}  {best}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist bench compare`: minidist beside PyTorch in one table."""
    p = CliParser(prog="python -m minidist bench compare", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=at_least(1), default=3,
                   help="rounds, minidist then PyTorch in each; cells are medians (default 3)")
    p.add_argument("--steps", type=at_least(1), default=10,
                   help="measured training steps per run (default 10)")
    p.add_argument("--warmup", type=at_least(0), default=3, help="warm-up steps (default 3)")
    p.add_argument("--torch-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.torch_rank is not None:                  # one PyTorch rank (torch_round starts it)
        times = _torch_rank(a.torch_rank, 2, a.port, a.steps, a.warmup)
        with open(a.out, "w") as fh:
            json.dump(times, fh)
        return 0
    if not ag.have_torch():
        print("bench compare: PyTorch is not installed, so there is nothing to compare with "
              "(pip install torch, CPU build, to run it).")
        return 0
    if len(os.sched_getaffinity(0)) < 2:
        print("bench compare: the 2-rank rows need 2 cores; this process may use "
              f"{len(os.sched_getaffinity(0))}.")
        return 1
    cfg = model_config()
    print(f"bench compare · GPT {cfg.n_layer} layers, C={cfg.n_embd}, {cfg.n_head} heads, "
          f"T={cfg.block_size}, {cfg.dtype}, {GPT(cfg, seed=0).num_parameters():,} params · "
          f"{a.rounds} rounds of {a.warmup} + {a.steps} steps, medians", flush=True)
    ours, theirs = [], []
    for r in range(a.rounds):
        md, pt = one_rank_steps(a.steps)
        ours.append(minidist_round(a.steps, a.warmup, md))
        theirs.append(torch_round(a.steps, a.warmup, pt))
        print(f"  round {r + 1}/{a.rounds} done", flush=True)
    print(table(ours, theirs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
