"""Benchmark: what activation recomputation costs in time and saves in memory, per policy.

One process, no training: it builds the same GPT three times, recompute = "none",
"selective" and "full" (memory/recompute.py), and times forward and backward of one batch
on each, interleaved (none, selective, full, none, ...) so that the machine's load hits
all alike; each column is the median over `--repeats` after `--warmup`. Printed:

    fwd, bwd, step median forward (loss included), backward and their sum, wall clock
    extra          step / step of "none" - 1: the recomputation's share of a step
                   (targets: selective <= 5 %, full about one extra forward)
    cpu, extra     the same for this process's CPU time (one BLAS thread: the compute
                   itself; it moves much less than the wall clock when the machine is shared)
    kept/layer     bytes the autograd keeps for one block's backward (autograd/saved.py,
                   parameters excluded), measured on block 0, and recompute.kept_bytes's
                   formula beside it: the two must be equal
    graph          bytes the whole model's graph keeps until the backward

and the extra time of full recomputation in forwards of "none" (what it recomputes is the
blocks' forward: a little less than the whole forward, which also embeds and computes the
head and the loss). Every policy must give bitwise the same gradients; the bench checks that
and the bytes, and exits 1 if either fails.

Two allocators, two tables (--allocator system|cache|both, default both). With glibc's
defaults ("system"), big freed blocks go back to the system (munmap, heap trimming) and
the next allocation page-faults them in again: a policy that builds and frees a 100 MB
graph every step pays that every step. On the 2-core machine this was written on, "none"
came out slower than selective recomputation, which computes more. "cache" first sets
mallopt so that freed memory stays in the process and is reused (as PyTorch's caching
allocator does on a GPU): that table shows the compute alone. Both are real: the first is
what a NumPy run costs, the second is what the targets are about.

Default model: the tensor-parallel bench model of bench/train.py (4 layers, C = 256,
H = 4, T = 128, batch 8, float32; about a second per repeat on one core).

Run:  python -m minidist bench recompute [--repeats 5] [--warmup 1] [--n-layer 4]
      [--n-embd 256] [--n-head 4] [--length 64] [--batch 8] [--dropout 0.0]
      [--dtype float32] [--allocator both]              (default: about 15 s)
Reference: Chen et al. 2016, arXiv:1604.06174, Sec. 4 (one extra forward); Korthikanti et
    al. 2022, arXiv:2205.05198, Sec. 5 (selective recomputation).
Read next: memory/recompute.py.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")          # effective only if NumPy is not imported yet

import argparse                                # noqa: E402
import ctypes                                  # noqa: E402
import dataclasses                             # noqa: E402
import shlex                                   # noqa: E402
import sys                                     # noqa: E402
import time                                    # noqa: E402
from dataclasses import dataclass              # noqa: E402

import numpy as np                             # noqa: E402

from minidist.autograd import Tensor          # noqa: E402
from minidist.autograd.saved import saved_bytes  # noqa: E402
from minidist.cli import CliParser, at_least  # noqa: E402
from minidist.data import DataConfig, SyntheticData, model_config_for  # noqa: E402
from minidist.memory import recompute as rc   # noqa: E402
from minidist.nn import GPT, DropoutKey, GPTConfig  # noqa: E402


@dataclass(frozen=True)
class Row:
    """One policy: median times (s; wall clock and this process's CPU) and bytes kept."""

    mode: str
    fwd: float
    bwd: float
    cpu_fwd: float
    cpu_bwd: float
    layer: int              # kept for block 0's backward, measured
    formula: int            # recompute.kept_bytes
    graph: int              # kept by the whole model's graph

    @property
    def step(self) -> float:
        return self.fwd + self.bwd

    @property
    def cpu(self) -> float:
        return self.cpu_fwd + self.cpu_bwd


def _key(cfg: GPTConfig, rows: int) -> DropoutKey | None:
    return DropoutKey(0, 0, tuple(range(rows))) if cfg.dropout > 0 else None


def layer_bytes(cfg: GPTConfig, rows: int) -> int:
    """Bytes block 0 of GPT(cfg) keeps for its backward on a (rows, T, C) input."""
    model = GPT(cfg, 0)
    x = np.random.default_rng(0).standard_normal((rows, cfg.block_size, cfg.n_embd))
    y, _ = model.blocks[0](Tensor(x.astype(cfg.dtype), requires_grad=True), _key(cfg, rows))
    return saved_bytes(y, exclude=model.parameters())


def _clocks() -> np.ndarray:
    return np.array([time.perf_counter(), time.process_time()])


def _step(model: GPT, idx, targets, key) -> tuple[np.ndarray, int]:
    """([wall fwd, cpu fwd, wall bwd, cpu bwd] s, bytes the graph keeps) of one batch."""
    model.zero_grad()
    t0 = _clocks()
    _, loss = model(idx, targets, dropout_key=key)
    t1 = _clocks()
    kept = saved_bytes(loss, exclude=model.parameters())
    t2 = _clocks()
    loss.backward()
    return np.concatenate([t1 - t0, _clocks() - t2]), kept


def run(cfg: GPTConfig, batch: int, repeats: int, warmup: int) -> tuple[list[Row], bool]:
    """The three policies' Rows, and whether their gradients are bitwise equal."""
    idx, targets = SyntheticData(DataConfig(task="sort", length=cfg.block_size // 2)) \
        .global_batch(0, batch)
    key = _key(cfg, batch)
    models = {m: GPT(dataclasses.replace(cfg, recompute=m), 0) for m in rc.MODES}
    times: dict[str, list] = {m: [] for m in rc.MODES}
    kept = {}
    for r in range(warmup + repeats):
        for mode, model in models.items():
            t, kept[mode] = _step(model, idx, targets, key)
            if r >= warmup:
                times[mode].append(t)
    grads = {m: [p.grad for p in model.parameters()] for m, model in models.items()}
    same = all(np.array_equal(a, b) for m in ("selective", "full")
               for a, b in zip(grads["none"], grads[m]))
    C, H = cfg.n_embd, cfg.n_head
    rows = []
    for m in rc.MODES:
        wall_f, cpu_f, wall_b, cpu_b = np.median(times[m], axis=0)
        rows.append(Row(m, wall_f, wall_b, cpu_f, cpu_b,
                        layer_bytes(dataclasses.replace(cfg, recompute=m), batch),
                        rc.kept_bytes(m, batch, cfg.block_size, C, H, cfg.mlp_ratio * C,
                                      itemsize=np.dtype(cfg.dtype).itemsize,
                                      dropout=cfg.dropout > 0), kept[m]))
    return rows, same


def render(rows: list[Row]) -> str:
    base = rows[0]
    lines = [f"{'recompute':<11}{'fwd ms':>8}{'bwd ms':>8}{'step ms':>9}{'extra':>8}"
             f"{'cpu ms':>8}{'extra':>8}{'kept/layer B':>14}{'formula B':>12}{'graph B':>13}"]
    for r in rows:
        lines.append(f"{r.mode:<11}{r.fwd * 1e3:>8.1f}{r.bwd * 1e3:>8.1f}{r.step * 1e3:>9.1f}"
                     f"{(r.step / base.step - 1) * 100:>+7.1f}%{r.cpu * 1e3:>8.1f}"
                     f"{(r.cpu / base.cpu - 1) * 100:>+7.1f}%{r.layer:>14,d}{r.formula:>12,d}"
                     f"{r.graph:>13,d}")
    return "\n".join(lines)


def summary(rows: list[Row], same: bool) -> str:
    none, sel, full = rows
    return "\n".join([
        f"selective: {(sel.step / none.step - 1) * 100:+.1f}% of a step "
        f"({(sel.cpu / none.cpu - 1) * 100:+.1f}% in CPU time; target <= +5%), keeps "
        f"{sel.layer / none.layer:.0%} of a layer's activations",
        f"full: {(full.step - none.step) / none.fwd:+.2f} forwards of 'none' "
        f"({(full.cpu - none.cpu) / none.cpu_fwd:+.2f} in CPU time; target about +1), keeps "
        f"{full.layer / none.layer:.1%} of a layer's activations",
        "kept/layer = formula for every policy: "
        f"{'yes' if all(r.layer == r.formula for r in rows) else 'NO'}",
        f"gradients bitwise equal across the three policies: {'yes' if same else 'NO'}"])


def caching_allocator() -> str | None:
    """Make glibc's malloc keep and reuse freed memory, for the rest of this process:
    arrays up to 32 MB from the heap (M_MMAP_THRESHOLD), nothing trimmed back to the system
    (M_TRIM_THRESHOLD), 512 MB of slack per heap growth (M_TOP_PAD). None if done, else why
    not (not glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = [libc.mallopt(option, value) for option, value in
                ((-3, 32 << 20), (-1, 2**31 - 1), (-2, 512 << 20))]
    except (OSError, AttributeError) as e:
        return f"no glibc mallopt here ({e})"
    return None if all(d == 1 for d in done) else f"mallopt refused ({done})"


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist bench recompute`: time and memory of none / selective / full."""
    p = CliParser(prog="python -m minidist bench recompute", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=at_least(1), default=5, help="measured fwd+bwd each")
    p.add_argument("--warmup", type=at_least(0), default=1)
    p.add_argument("--n-layer", type=at_least(1), default=4)
    p.add_argument("--n-embd", type=at_least(1), default=256)
    p.add_argument("--n-head", type=at_least(1), default=4)
    p.add_argument("--length", type=at_least(1), default=64, help="T = 2 x length")
    p.add_argument("--batch", type=at_least(1), default=8)
    p.add_argument("--dropout", type=at_least(0.0, float), default=0.0)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--allocator", default="both", choices=["system", "cache", "both"],
                   help="glibc's defaults, a caching malloc (mallopt), or both in turn")
    a = p.parse_args(argv)
    try:
        cfg = model_config_for(DataConfig(task="sort", length=a.length), n_layer=a.n_layer,
                               n_embd=a.n_embd, n_head=a.n_head, dropout=a.dropout,
                               dtype=a.dtype)
    except ValueError as e:
        p.error(str(e))
    print("$ python -m minidist bench recompute " +
          shlex.join(sys.argv[1:] if argv is None else argv))
    print(f"GPT {cfg.n_layer} layers, C={cfg.n_embd}, H={cfg.n_head}, T={cfg.block_size}, "
          f"batch {a.batch}, dropout {cfg.dropout}, {cfg.dtype}; one process, medians over "
          f"{a.repeats} repeats after {a.warmup} warm-up, interleaved")
    ok = True
    for allocator in (["system", "cache"] if a.allocator == "both" else [a.allocator]):
        why_not = caching_allocator() if allocator == "cache" else None
        if why_not:
            print(f"\n== caching allocator: skipped, {why_not} ==")
            continue
        print(f"\n== {ALLOCATORS[allocator]} ==")
        rows, same = run(cfg, a.batch, a.repeats, a.warmup)
        print(render(rows))
        print(summary(rows, same))
        ok = ok and same and all(r.layer == r.formula for r in rows)
    return 0 if ok else 1


ALLOCATORS = {"system": "system allocator (glibc defaults: big freed blocks returned, "
                        "page-faulted anew)",
              "cache": "caching allocator (mallopt: freed memory kept and reused, as on a "
                       "GPU)"}


if __name__ == "__main__":
    raise SystemExit(main())
