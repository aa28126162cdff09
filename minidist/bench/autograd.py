"""Benchmark: one GPT training step in the tiny autograd, and in PyTorch on the same numbers.

What it measures, per model size: the median time of the forward (loss), the backward and
the optimizer step (AdamW) over `--repeats` steps, after warm-up, with minidist and PyTorch
steps interleaved so that both see the same machine load; then a per-op breakdown
from a separate profiled run (by Function class, forward and backward apart: time, the
FLOPs the FLOP ledger counts, the bytes the op must move at least, and what that achieves
against this machine's measured one-thread GEMM rate or copy bandwidth); then,
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
from minidist.autograd.saved import ctx_arrays  # noqa: E402
from minidist.autograd.tensor import Observer, observe, unobserve  # noqa: E402
from minidist.cli import CliParser, at_least            # noqa: E402
from minidist.nn import GPT, GPTConfig         # noqa: E402
from minidist.observe.flops import FlopLedger  # noqa: E402
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
    """Times every operation's forward and, when it runs, its backward rule, by class name,
    and counts the bytes each one must move at least.

    An autograd Observer: plugged in for the duration of `profiling` only, so nothing in
    autograd/ changes. table[(name, "fwd" | "bwd")] accumulates [seconds, calls, bytes].
    Bytes, each array once: a forward reads its array inputs and writes its output; a
    backward reads the incoming gradient and what its node kept (autograd/saved.py's
    ctx_arrays) and writes the gradients it returns. What an op's NumPy passes move on top
    (temporaries, a second pass) is not counted: the bytes are the op's floor.
    """

    def __init__(self, table: dict) -> None:
        self.table = table

    def forward(self, fn, ctx, args, arrays, kwargs, result, t0) -> None:
        seconds = time.perf_counter() - t0
        moved = _nbytes(arrays) + _nbytes([result.data])
        _add(self.table, (fn.__name__, "fwd"), seconds, moved)
        if result._node is not None:
            bwd, ctx, parents = result._node
            result._node = (self._timed(bwd, fn.__name__), ctx, parents)

    def _timed(self, backward, name: str):
        def timed_backward(ctx, g):
            t0 = time.perf_counter()
            out = backward(ctx, g)
            seconds = time.perf_counter() - t0
            grads = out if isinstance(out, tuple) else (out,)
            _add(self.table, (name, "bwd"), seconds,
                 _nbytes([g]) + _nbytes(ctx_arrays(ctx)) + _nbytes(grads))
            return out
        return timed_backward


def _nbytes(arrays) -> int:
    """Bytes of the distinct arrays among `arrays` (anything else counts 0)."""
    seen = {id(a): a.nbytes for a in arrays if isinstance(a, np.ndarray)}
    return sum(seen.values())


@contextmanager
def profiling(table: dict):
    """`with profiling(table):` every operation inside is timed into table (see Profiler)."""
    profiler = observe(Profiler(table))
    try:
        yield table
    finally:
        unobserve(profiler)


def _add(table: dict, key, seconds: float, moved: int = 0) -> None:
    entry = table.setdefault(key, [0.0, 0, 0])
    entry[0] += seconds
    entry[1] += 1
    entry[2] += moved


@dataclass(frozen=True)
class OpCost:
    """One (op, fwd|bwd) row of the breakdown, per step: time, calls, the bytes it must
    move (Profiler) and the FLOPs it executes (observe/op_flops.py: matmul and other)."""

    ms: float
    calls: int
    bytes: int
    matmul_flops: int
    other_flops: int

    def rate(self, gemm_flops: float, bandwidth: float) -> str:
        """What it achieved against the machine: a matmul op's FLOP rate as a fraction of
        the measured GEMM rate, any other op's bytes per second as a fraction of the
        measured copy bandwidth."""
        seconds = self.ms / 1e3
        if seconds <= 0:
            return ""
        if self.matmul_flops > self.other_flops:
            achieved = (self.matmul_flops + self.other_flops) / seconds
            return f"{achieved / 1e9:7.1f} GFLOP/s {achieved / gemm_flops:5.0%} of GEMM"
        achieved = self.bytes / seconds
        return f"{achieved / 1e9:7.2f} GB/s    {achieved / bandwidth:5.0%} of copy"


def op_breakdown(model: GPT, x, y, steps: int = 3) -> dict:
    """{(op, "fwd"|"bwd"): OpCost per step} from `steps` profiled steps (the FLOP ledger
    counts them at the same time)."""
    table: dict = defaultdict(lambda: [0.0, 0, 0])
    ledger = FlopLedger()
    with profiling(table), ledger:
        for _ in range(steps):
            _, loss = model(x, y)
            loss.backward()
            model.zero_grad()
    phase = {"fwd": "forward", "bwd": "backward"}
    out = {}
    for (op, kind), (seconds, calls, moved) in table.items():
        mm, other, _ = ledger.entries.get((op, phase[kind]), (0, 0, 0))
        out[op, kind] = OpCost(seconds / steps * 1e3, calls // steps, moved // steps,
                               mm // steps, other // steps)
    return out


def machine_rates(cfg: GPTConfig, batch: int, repeats: int = 7) -> tuple[float, float]:
    """(GEMM FLOP/s, copy bytes/s) of this machine, one thread, medians of `repeats`: the
    GEMM is the model's MLP up-projection, (B T, C) @ (C, 4 C) in its dtype; the copy
    moves 64 MiB (read + written), far beyond the caches."""
    dtype, C, M = np.dtype(cfg.dtype), cfg.n_embd, batch * cfg.block_size
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, C)).astype(dtype)
    b = rng.standard_normal((C, cfg.mlp_ratio * C)).astype(dtype)
    out = np.empty((M, cfg.mlp_ratio * C), dtype)
    src = np.ones(1 << 24, np.float32)
    dst = np.empty_like(src)

    def median_seconds(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    gemm = 2 * M * C * cfg.mlp_ratio * C / median_seconds(lambda: np.matmul(a, b, out=out))
    copy = 2 * src.nbytes / median_seconds(lambda: np.copyto(dst, src))
    return gemm, copy


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
    gemm, copy = machine_rates(cfg, batch)
    profiled = sum(c.ms for c in ops.values())
    print(f"per-op cost per step, forward + backward (profiled run: ops sum to {profiled:.3f} "
          f"ms vs {(ours.forward + ours.backward) * 1e3:.3f} ms unprofiled); this machine, "
          f"one thread: GEMM {gemm / 1e9:.1f} GFLOP/s ({cfg.dtype}, the MLP's "
          f"{batch * cfg.block_size}x{cfg.n_embd} @ {cfg.n_embd}x{cfg.mlp_ratio * cfg.n_embd}), "
          f"copy {copy / 1e9:.1f} GB/s (64 MiB, read + written; an op whose arrays stay "
          "in the caches can pass it):")
    print(f"  {'op':14s} {'':3s} {'ms':>8s} {'calls':>5s} {'MFLOP':>9s} {'MB moved':>9s}  "
          "achieved (matmul ops: FLOP rate; others: bytes at least moved)")
    for (op, phase), c in sorted(ops.items(), key=lambda kv: -kv[1].ms)[:12]:
        print(f"  {op:14s} {phase}  {c.ms:8.3f} {c.calls:5d} "
              f"{(c.matmul_flops + c.other_flops) / 1e6:9.1f} {c.bytes / 1e6:9.2f}  "
              f"{c.rate(gemm, copy)}")
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
