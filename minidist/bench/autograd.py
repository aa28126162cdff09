"""Benchmark: one GPT training step in the tiny autograd, and in PyTorch on the same numbers.

What it measures, per model size: the median time of the forward (loss), the backward and
the optimizer step (AdamW) over `--repeats` steps, after warm-up, with minidist and PyTorch
steps interleaved so that both see the same machine load; then a per-op breakdown
from a separate profiled run (time by Function class, forward and backward apart); then,
if PyTorch is installed, the identical model (weights copied from minidist, same batch,
the same op sequence written out by hand as in nanoGPT's non-flash path; dense, biased,
tied head, no dropout, as in SIZES) in PyTorch CPU eager with torch.set_num_threads(1),
and the ratio minidist / PyTorch. The loss at init is printed for both as a check that
they compute the same function.

Sizes: "tiny" (C=32, 2 layers, T=12): ~200 ops of a few microseconds each, so Python
overhead per op dominates; "c256" (C=256, 4 layers, T=128): matmul-dominated, so both
run at roughly BLAS speed. Both float32, --batch rows (default 8). BLAS is pinned to one
thread (the environment variables are set before NumPy is imported, or the bench re-runs
itself so that they are), and glibc keeps freed memory (runtime/process_setup.py), as in
every rank; PyTorch, in the same process, gets the same allocator.

Run: python -m minidist.bench.autograd [--sizes tiny c256] [--batch 8] [--repeats 10]
     [--no-torch]
     or python -m minidist bench autograd ...
Read next: bench/train.py
"""

from __future__ import annotations

import os
import sys

_BLAS_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# BLAS reads these once, when NumPy is first imported. `python -m minidist ...` imports
# NumPy (via the package) before this module runs; main() then re-runs the bench in a
# child process with the variables set, instead of timing a 2-thread BLAS.
_BLAS_PINNED = "numpy" not in sys.modules or all(os.environ.get(v) == "1" for v in _BLAS_VARS)
for _var in _BLAS_VARS:
    os.environ.setdefault(_var, "1")

import subprocess                              # noqa: E402
import statistics                              # noqa: E402
import time                                    # noqa: E402
from collections import defaultdict            # noqa: E402
from contextlib import contextmanager          # noqa: E402
from dataclasses import dataclass              # noqa: E402

import numpy as np                             # noqa: E402

from minidist import optim                     # noqa: E402
from minidist.autograd.tensor import Observer, observe, unobserve  # noqa: E402
from minidist.cli import CliParser, at_least            # noqa: E402
from minidist.nn import GPT, GPTConfig         # noqa: E402
from minidist.runtime.process_setup import keep_freed_memory  # noqa: E402

SIZES = {
    "tiny": GPTConfig(vocab_size=11, block_size=12, n_layer=2, n_head=2, n_embd=32,
                      dtype="float32"),
    "c256": GPTConfig(vocab_size=64, block_size=128, n_layer=4, n_head=4, n_embd=256,
                      dtype="float32"),
}
BATCH = 8


@dataclass(frozen=True)
class StepTimes:
    """Median seconds per phase of one training step."""

    forward: float
    backward: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.optimizer


def make_batch(cfg: GPTConfig, seed: int = 0,
               batch: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, cfg.vocab_size, (batch, cfg.block_size))        # (B, T)
    return x, np.roll(x, -1, axis=1)                                    # next-token targets


def median_phases(steps: dict, repeats: int, warmup: int = 2) -> dict[str, StepTimes]:
    """{name: median StepTimes} for step functions run INTERLEAVED (a, b, a, b, ...).

    Interleaving makes both implementations see the same background load, so their ratio
    stays meaningful on a busy machine even when the absolute times drift.
    """
    for _ in range(warmup):
        for step in steps.values():
            step()
    samples: dict = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            samples[name].append(step())
    return {name: StepTimes(*(statistics.median(s[i] for s in runs) for i in range(3)))
            for name, runs in samples.items()}


def minidist_step_fn(model: GPT, x, y):
    """A timed training step (forward, backward, AdamW) -> (seconds per phase)."""
    opt = optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        _, loss = model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    return step


class Profiler(Observer):
    """Times every operation's forward and, when it runs, its backward rule, by class name.

    An autograd Observer: plugged in for the duration of `profiling` only, so nothing in
    autograd/ changes. table[(name, "fwd" | "bwd")] accumulates [seconds, calls].
    """

    def __init__(self, table: dict) -> None:
        self.table = table

    def forward(self, fn, ctx, args, arrays, kwargs, result, t0) -> None:
        _add(self.table, (fn.__name__, "fwd"), time.perf_counter() - t0)
        if result._node is not None:
            bwd, ctx, parents = result._node
            result._node = (self._timed(bwd, fn.__name__), ctx, parents)

    def _timed(self, backward, name: str):
        def timed_backward(ctx, g):
            t0 = time.perf_counter()
            out = backward(ctx, g)
            _add(self.table, (name, "bwd"), time.perf_counter() - t0)
            return out
        return timed_backward


@contextmanager
def profiling(table: dict):
    """`with profiling(table):` every operation inside is timed into table (see Profiler)."""
    profiler = observe(Profiler(table))
    try:
        yield table
    finally:
        unobserve(profiler)


def _add(table: dict, key, seconds: float) -> None:
    entry = table.setdefault(key, [0.0, 0])
    entry[0] += seconds
    entry[1] += 1


def op_breakdown(model: GPT, x, y, steps: int = 3) -> dict:
    """{(op, "fwd"|"bwd"): (ms per step, calls per step)} from `steps` profiled steps."""
    table: dict = defaultdict(lambda: [0.0, 0])
    with profiling(table):
        for _ in range(steps):
            _, loss = model(x, y)
            loss.backward()
            model.zero_grad()
    return {k: (v[0] / steps * 1e3, v[1] // steps) for k, v in table.items()}


def torch_loss(P, xt, yt, cfg: GPTConfig, block=None):
    """GPT forward + mean cross-entropy in PyTorch, op for op as nn/gpt.py computes it.
    P maps minidist's parameter names to torch tensors (a dict, or anything with []);
    block(i, h) runs block i (default: torch_block on P's "blocks.i." parameters)."""
    import torch.nn.functional as tF

    B, T = xt.shape
    C = cfg.n_embd
    h = P["wte.weight"][xt] + P["wpe.weight"][:T]                            # (B, T, C)
    for i in range(cfg.n_layer):
        h = torch_block(P, f"blocks.{i}.", h, cfg) if block is None else block(i, h)
    h = tF.layer_norm(h, (C,), P["ln_f.weight"], P["ln_f.bias"], 1e-5)
    logits = h @ P["wte.weight"].T                                           # (B, T, V)
    return tF.cross_entropy(logits.reshape(B * T, -1), yt.reshape(-1), ignore_index=-100)


def torch_block(P, b: str, h, cfg: GPTConfig):
    """One Block in PyTorch: h (B, T, C) -> (B, T, C), parameters P[b + name]."""
    import torch
    import torch.nn.functional as tF

    B, T, C = h.shape
    H = cfg.n_head
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    a = tF.layer_norm(h, (C,), P[b + "ln_1.weight"], P[b + "ln_1.bias"], 1e-5)
    q, k, v = (a @ P[b + "attn.qkv.weight"] + P[b + "attn.qkv.bias"]).split(C, -1)
    q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    att = (q @ k.transpose(-2, -1)) * (1.0 / (C // H) ** 0.5)              # (B, H, T, T)
    att = torch.softmax(att.masked_fill(future, float("-inf")), dim=-1)
    o = (att @ v).transpose(1, 2).reshape(B, T, C)                         # (B, T, C)
    h = h + o @ P[b + "attn.proj.weight"] + P[b + "attn.proj.bias"]
    a = tF.layer_norm(h, (C,), P[b + "ln_2.weight"], P[b + "ln_2.bias"], 1e-5)
    a = tF.gelu(a @ P[b + "mlp.fc.weight"] + P[b + "mlp.fc.bias"], approximate="tanh")
    return h + a @ P[b + "mlp.proj.weight"] + P[b + "mlp.proj.bias"]


def torch_step_fn(model: GPT, x, y):
    """(timed step, loss-at-current-weights) for the same model in PyTorch, weights copied."""
    import torch

    torch.set_num_threads(1)
    P = {n: torch.tensor(v, requires_grad=True) for n, v in model.state_dict().items()}
    xt, yt = torch.tensor(x), torch.tensor(y)
    opt = torch.optim.AdamW(list(P.values()), lr=1e-4, weight_decay=0.0)

    def step() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        loss = torch_loss(P, xt, yt, model.cfg)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    return step, lambda: float(torch_loss(P, xt, yt, model.cfg).item())


def have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def bench_size(name: str, repeats: int, use_torch: bool, batch: int = BATCH) -> dict:
    """Time one size in minidist (and PyTorch); print a table; return the numbers."""
    cfg = SIZES[name]
    x, y = make_batch(cfg, batch=batch)
    model = GPT(cfg, seed=0)
    print(f"\n== {name}: C={cfg.n_embd}, {cfg.n_layer} layers, H={cfg.n_head}, "
          f"T={cfg.block_size}, B={batch}, V={cfg.vocab_size}, {cfg.dtype}, "
          f"{model.num_parameters():,} params ==")
    ref_loss = model(x, y)[1].item()
    torch_step, torch_loss = torch_step_fn(model, x, y) if use_torch else (None, None)
    if use_torch:
        print(f"loss at init: minidist {ref_loss:.6f}, torch {torch_loss():.6f} "
              f"(same weights, same batch)")
    steps = {"minidist": minidist_step_fn(model, x, y)}
    if use_torch:
        steps["torch"] = torch_step
    times = median_phases(steps, repeats)
    ours, theirs = times["minidist"], times.get("torch")
    print(f"{'phase':10s} {'minidist ms':>12s} {'torch ms':>10s} {'ratio':>7s}")
    for phase in ("forward", "backward", "optimizer", "total"):
        a = getattr(ours, phase) * 1e3
        if theirs is None:
            print(f"{phase:10s} {a:12.3f}")
        else:
            b = getattr(theirs, phase) * 1e3
            print(f"{phase:10s} {a:12.3f} {b:10.3f} {a / b:6.2f}x")
    ops = op_breakdown(GPT(cfg, seed=0), x, y)
    profiled = sum(ms for ms, _ in ops.values())
    print(f"per-op time per step, forward + backward (profiled run: ops sum to {profiled:.3f} "
          f"ms vs {(ours.forward + ours.backward) * 1e3:.3f} ms unprofiled):")
    for (op, phase), (ms, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"  {op:14s} {phase}  {ms:8.3f} ms  {calls:5d} calls")
    return {"minidist": ours, "torch": theirs, "ops": ops}


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist bench autograd`: time GPT training steps; compare with PyTorch."""
    ap = CliParser(prog="python -m minidist bench autograd",
                                 description=main.__doc__)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--batch", type=at_least(1), default=BATCH,
                    help=f"rows (sequences) per step (default {BATCH})")
    ap.add_argument("--repeats", type=at_least(1), default=10)
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    args = ap.parse_args(argv)
    if not _BLAS_PINNED:
        print("NumPy was imported before BLAS could be pinned to 1 thread; re-running the "
              "bench in a child process with OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=1.", flush=True)
        env = {**os.environ, **{v: "1" for v in _BLAS_VARS}}
        argv = sys.argv[1:] if argv is None else argv
        return subprocess.run([sys.executable, "-m", "minidist.bench.autograd", *argv],
                              env=env).returncode
    keep_freed_memory()            # as every rank does (`python -m minidist` did it already)
    use_torch = not args.no_torch and have_torch()
    threads = {v: os.environ.get(v) for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    print(f"autograd bench · numpy {np.__version__} · BLAS threads {threads} · "
          f"torch {'on' if use_torch else 'not installed / off'} · medians of {args.repeats}")
    for name in args.sizes:
        bench_size(name, args.repeats, use_torch, args.batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
