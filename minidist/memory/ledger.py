"""The device-memory ledger: every array a rank would hold on its device, counted by category.

A device runs out of memory on the sum of what is alive at one moment. The ledger counts it
per rank from the arrays themselves as they come and go: current and peak bytes per category,
a timeline of each step and what was alive at the peak (like PyTorch's memory snapshot). Under
a budget, an array that would take the rank past it raises DeviceOutOfMemory, naming the
category and the largest live arrays, where a device would fail the allocation.

What counts, and once: a BUFFER (autograd/saved.py's base_buffer, however many views point
into it), from registration until CPython frees it (a weakref.finalize; a reference cycle waits
for the next gc), under the first category of CATEGORIES that claims it (an op output the next
op saves becomes an activation; a weight an op saves stays a parameter).
    parameters, gradients, optimizer   track_model(model, opt), or track_engine: what
        engine.memory() counts (DDP, ZeRO 1-3), so the three equal it; each .grad as it ends
    activations     the arrays a graph node keeps for its backward (its ctx, as saved.py
                    counts): the ledger's Observer.forward (autograd/tensor.py)
    temporaries     op outputs nobody saved (minidist's graph Tensors keep .data until the
                    graph goes; PyTorch keeps only saved tensors) and the backward's activation
                    gradients: its Observer.backward
    communication   ZeRO-3's gathered units (ZeRO's unsharded flats are gradients, as in
                    engine.memory(); so are DDP's shared-memory buckets)
Not counted: scratch inside one op (freed before it returns), the transport's shared-memory
windows and the collectives' staging copies and results (runtime/shm.py, collectives/ring.py),
gradients inside autograd/split.py's split backward, Python objects, and what memory/offload.py
moved to host memory or disk (its optimizer's state_arrays() is empty; host_arrays() names them).

One rank's view:
    1. ledger = Ledger(budget="64MB"); ledger.track_engine(engine)
    2. with ledger: forward and backward    the ledger, an autograd Observer, registers
                                            each array as it appears
    3. ledger.mark("optimizer") after the update; ledger.end_step() -> the step's peak
    4. read .current, .peak, .peak_by_category, .timeline, snapshot(), table(), summary()
Registrations and frees go to an event log that snapshot() replays up to the peak (a new peak
copies nothing); end_step() keeps the peak's live set and starts a new log. Sizes: "64MB" is
64e6 bytes (kB MB GB TB), "2GiB" 2 * 2^30 (KiB MiB GiB TiB). Communication: none.

Reference: Rajbhandari et al. 2020, "ZeRO", arXiv:1910.02054, Sec. 3 (model states; residual
    states: activations, temporary buffers, fragmentation); PyTorch's CUDA memory snapshot
    (torch.cuda.memory._snapshot) records every allocation the same way.
Read next: memory/recompute.py (trade activations for compute), memory/budget.py.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections import namedtuple
from fractions import Fraction
from typing import Any, Callable

import numpy as np

from minidist import backend
from minidist.autograd import tensor as core
from minidist.autograd.tensor import Observer, observe, unobserve
from minidist.autograd.saved import base_buffer, ctx_arrays
from minidist.nn.module import Parameter

CATEGORIES = ("parameters", "gradients", "optimizer", "communication", "activations",
              "temporaries")
_ORDER = {c: i for i, c in enumerate(CATEGORIES)}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(size: int | str) -> int:
    """Bytes in `size`: an int, or text "64MB", "141GB" (decimal), "2GiB" (binary), "1.5 GB",
    "4096"; units are case-insensitive, fractions of a byte are dropped. ValueError otherwise."""
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        n = int(size)
    else:
        m = re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)\s*([a-zA-Z]*)\s*", str(size))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"parse_bytes: cannot read {size!r} as a size; write a number and "
                             "a unit, e.g. 64MB or 141GB (powers of 10) or 2GiB (powers of 2).")
        n = int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 0:
        raise ValueError(f"parse_bytes: {size!r} is negative; a size is >= 0 bytes.")
    return n


def format_bytes(n: int) -> str:
    """n as "812 B", "16.4 kB", "1.02 MB", "141 GB" (decimal units)."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


class DeviceOutOfMemory(MemoryError):
    """A registration would take this rank past its device-memory budget."""


# One live buffer: its category, the op (or name) that made it, its shape, dtype and bytes.
LiveArray = namedtuple("LiveArray", "category name shape dtype nbytes")
# The end of a segment of step `step`: its label ("forward", "backward", a mark's), the bytes
# then, the highest total inside the segment, and the bytes per category then.
TimelinePoint = namedtuple("TimelinePoint", "step label bytes peak by_category")


class Ledger(Observer):
    """Per-rank device-memory ledger with an optional budget (see the module docstring)."""

    def __init__(self, budget: int | str | None = None, *, prefix: str = "") -> None:
        """budget: bytes, a size (parse_bytes) or None; prefix starts errors ("[rank r/W]")."""
        self.budget = None if budget is None else parse_bytes(budget)
        self.prefix, self.step, self.total, self.peak = prefix, 0, 0, 0
        self.current, self.peak_by_category = (dict.fromkeys(CATEGORIES, 0) for _ in range(2))
        self.timeline, self.step_peaks = [], []      # TimelinePoints; each step's peak bytes
        self._live: dict[int, list] = {}       # id(base) -> [category, info, finalizer]
        self._log: list[tuple] = []            # (+1 new | -1 freed | 0 moved, key, category, info)
        self._base: dict[int, tuple] = {}      # the live set where _log starts
        self._peak_at: int | None = 0          # peak after _log[:_peak_at]; None: _peak_live
        self._peak_live: list[LiveArray] = []   # the live set at an earlier step's peak
        self._step_peak, self._segment_peak, self._phase = 0, 0, None   # phase: forward/backward
        self._lock = threading.RLock()         # frees may come on a collective's worker thread
        self._wrapped: dict[tuple[int, str], Callable[[], None]] = {}     # -> its undo
        self._names: dict[int, str] = {}        # id(Parameter) -> name, for its gradient

    # --- registering arrays ---
    def register(self, array: Any, category: str, name: str = "") -> None:
        """Count array's base buffer under `category` until it is freed. A buffer already
        counted moves to `category` if that comes first in CATEGORIES, else stays. Raises
        DeviceOutOfMemory if a new buffer would take the total past the budget."""
        if category not in _ORDER:
            raise ValueError(f"Ledger.register: category {category!r} is not one of {CATEGORIES}")
        buf = base_buffer(array)
        if not isinstance(buf, (np.ndarray, backend.xp.ndarray)):
            return
        key = id(buf)
        with self._lock:
            entry = self._live.get(key)
            if entry is not None:
                if _ORDER[category] < _ORDER[entry[0]]:        # a move: the total stays
                    self.current[entry[0]] -= entry[1][3]
                    entry[0] = category
                    self._count(category, entry[1][3], 0, key, entry[1])
                return
            info = (name, tuple(buf.shape), str(buf.dtype), int(buf.nbytes))
            if self.budget is not None and self.total + info[3] > self.budget:
                raise DeviceOutOfMemory(self._oom_message(category, info))
            fin = weakref.finalize(buf, self._free, key)
            fin.atexit = False
            self._live[key] = [category, info, fin]
            self._count(category, info[3], +1, key, info)

    def _count(self, category: str, n: int, op: int, key: int, info: tuple) -> None:
        """Add n bytes to category (and, unless a move, to the total); log it, note peaks."""
        self.current[category] += n
        self.total += n if op else 0
        self._log.append((op, key, category, info))
        if n > 0:
            self.peak_by_category[category] = max(self.peak_by_category[category],
                                                  self.current[category])
            self._segment_peak = max(self._segment_peak, self.total)
            self._step_peak = max(self._step_peak, self.total)
            if self.total > self.peak:
                self.peak, self._peak_at = self.total, len(self._log)

    def _free(self, key: int) -> None:
        """weakref.finalize callback: the buffer `key` was freed."""
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self._count(entry[0], -entry[1][3], -1, key, entry[1])

    def track_model(self, model: Any, optimizer: Any = None) -> None:
        """Register every parameter (by name), any .grad it holds now, and the optimizer's
        state (optimizer_arrays): a single-process run's model state."""
        for name, p in model.named_parameters():
            self._names[id(p)] = name
            self.register(p.data, "parameters", name)
            if p.grad is not None:
                self.register(p.grad, "gradients", "grad " + name)
        for name, a in optimizer_arrays(optimizer) if optimizer is not None else ():
            self.register(a, "optimizer", name)

    def track_engine(self, engine: Any) -> None:
        """Register what engine.memory() counts (engine_arrays); under ZeRO, catch the
        unsharded gradient flats and ZeRO-3's gathered units as they are made."""
        self._names.update((id(p), n) for n, p in engine.model.named_parameters())
        for category, pairs in engine_arrays(engine).items():
            for name, a in pairs:
                self.register(a, category, name)
        if getattr(engine, "shards", None) is None:
            return                                          # DDP: no buffers made later
        units, hooks = engine.units, engine.stage3

        def grads(out, i):
            self.register(out, "gradients", f"unsharded grads {units[i].name}")
        if hooks is None:
            self._wrap(engine, "_grad_buffer", grads)
        else:                               # a gathered unit: one flat, the params view it
            self._wrap(hooks, "_new_grad_buffer", grads)
            self._wrap(hooks, "_acquire", lambda _, i, *_rest: self.register(
                units[i].params[0].data, "communication", f"gathered unit {units[i].name}"))
        if hasattr(engine, "secondary"):          # ZeRO++'s hpZ copy (parallel/zero/zeropp.py)
            self._wrap(engine, "_keep_secondary", lambda _, i, *_rest: self.register(
                engine.secondary[i], "parameters", f"hpZ secondary {units[i].name}"))

    def mark_modules(self, modules: dict[str, Any]) -> None:
        """After each forward of modules[name] (while counting), mark("forward <name>")."""
        for name, m in modules.items():
            self._wrap(m, "forward", lambda out, *a, _n=name: self.mark(f"forward {_n}"))

    def _wrap(self, obj: Any, attr: str, after: Callable) -> None:
        """obj.attr(*args) -> out, then after(out, *args) while counting; close() undoes it."""
        if (id(obj), attr) in self._wrapped:
            return
        original, had = getattr(obj, attr), attr in vars(obj)

        def wrapped(*args, **kwargs):
            out = original(*args, **kwargs)
            if self.active:
                after(out, *args)
            return out
        setattr(obj, attr, wrapped)
        self._wrapped[(id(obj), attr)] = (lambda: setattr(obj, attr, original)) if had \
            else (lambda: vars(obj).pop(attr, None))

    # --- plugging into the autograd: `with ledger:` calls start and stop ---
    def start(self) -> "Ledger":
        """Count from now on: plug this ledger into the autograd as an Observer."""
        if self.active:
            raise RuntimeError("Ledger.start: this ledger is counting already; stop() first.")
        observe(self)
        return self

    def stop(self) -> None:
        """Stop registering new arrays (frees of those registered still count)."""
        unobserve(self)

    def close(self) -> None:
        """stop(), undo the wrapped methods, stop watching buffers; the numbers stay."""
        self.stop()
        for undo in self._wrapped.values():
            undo()
        self._wrapped.clear()
        with self._lock:
            for entry in self._live.values():
                entry[2].detach()
            self._live.clear()

    def __enter__(self) -> "Ledger":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        if self._phase is not None:          # close the segment running
            self.mark()
        self.stop()

    active = property(lambda self: self in core.observers, doc="between start() and stop()")

    def forward(self, fn, ctx, args, arrays, kwargs, result, t0) -> None:
        """An op ran: a graph node keeps its ctx arrays (activations); its output is new."""
        if self._phase != "forward":
            self._switch("forward")
        if result._node is not None:
            for a in ctx_arrays(ctx):
                self.register(a, "activations", fn.__name__)
        self.register(result.data, "temporaries", fn.__name__)

    def backward(self, t: Any, grads: Any) -> None:
        """The backward finished t: a parameter's .grad, or the gradients of t's inputs."""
        if self._phase != "backward":
            self._switch("backward")
        if t._node is None and (id(t) in self._names or isinstance(t, Parameter)):
            self.register(t.grad, "gradients", "grad " + self._names.get(id(t), "parameter"))
            return
        name = "grad of a leaf" if t._node is None else \
            t._node[0].__qualname__.split(".")[0] + " backward"
        for g in grads:
            if g is not None:
                self.register(g, "temporaries", name)

    # --- the timeline ---
    def _switch(self, phase: str) -> None:
        if self._phase is not None:
            self.mark()
        self._phase = phase

    def mark(self, label: str | None = None) -> None:
        """End the current segment of the timeline: label (default: the phase running,
        "forward" or "backward"), the bytes now and the highest total since the last point."""
        self.timeline.append(TimelinePoint(self.step, label or self._phase or "mark",
                                           self.total, self._segment_peak, dict(self.current)))
        self._segment_peak, self._phase = self.total, None

    def end_step(self) -> int:
        """Close the step: its peak goes to step_peaks (returned); the log starts anew."""
        with self._lock:
            if self._phase is not None:
                self.mark()
            self.step_peaks.append(self._step_peak)
            if self._peak_at is not None:
                self._peak_live, self._peak_at = self.snapshot(), None
            self._base = {k: (e[0], e[1]) for k, e in self._live.items()}
            self._log = []
            self._step_peak, self.step = self.total, self.step + 1
        return self.step_peaks[-1]

    # --- reading ---
    def snapshot(self, at: str = "peak") -> list[LiveArray]:
        """The buffers alive at the peak (the log replayed to it) or now, largest first."""
        if at not in ("peak", "now"):
            raise ValueError(f"Ledger.snapshot: at={at!r}; use 'peak' or 'now'.")
        with self._lock:
            if at == "now":
                live = {k: (e[0], e[1]) for k, e in self._live.items()}
            elif self._peak_at is None:
                return list(self._peak_live)
            else:
                live = dict(self._base)
                for op, key, category, info in self._log[:self._peak_at]:
                    if op < 0:
                        live.pop(key, None)
                    else:
                        live[key] = (category, info)
        return sorted((LiveArray(c, *info) for c, info in live.values()), key=lambda a: -a.nbytes)

    def model_state(self) -> dict[str, int]:
        """{"params", "grads", "optimizer"} now: engine.memory()'s keys, for comparison."""
        c = self.current
        return {"params": c["parameters"], "grads": c["gradients"], "optimizer": c["optimizer"]}

    def summary(self) -> dict:
        """Picklable numbers, and the 5 largest buffers at the peak (category, name, shape, B)."""
        return {"budget": self.budget, "peak": self.peak,
                "peak_by_category": dict(self.peak_by_category), "current": dict(self.current),
                "step_peaks": list(self.step_peaks),
                "peak_top": [(a.category, a.name, a.shape, a.nbytes) for a in self.snapshot()[:5]]}

    def table(self) -> str:
        """Current and peak bytes per category, then the largest buffers at the peak."""
        rows = [(c, self.current[c], self.peak_by_category[c]) for c in CATEGORIES]
        return "\n".join([f"{'category':<15}{'now':>12}{'peak':>12}"] + [
            f"{c:<15}{format_bytes(n):>12}{format_bytes(p):>12}"
            for c, n, p in rows + [("total", self.total, self.peak)]] + [
            f"  at peak: {a.category:<14}{a.name:<28}{str(a.shape):<16}{format_bytes(a.nbytes):>10}"
            for a in self.snapshot()[:5]])

    def _oom_message(self, category: str, info: tuple) -> str:
        name, shape, dtype, nbytes = info
        held = ", ".join(f"{c} {format_bytes(self.current[c])}" for c in CATEGORIES)
        top = "; ".join(f"{a.category} '{a.name}' {a.shape} {format_bytes(a.nbytes)}"
                        for a in self.snapshot("now")[:5])
        return (f"{self.prefix} out of device memory in step {self.step}: {category} '{name}' "
                f"{shape} {dtype} ({format_bytes(nbytes)}) would take this rank to "
                f"{format_bytes(self.total + nbytes)}, past its device-memory budget of "
                f"{format_bytes(self.budget)} ({self.budget:,} B). Held now: {held}. Largest "
                f"live arrays: {top or 'none'}. To fit, recompute activations (--recompute "
                "selective or full), shard the model state with a higher ZeRO stage (--zero 1, "
                "2 or 3), use a smaller micro-batch (a larger --grad-accum or a smaller "
                "--batch), offload the optimizer state (memory/offload.py), or give the rank "
                "more --device-memory.").lstrip()


def optimizer_arrays(opt: Any) -> list[tuple[str, Any]]:
    """(name, array) of the optimizer's state: opt.state_arrays() if it has one, else
    AdamW's m and v or SGD's momentum buffers (the arrays state_dict() copies)."""
    if hasattr(opt, "state_arrays"):
        return list(opt.state_arrays())
    return [(f"{type(opt).__name__}.{attr}[{i}]", a) for attr in ("m", "v", "buffers")
            for i, a in enumerate(getattr(opt, attr, None) or ())]


def engine_arrays(engine: Any) -> dict[str, list[tuple[str, Any]]]:
    """{category: [(name, array)]} of the arrays engine.memory() counts: DataParallel's
    parameters and gradient buckets (parallel/data/buckets.py; the plain engine: the .grad
    arrays that exist), ZeroEngine's full or sharded flats (parallel/zero/engine.py)."""
    state = {"optimizer": optimizer_arrays(engine.opt)}
    if getattr(engine, "shards", None) is None:                       # DataParallel
        named = list(zip(engine.names, engine.params))
        grads = [(f"grad bucket {b.index}", b.flat) for b in engine.buckets] \
            if hasattr(engine, "buckets") else [("grad " + n, p.grad) for n, p in named
                                                if p.grad is not None]
        return {"parameters": [(n, p.data) for n, p in named], "gradients": grads, **state}
    names, shards, stage = [u.name for u in engine.units], engine.shards, engine.stage
    off = {id(a) for _, a in getattr(engine.opt, "host_arrays", list)()}   # memory/offload.py
    params = [(f"unit {n}", a) for n, a in zip(names, engine.p_full)] if stage < 3 \
        else [(f"w_shard {n}", s.data) for n, s in zip(names, shards) if id(s.data) not in off]
    grads = [(f"unsharded grads {n}", g) for n, g in zip(names, engine.g_acc) if g is not None]
    grads += [(f"dw_shard {n}", s.grad) for n, s in zip(names, shards)] if stage > 1 else []
    return {"parameters": params, "gradients": grads, **state}
