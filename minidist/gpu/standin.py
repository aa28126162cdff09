"""A stand-in GPU: NumPy arrays behind the CuPy calls of the GPU path, every launch checked.

`gpu check` is written for CuPy on a CUDA device, which the CPU tests do not have. StandIn
is a `cupy` for them: NumPy arrays for device arrays, the CPU emulator (emulate/runner.py)
for `RawModule` kernels, and a model of one CUDA stream for events, so that the real code
path (fused.CupyDevice, timing.Timer, every part of check.py) runs unchanged, at small
sizes, before a GPU ever does. What a GPU would reject, or silently get wrong, is an error
here, raised at the launch that does it:

    launch limits      grid x < 2^31, y and z <= 65535; block <= 1024 threads (x, y <= 1024,
                       z <= 64); shared memory <= 48 KiB unless opted in, <= 227 KiB
    arguments          as many as the kernel's parameters (read from its source); each
                       scalar of exactly the NumPy type of its C type, in range; each array
                       C-contiguous, of the parameter's dtype, aligned to its element, and to
                       16 bytes where the kernel's source uses float4; each entry of a table
                       of pointers the start of a live array of the stand-in
    host work          a device->host copy or synchronize between the two events of one
                       get_elapsed_time pair (the host waits: its time is measured); a
                       kernel looked up (`get_function`) more than once per (file, name)
    faults             plant_fault(kernel): that launch "succeeds", the next synchronising
                       call raises CUDARuntimeError (cudaErrorIllegalAddress), and so does
                       every CUDA call after it, as a sticky error does on a real context

Clocks. Both are modeled, so that nothing here depends on how loaded the machine is: the
host clock advances by a modeled cost per launch, allocation and compile (and by
`charge_host(seconds)`, for host work a test wants to model); the device clock is a queue: a launch starts when
the stream is free and the host has issued it, and takes a modeled time (pointer_chase:
hops x the latency of the level its working set fits in; bandwidth_read: bytes / that
level's bandwidth; hold: its cycles at 1 GHz; any other kernel: 2 us + its arrays' bytes /
HBM). Times printed through the stand-in are MODELED: they exercise the code, not the chip.

One launch's view: check the launch (table above); run the kernel on the emulator (its
results are real); charge the host and the device their modeled times; log it.
Read next: gpu/check.py (`--dry-run` runs every part through a StandIn), gpu/timing.py.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from minidist.gpu.emulate.runner import Emulator, dims3
from minidist.gpu.emulate.source import read_kernels, strip_comments

KB, MB = 1 << 10, 1 << 20
MAX_GRID = (2 ** 31 - 1, 65535, 65535)
MAX_BLOCK = (1024, 1024, 64)
DEFAULT_SHARED, MAX_SHARED = 48 * KB, 227 * KB


@dataclass(frozen=True)
class Level:
    """One level of the modeled memory hierarchy: sets up to `bytes` are served by it."""

    name: str
    bytes: float
    latency_ns: float
    bandwidth: float           # B/s


# H200-like by default; check --dry-run scales the caches down so small sets cross them.
LEVELS = (Level("L1", 256 * KB, 30.0, 20e12), Level("L2", 50 * MB, 200.0, 8e12),
          Level("HBM", float("inf"), 600.0, 4e12))


class StandInError(RuntimeError):
    """A launch or a timing that a GPU would reject or get wrong (module doc, the table)."""


class CUDARuntimeError(RuntimeError):
    """What cupy.cuda.runtime.CUDARuntimeError carries: a status and CUDA's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class DeviceArray(np.ndarray):
    """A NumPy array that lives on a StandIn: every NumPy operation on it (a ufunc, a
    reduction, an array function) is charged to the modeled stream as one kernel, as CuPy
    runs one kernel per NumPy-like call."""

    _standin: "StandIn | None" = None

    def __array_finalize__(self, obj: Any) -> None:
        self._standin = getattr(obj, "_standin", None)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        args = [a.view(np.ndarray) if isinstance(a, DeviceArray) else a for a in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, DeviceArray) else o
                                  for o in kwargs["out"])
        standin = self._standin
        result = getattr(ufunc, method)(*args, **kwargs)
        return standin._device_op(ufunc.__name__, inputs, result) if standin else result

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        standin = self._standin
        if standin is None or standin._depth:
            return super().__array_function__(func, types, args, kwargs)
        standin._depth += 1
        try:
            result = super().__array_function__(func, types, args, kwargs)
        finally:
            standin._depth -= 1
        return standin._device_op(func.__name__, args, result)


class _Random:
    """cp.random: NumPy's, with its arrays made on the stand-in."""

    def __init__(self, standin: "StandIn", source: Any = np.random) -> None:
        self._standin, self._source = standin, source

    def default_rng(self, seed: Any = None) -> "_Random":
        return _Random(self._standin, np.random.default_rng(seed))

    def __getattr__(self, name: str) -> Any:
        return self._standin._wrapped(getattr(self._source, name))


class StandIn:
    """The `cupy` module as the GPU path uses it (module doc). Names it does not define
    come from NumPy, which CuPy mirrors: cp.zeros, cp.float32, cp.matmul, cp.random, ...;
    arrays it makes are DeviceArrays, whose operations run as modeled kernels."""

    __version__ = "stand-in"
    ndarray = np.ndarray

    def __init__(self, emulator: Emulator | None = None, levels: Sequence[Level] = LEVELS,
                 sms: int = 4) -> None:
        self.emu = emulator or Emulator()
        self.levels, self.sms = tuple(levels), sms
        self.cuda = _Cuda(self)
        self.launches: list[tuple[str, str]] = []       # (file, kernel) in launch order
        self.lookups: dict[tuple[str, str], int] = {}  # get_function calls per kernel
        self.log: list[tuple[str, str]] = []            # ("launch" | "sync" | "event", what)
        self.fault: tuple[str, int, str] | None = None  # planted: kernel, status, message
        self.sticky: CUDARuntimeError | None = None
        self.pending: CUDARuntimeError | None = None
        self._modeled = 0.0                             # the host clock, seconds
        self.free_s = 0.0                               # when the modeled stream is idle
        self._live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._sources: dict[str, Path] = {}
        self._depth = 0
        self.random = _Random(self)

    def __getattr__(self, name: str) -> Any:
        return self._wrapped(getattr(np, name))

    def _wrapped(self, fn: Any) -> Any:
        """fn, with the arrays it returns made device arrays of this stand-in."""
        if not callable(fn) or isinstance(fn, type):
            return fn

        def on_device(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            return self._track(result) if type(result) is np.ndarray else result
        return on_device

    def _device_op(self, name: str, inputs: Any, result: Any) -> Any:
        """Charge one CuPy-like kernel for `name` (its arrays' bytes) and return `result`
        as device arrays."""
        self._check_alive()
        flat = list(inputs) + (list(result) if isinstance(result, tuple) else [result])
        nbytes = sum(a.nbytes for a in flat if isinstance(a, np.ndarray))
        self.charge_host(5e-6)
        start = max(self.free_s, self.host_clock())
        self.free_s = start + 2e-6 + nbytes / self.levels[-1].bandwidth
        if isinstance(result, tuple):
            return tuple(self._as_device(r) for r in result)
        return self._as_device(result)

    def _as_device(self, a: Any) -> Any:
        if isinstance(a, np.ndarray) and not isinstance(a, DeviceArray):
            a = a.view(DeviceArray)
            a._standin = self
        return a

    # --- clocks ---
    def host_clock(self) -> float:
        """Seconds of modeled host time: launches, allocations, compiles, charge_host."""
        return self._modeled

    def charge_host(self, seconds: float) -> None:
        """Model `seconds` of host work (what a slow Python wrapper would cost)."""
        self._modeled += seconds

    # --- arrays (modeled as pool allocations: ~2 us of host time each) ---
    def _track(self, a: np.ndarray) -> np.ndarray:
        self._check_alive()
        self.charge_host(2e-6)
        a = self._as_device(a)
        self._live[id(a)] = a
        return a

    def empty(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        return self._track(np.full(shape, np.nan, dtype) if np.dtype(dtype).kind == "f"
                           else np.zeros(shape, dtype))

    def zeros(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        return self._track(np.zeros(shape, dtype))

    def ones(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        return self._track(np.ones(shape, dtype))

    def asarray(self, a: Any, dtype: Any = None) -> np.ndarray:
        return self._track(np.array(a, dtype=dtype, copy=True))

    def ascontiguousarray(self, a: Any, dtype: Any = None) -> np.ndarray:
        return self._track(np.ascontiguousarray(a, dtype=dtype))

    def asnumpy(self, a: Any) -> np.ndarray:
        """A device->host copy: the host waits for the stream first."""
        self._sync("asnumpy (a device->host copy)")
        return np.array(a).view(np.ndarray)

    # --- faults ---
    def plant_fault(self, kernel: str, status: int = 700,
                    message: str = "cudaErrorIllegalAddress: an illegal memory access was "
                                   "encountered") -> None:
        """The next launch of `kernel` breaks the context (module doc, faults)."""
        self.fault = (kernel, status, message)

    def _check_alive(self) -> None:
        if self.sticky is not None:
            raise CUDARuntimeError(self.sticky.status, str(self.sticky))

    def _sync(self, what: str) -> None:
        self._check_alive()
        if self.pending is not None:
            self.sticky, self.pending = self.pending, None
            raise CUDARuntimeError(self.sticky.status, str(self.sticky))
        self.log.append(("sync", what))
        self._modeled += max(0.0, self.free_s - self.host_clock())

    # --- kernels ---
    def RawModule(self, code: str | None = None, options: Sequence[str] = (),
                  **kwargs: Any) -> "_Module":
        """A module of the kernels in `code`, built for the emulator (as NVRTC would)."""
        self._check_alive()
        if code is None:
            raise StandInError("StandIn.RawModule: give the source as code=...")
        bad = [o for o in options if not str(o).startswith(("-", "--"))]
        if bad:
            raise StandInError(f"RawModule options {bad} are not compiler flags")
        return _Module(self, self._source_file(code))

    def _source_file(self, code: str) -> Path:
        key = hashlib.sha256(code.encode()).hexdigest()[:16]
        if key not in self._sources:
            folder = Path(os.environ.get("MINIDIST_KERNEL_CACHE", tempfile.gettempdir()))
            path = folder / "standin" / f"module-{key}.cu"
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_text(code)
                os.replace(tmp, path)
            self._sources[key] = path
        return self._sources[key]

    def level(self, nbytes: float) -> Level:
        return next(lv for lv in self.levels if nbytes <= lv.bytes)

    def _device_seconds(self, kernel: str, params, args) -> float:
        arrays = {p.name: a for p, a in zip(params, args) if isinstance(a, np.ndarray)}
        scalars = {p.name: a for p, a in zip(params, args) if not isinstance(a, np.ndarray)}
        if kernel == "hold":
            return int(scalars["cycles"]) * 1e-9
        if kernel == "pointer_chase":
            return int(scalars["hops"]) * self.level(arrays["next"].nbytes).latency_ns * 1e-9
        if kernel == "bandwidth_read":
            return 16 * int(scalars["total"]) / self.level(arrays["x"].nbytes).bandwidth
        return 2e-6 + sum(a.nbytes for a in arrays.values()) / self.levels[-1].bandwidth

    def _launch(self, module: "_Module", kernel: str, grid: Any, block: Any,
                args: Sequence[Any], shared_mem: int, opted_in: int) -> None:
        self._check_alive()
        params = module.kernels[kernel].params
        g, b = self._check_dims(kernel, grid, block, shared_mem, opted_in)
        if len(args) != len(params):
            raise StandInError(f"{kernel}: {len(args)} arguments for its {len(params)} "
                               f"parameters ({', '.join(p.name for p in params)})")
        values = [self._check_arg(kernel, p, a, module.float4) for p, a in zip(params, args)]
        self.emu.launch(module.path, kernel, g, b, values, shared_mem)   # not host time
        self.charge_host(4e-6)
        start = max(self.free_s, self.host_clock())
        self.free_s = start + self._device_seconds(kernel, params, values)
        self.launches.append((module.name_of(kernel), kernel))
        self.log.append(("launch", kernel))
        if self.fault is not None and self.fault[0] == kernel:
            self.pending, self.fault = CUDARuntimeError(self.fault[1], self.fault[2]), None

    def _check_dims(self, kernel: str, grid: Any, block: Any, shared: int,
                    opted_in: int) -> tuple[tuple, tuple]:
        g, b = dims3(grid, "grid"), dims3(block, "block")
        if any(x > most for x, most in zip(g, MAX_GRID)):
            raise StandInError(f"{kernel}: grid {g} exceeds CUDA's limits {MAX_GRID} "
                               "(x < 2^31, y and z <= 65535): the launch would fail")
        if any(x > most for x, most in zip(b, MAX_BLOCK)) or b[0] * b[1] * b[2] > 1024:
            raise StandInError(f"{kernel}: block {b} exceeds 1024 threads or {MAX_BLOCK}")
        limit = max(DEFAULT_SHARED, opted_in)
        if not 0 <= shared <= min(limit, MAX_SHARED):
            raise StandInError(f"{kernel}: {shared} B of dynamic shared memory; the limit is "
                               f"{min(limit, MAX_SHARED)} B (above 48 KiB set "
                               "max_dynamic_shared_size_bytes first)")
        return g, b

    def _check_arg(self, kernel: str, p, a: Any, float4: bool) -> Any:
        where = f"{kernel}: argument {p.name!r} ({p.ctype}{'*' * p.pointer})"
        if p.pointer == 0:
            want = np.dtype(p.dtype)
            if not isinstance(a, np.generic) or a.dtype != want:
                raise StandInError(f"{where} needs a NumPy {want} scalar (CuPy passes a "
                                   f"scalar by its own type); got {type(a).__name__}")
            return a
        if isinstance(a, np.generic) and a.dtype == np.uint64 and int(a) == 0:
            return None                                          # a null pointer
        if not isinstance(a, np.ndarray) or a.dtype != np.dtype(p.dtype) \
                or not a.flags.c_contiguous:
            raise StandInError(f"{where} needs a C-contiguous {p.dtype} device array; got "
                               f"{type(a).__name__} {getattr(a, 'dtype', '')}")
        need = 16 if float4 else a.dtype.itemsize
        if a.ctypes.data % need:
            raise StandInError(f"{where} starts at an address that is not a multiple of "
                               f"{need} bytes ({'the kernel loads float4s' if float4 else ''})"
                               "; pass an array that starts on a 16-byte boundary")
        if p.pointer >= 2:
            for address in a.tolist():
                if not self._is_live(int(address)):
                    raise StandInError(f"{where}: table entry {address:#x} is not the address "
                                       "of an array on this device")
        return a

    def _is_live(self, address: int) -> bool:
        return any(a.ctypes.data <= address < a.ctypes.data + max(a.nbytes, 1)
                   for a in list(self._live.values()))


class _Module:
    """A RawModule: its source file, kernels (parameters from the source), float4 use."""

    def __init__(self, standin: StandIn, path: Path) -> None:
        self.standin, self.path = standin, path
        self.kernels = read_kernels(path)
        self.float4 = bool(re.search(r"\bfloat4\b", strip_comments(path.read_text())))
        standin.emu.load(path)             # g++ (NVRTC's part): charged as 50 ms below
        standin.charge_host(0.05)

    def name_of(self, kernel: str) -> str:
        return self.path.name

    def get_function(self, name: str) -> "_Function":
        self.standin._check_alive()
        if name not in self.kernels:
            raise StandInError(f"RawModule has no kernel {name!r}; it has {sorted(self.kernels)}")
        key = (str(self.path), name)
        self.standin.lookups[key] = self.standin.lookups.get(key, 0) + 1
        self.standin.charge_host(5e-6)
        return _Function(self, name)


class _Function:
    """A kernel of a RawModule: fn(grid, block, args, shared_mem=0)."""

    def __init__(self, module: _Module, name: str) -> None:
        self.module, self.name, self.max_dynamic_shared_size_bytes = module, name, 0

    def __call__(self, grid: Any, block: Any, args: Sequence[Any], shared_mem: int = 0) -> None:
        self.module.standin._launch(self.module, self.name, grid, block, args, shared_mem,
                                    self.max_dynamic_shared_size_bytes)


class _Event:
    def __init__(self, standin: StandIn) -> None:
        self.standin, self.t, self.at = standin, None, None

    def record(self, stream: Any = None) -> None:
        s = self.standin
        s._check_alive()
        self.t, self.at = max(s.free_s, s.host_clock()), len(s.log)
        s.log.append(("event", ""))

    def synchronize(self) -> None:
        self.standin._sync("Event.synchronize")


class _Device:
    def __init__(self, standin: StandIn, index: int = 0) -> None:
        self.standin = standin
        l2 = standin.levels[1].bytes if len(standin.levels) > 2 else 0
        self.attributes = {"MultiProcessorCount": standin.sms, "L2CacheSize": int(l2),
                           "MaxSharedMemoryPerBlockOptin": MAX_SHARED}
        self.compute_capability = "90"

    def synchronize(self) -> None:
        self.standin._sync("Device.synchronize")


class _Runtime:
    CUDARuntimeError = CUDARuntimeError

    def __init__(self, standin: StandIn) -> None:
        self.standin = standin

    def getDeviceCount(self) -> int:
        return 1

    def runtimeGetVersion(self) -> int:
        return 13020

    def deviceSynchronize(self) -> None:
        self.standin._sync("deviceSynchronize")

    def getDeviceProperties(self, index: int) -> dict:
        return {"name": b"stand-in (NumPy + the CPU emulator)", "totalGlobalMem": 0,
                "multiProcessorCount": self.standin.sms}


class _Cuda:
    def __init__(self, standin: StandIn) -> None:
        self.standin, self.runtime = standin, _Runtime(standin)

    def Event(self) -> _Event:
        return _Event(self.standin)

    def Device(self, index: int = 0) -> _Device:
        return _Device(self.standin, index)

    def get_elapsed_time(self, start: _Event, end: _Event) -> float:
        """ms between two recorded events; a host wait between them is an error."""
        s = self.standin
        s._check_alive()
        if start.t is None or end.t is None:
            raise StandInError("get_elapsed_time: both events must be recorded first")
        waits = [what for kind, what in s.log[start.at:end.at] if kind == "sync"]
        if waits:
            raise StandInError(f"a timed region holds {len(waits)} host wait(s) for the GPU, "
                               f"first {waits[0]}: the host's time is measured with the "
                               "kernels'. Do it before the timed function, not inside it.")
        return (end.t - start.t) * 1e3
