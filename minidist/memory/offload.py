"""Offloading: the optimizer state (and ZeRO-3's parameter shards) live off the device.

AdamW keeps two numbers per weight (m and v) that only the optimizer step reads: 8Ψ bytes
in fp32 that a device holds through every forward and backward for nothing. ZeRO-Offload
moves them to host memory and runs the update there; ZeRO-Infinity adds a tier below, NVMe,
and reads each piece of state back just ahead of its update while the previous piece is
being updated, so that the slow tier's reads hide behind the work. Under ZeRO-3 the
parameter shards, read only by the gathers and the update, can move the same way.

Here the "device" is what memory/ledger.py counts. `wrap(opt, tier)` turns an optim.AdamW
or optim.SGD into OffloadedAdamW / OffloadedSGD (subclasses: engines and checkpoints see
the same optimizer), whose state arrays live in a Store:
    host   ordinary host arrays; the update runs on them in place
    disk   numpy.memmap files, one per array, in a per-run directory: reads ahead on a
           background thread, the update on the host copy, the write back behind it
`offload_engine(engine, tier)` wraps engine.opt and, under ZeRO-3, moves every w_shard to
the store too (the unit gathers then read it from there). The arithmetic is the very
adamw_step / sgd_step on the same numbers, so results are bitwise those of the plain run.
The ledger asks state_arrays() (the state on the device: none) and host_arrays() (what is
off it), so its device peak drops by exactly those bytes; engine.memory() still counts them.

One rank's view of step() on the disk tier (parameters i = 0..n-1 with a gradient):
    1. the worker thread reads unit 0's and unit 1's state (and w_shard) into host copies
    2. wait for unit i's copies; the worker is reading unit i+1 (depth 2) meanwhile
    3. AdamW / SGD on (w, dw, m, v): the host copies (a w on the device is used in place)
    4. hand the copies to the worker: written back to their files after the reads queued
    5. after the last unit wait for every write: the files are whole when step() returns
The host tier is steps 3 alone: on a real machine the gradient goes to the host and the
update comes back (2bΨ over PCIe per step); here both sides are the same RAM, so it is free.

Crash safety: a run's files live in root/minidist-offload-<pid>-<random>/ (root: the OS
temp dir or --offload-dir), created 0700, with owner.lock flock-ed while the run lives.
close() removes the directory (train.py calls it after the last step), and so do garbage
collection and interpreter exit (a multiprocessing finalizer: forked ranks leave through
os._exit, which skips atexit but runs those). A SIGKILLed process leaves its files (so may
a rank that failed: the launcher SIGKILLs ranks once they have reported), but its pid is
dead and the kernel has dropped its lock: the next Store under the same root sweeps the
directory (`sweep`), and a new run's unique name never meets the old files anyway.

Shapes: one array per parameter and state kind, (S_u,) per unit under ZeRO, the
parameter's shape under DDP; files "m.i.bin", "v.i.bin", "buffers.i.bin", "w_shard.i.bin".
Communication: none. The disk tier reads and writes every offloaded byte once per step,
through the OS page cache, which may keep the pages in RAM: this shows the mechanics, not
an NVMe drive's bandwidth.

References: Ren et al. 2021, "ZeRO-Offload", arXiv:2101.06840, Sec. 4.1 (the single-GPU
    schedule, Fig. 5: gradients to the CPU, Adam there, parameters back); Rajbhandari et
    al. 2021, "ZeRO-Infinity", arXiv:2104.07857 (the infinity offload engine: optimizer
    state and parameters on NVMe, prefetched with an overlap-centric design).
Read next: memory/budget_models.py, demos/21_offload.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import util as mp_util
from typing import Any, Callable

import numpy as np

from minidist import backend
from minidist.optim import SGD, AdamW
from minidist.optim.adamw import adamw_step
from minidist.optim.sgd import sgd_step

try:
    import fcntl
except ImportError:                       # not POSIX: owners are judged by their pid alone
    fcntl = None

TIERS = ("none", "host", "disk")
PREFIX, LOCK = "minidist-offload-", "owner.lock"


# --- the per-run directory and the sweep of dead runs' directories ---
def sweep(root: str) -> list[str]:
    """Remove the run directories under `root` whose owner is dead; return their paths."""
    removed = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        path = os.path.join(root, name)
        if name.startswith(PREFIX) and os.path.isdir(path) and _owner_gone(path, name):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _owner_gone(path: str, name: str) -> bool:
    """True if the run that made `path` is over: the pid in its name is dead (as seen from
    here) and nobody holds its owner.lock. A live pid may be a run making its lock right
    now; a pid of another PID namespace (a container sharing /tmp) may look dead, and the
    lock then says otherwise: both are spared."""
    pid = name[len(PREFIX):].split("-")[0]
    if not pid.isdigit() or _alive(int(pid)):
        return False
    if fcntl is None:
        return True
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDWR)
    except FileNotFoundError:
        return True                       # it died before making its lock
    except OSError:
        return False                      # e.g. another user's: never ours to remove
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False                      # held: by a fork of it that lives on, say
    finally:
        os.close(fd)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)                   # signal 0: only asks whether pid exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                              # another user's process: alive
    return True


def _remove(path: str, fd: int, pid: int) -> None:
    """Delete a run's directory, in the process that made it only (never in a fork)."""
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


class RunDir:
    """root/minidist-offload-<pid>-<random>/, locked while this process lives; removed by
    close(), at exit or when collected. Making one sweeps root first."""

    def __init__(self, root: str | None = None) -> None:
        root = tempfile.gettempdir() if root is None else os.fspath(root)
        os.makedirs(root, exist_ok=True)
        self.swept = sweep(root)
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)    # 0700
        fd = os.open(os.path.join(self.path, LOCK), os.O_CREAT | os.O_RDWR, 0o600)
        if fcntl is not None:             # the kernel drops it when we die, even by SIGKILL
            fcntl.flock(fd, fcntl.LOCK_EX)
        self._finalizer = mp_util.Finalize(self, _remove, args=(self.path, fd, os.getpid()),
                                           exitpriority=10)

    def close(self) -> None:
        self._finalizer()


# --- where offloaded arrays live ---
class Store:
    """The home of offloaded arrays: host memory, or memmap files in a RunDir (disk).
    Counts the bytes it reads and writes (disk)."""

    def __init__(self, tier: str, root: str | None = None) -> None:
        if tier not in ("host", "disk"):
            raise ValueError(f"Store: tier={tier!r}; use 'host' or 'disk'.")
        self.tier, self.homes, self.files = tier, {}, {}   # id -> (name, array); id -> path
        self.dir = RunDir(root) if tier == "disk" else None
        self.bytes_read = self.bytes_written = 0

    def place(self, name: str, a: np.ndarray) -> np.ndarray:
        """A copy of `a` in this store (a file `name`.bin on disk), returned."""
        if self.dir is None or a.size == 0:               # (an empty file cannot be mapped)
            home = np.array(a, copy=True)
        else:
            path = os.path.join(self.dir.path, f"{name}.bin")
            home = np.memmap(path, dtype=a.dtype, mode="w+", shape=a.shape)
            home[...] = a
            self.files[id(home)] = path
        self.homes[id(home)] = (name, home)
        return home

    def holds(self, a: Any) -> bool:
        return self.homes.get(id(a), (None, None))[1] is a

    def read(self, home: np.ndarray) -> np.ndarray:
        """A host copy of a disk-resident array."""
        out = np.empty(home.shape, home.dtype)
        np.copyto(out, home)
        self.bytes_read += out.nbytes
        return out

    def write(self, buf: np.ndarray, home: np.ndarray) -> None:
        np.copyto(home, buf)
        self.bytes_written += buf.nbytes

    def close(self) -> None:
        """Remove the files (disk). Arrays mapped already stay readable (POSIX)."""
        if self.dir is not None:
            self.dir.close()


# --- the optimizers ---
class Offloaded:
    """What OffloadedAdamW and OffloadedSGD share: the state in a Store, the prefetching
    loop of the module docstring, and the ledger's two questions."""

    store: Store
    trace: list | None = None             # a list: (event, i) appended by both threads

    def _take_over(self, store: Store, prefetch: bool, depth: int) -> None:
        self.store, self.depth, self.closed = store, depth, False
        for attr in self._state_attrs():
            setattr(self, attr, [store.place(f"{attr}.{i}", a)
                                 for i, a in enumerate(getattr(self, attr))])
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="minidist-offload") \
            if store.tier == "disk" and prefetch else None

    def _state_attrs(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _update(self, i: int, data: Any, grad: Any, state: list) -> None:
        raise NotImplementedError

    def _state(self, i: int) -> list:
        return [getattr(self, attr)[i] for attr in self._state_attrs()]

    def _offloaded_step(self) -> None:
        """Update every parameter that has a gradient (module docstring, steps 1-5)."""
        if self.closed:
            raise RuntimeError(f"{type(self).__name__}.step: the offload was closed (its "
                               "files are gone); wrap a new optimizer to train on.")
        todo = [i for i, p in enumerate(self.params) if p.grad is not None]
        if self.store.tier == "host":
            for i in todo:
                self._timed_update(i, self.params[i].data, self._state(i))
            return
        ahead = self.depth if self._pool is not None else 1
        reads: dict[int, Future] = {}
        writes = []
        for k, i in enumerate(todo):
            for j in todo[k:k + ahead]:
                if j not in reads:
                    reads[j] = self._submit(self._read, j)
            staged = reads.pop(i).result()                  # [w, *state], host copies
            self._timed_update(i, staged[0], staged[1:])
            writes.append(self._submit(self._write, i, staged))
        for w in writes:
            w.result()

    def _timed_update(self, i: int, data: Any, state: list) -> None:
        self._log("update start", i)
        self._update(i, data, self.params[i].grad, state)
        self._log("update end", i)

    def _homes(self, i: int) -> list:
        return [self.params[i].data, *self._state(i)]

    def _read(self, i: int) -> list:
        """Host copies of unit i's disk-resident arrays (the others as they are)."""
        self._log("read start", i)
        out = [self.store.read(a) if self.store.holds(a) else a for a in self._homes(i)]
        self._log("read end", i)
        return out

    def _write(self, i: int, staged: list) -> None:
        self._log("write start", i)
        for home, buf in zip(self._homes(i), staged):
            if buf is not home:
                self.store.write(buf, home)
        self._log("write end", i)

    def _submit(self, fn: Callable, *args: Any) -> Future:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        done: Future = Future()
        done.set_result(fn(*args))
        return done

    def _log(self, event: str, i: int) -> None:
        if self.trace is not None:
            self.trace.append((event, i))

    def state_dict(self) -> dict:
        """The optimizer's state_dict(), as plain ndarrays (not memmaps)."""
        return {k: np.asarray(v) if isinstance(v, np.ndarray) else v
                for k, v in super().state_dict().items()}

    def state_arrays(self) -> list[tuple[str, Any]]:
        """memory/ledger.py: the optimizer state held on the device: none."""
        return []

    def host_arrays(self) -> list[tuple[str, np.ndarray]]:
        """(name, array) of everything in the store: off the device (memory/ledger.py)."""
        return list(self.store.homes.values())

    def placement(self) -> list[tuple[str, str, int, str | None]]:
        """(name, tier, bytes, file or None) of every array in the store."""
        return [(n, self.store.tier, int(a.nbytes), self.store.files.get(id(a)))
                for n, a in self.store.homes.values()]

    def close(self) -> None:
        """Stop the worker thread and remove the files; step() refuses from now on."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.store.close()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class OffloadedAdamW(Offloaded, AdamW):
    """optim.AdamW whose m and v live in a Store (see the module docstring)."""

    def _state_attrs(self) -> tuple[str, ...]:
        return ("m", "v")

    def _update(self, i: int, data: Any, grad: Any, state: list) -> None:
        b1, b2 = self.betas
        adamw_step(data, grad, *state, lr=self.lr, b1=b1, b2=b2, eps=self.eps,
                   wd=self.weight_decay, t=self.t)

    def step(self) -> None:
        """Advance t, then AdamW.step's update with the state where it lives."""
        self.t += 1
        self._offloaded_step()


class OffloadedSGD(Offloaded, SGD):
    """optim.SGD whose momentum buffers live in a Store (none without momentum)."""

    def _state_attrs(self) -> tuple[str, ...]:
        return ("buffers",) if self.momentum else ()

    def _update(self, i: int, data: Any, grad: Any, state: list) -> None:
        sgd_step(data, grad, state[0] if state else None, lr=self.lr,
                 momentum=self.momentum, weight_decay=self.weight_decay)

    def step(self) -> None:
        self._offloaded_step()


_CLASSES = {AdamW: OffloadedAdamW, SGD: OffloadedSGD}


def wrap(opt: Any, tier: str, root: str | None = None, *, prefetch: bool = True,
         depth: int = 2) -> Any:
    """opt with its state moved to `tier` ("host" or "disk"; "none" returns opt itself):
    an OffloadedAdamW / OffloadedSGD holding opt's hyperparameters, step count and state.
    root: where the disk tier's run directory goes (default: the OS temp dir). prefetch:
    read `depth` units ahead on a worker thread (False: read each just before its update)."""
    if tier not in TIERS:
        raise ValueError(f"offload: tier={tier!r} is unknown; use one of {TIERS}.")
    if tier == "none":
        return opt
    if backend.xp is not np:
        raise ValueError("offload: the host and disk tiers are emulated for the NumPy backend "
                         "(backend.use('numpy')); on the CuPy path the device is real.")
    cls = _CLASSES.get(type(opt))
    if cls is None:
        raise ValueError(f"offload: cannot offload a {type(opt).__name__}; it wraps "
                         "optim.AdamW and optim.SGD (under mixed precision the fp32 master "
                         "weights are not offloaded: use --precision fp32 with --offload).")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"offload: depth={depth!r}; read at least 1 unit ahead (an int >= 1).")
    new = cls.__new__(cls)
    vars(new).update(vars(opt))           # hyperparameters, params, t, the state lists
    new._take_over(Store(tier, root), prefetch, depth)
    return new


def offload_engine(engine: Any, tier: str, root: str | None = None, **options: Any) -> Any:
    """Offload `engine`'s optimizer (engine.opt = wrap(...)) and, under ZeRO-3, its
    parameter shards into the same store; returns the new engine.opt. Between steps."""
    opt = wrap(engine.opt, tier, root, **options)
    engine.opt = opt
    if tier != "none" and getattr(engine, "stage", 0) == 3:
        for i, shard in enumerate(engine.shards):
            shard.data = opt.store.place(f"w_shard.{i}", shard.data)
            engine.stage3.handles[i].data = shard.data    # the leaf held the device copy
    return opt


def check_plan(plan) -> None:
    """ValueError unless a Plan's offload options make sense (parallel/compose.Plan)."""
    if plan.offload not in ("none", "host", "disk"):
        raise ValueError(f"Plan: offload={plan.offload!r} is unknown; use 'none' (state on "
                         "the device), 'host' or 'disk' (memory/offload.py).")
    if plan.offload_dir is not None and plan.offload != "disk":
        raise ValueError(f"Plan: offload_dir={plan.offload_dir!r} is where the disk tier's "
                         f"files go, but offload={plan.offload!r}; use offload='disk' or "
                         "drop offload_dir.")
    if plan.offload != "none" and plan.precision != "fp32":
        raise ValueError(f"Plan: offload={plan.offload!r} with precision="
                         f"{plan.precision!r}: mixed precision's fp32 master weights are "
                         "not offloaded; use precision 'fp32' or offload 'none'.")
