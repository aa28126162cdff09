"""Run a CUDA kernel on NumPy arrays, on CPU threads: the emulator's front door.

API (any .cu file, any kernel; the kernels of gpu/kernels/ are found by file name):

    from minidist.gpu.emulate.runner import Emulator
    emu = Emulator()                             # variant="plain" | "thread" | "address"
    y = emu.empty((N, C)); mean = emu.empty((N,)); rstd = emu.empty((N,))
    emu.launch("layernorm.cu", "layernorm_forward", grid=(N,), block=(128,),
               args=(x, w, b, y, mean, rstd, N, C, 1e-5), shared_bytes=0)

    - args follow the kernel's parameter list (read from the source, source.read_kernels):
      an array parameter (`float* x`) takes a C-contiguous NumPy array of that element type
      (float -> float32, int -> int32, long long -> int64) or None (a null pointer); a
      table of pointers (`float* const* p`) takes a uint64 array of emu.address(a); a
      scalar is cast to the declared C type (so 1e-5 reaches a `float eps` as a float).
    - grid and block are ints or 1-3 tuples; shared_bytes sizes `extern __shared__`.
    - a kernel file that is not in gpu/kernels/ is given by path; a template kernel by its
      instantiation, emu.launch(path, "sgemm<64, 8>", ...), declared in `kernels=` of
      emu.load(path, kernels=[...], defines={...}) first.
    - emu.launches lists every launch (file, kernel, grid, block, shared_bytes): what a
      fused kernel saves is counted, not claimed.
    - empty / zeros / asarray / address / to_numpy make the Emulator a Device for the op
      sequences of gpu/fused.py, which run unchanged on CuPy arrays on a GPU.
    - Emulator(kernel_dir=d) looks bare file names up in d first: a modified copy of a
      kernel file runs through the unchanged ops of gpu/fused.py.
    - A sanitizer variant only loads in a process with its runtime preloaded: use
      emulate/sanitize.py, which starts one.

One launch's view: check the arguments against the parameter list (a wrong dtype is a
ValueError naming the parameter), pack a void* per argument, call the library's wrapper
(ctypes drops the GIL), and turn the shim's error string into an EmulatorError. The
threads of the launch: emulate/cuda_shim.h.

Read next: emulate/sanitize.py, gpu/fused.py
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from minidist.gpu.emulate.build import VARIANTS, Library, build, sanitizer_runtime
from minidist.gpu.emulate.source import Param, kernel_path

MAX_THREADS_PER_BLOCK = 1024
MAX_SHARED_BYTES = 227 * 1024          # dynamic shared memory per block on sm_90 (opt-in)


class EmulatorError(RuntimeError):
    """A launch broke in the emulator (a deadlock at a barrier, or a bad configuration)."""


@dataclass(frozen=True)
class LaunchRecord:
    """One kernel launch, as emu.launches lists it."""

    file: str
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int


class Emulator:
    """Builds .cu files for the CPU on first use and launches their kernels (module doc)."""

    def __init__(self, variant: str = "plain", timeout_s: float = 60.0,
                 kernel_dir: str | Path | None = None) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"Emulator: unknown variant {variant!r}; use one of {list(VARIANTS)}")
        runtime = sanitizer_runtime(variant) if variant != "plain" else None
        if variant != "plain" and (runtime is None or runtime not in os.environ.get(
                "LD_PRELOAD", "")):
            raise EmulatorError(
                f"Emulator(variant={variant!r}): the {variant} sanitizer runtime is not "
                "preloaded in this process, and a sanitized library cannot load without it. "
                "Run the code through minidist.gpu.emulate.sanitize.run_python.")
        self.variant, self.timeout_s = variant, timeout_s
        self.kernel_dir = None if kernel_dir is None else Path(kernel_dir)
        self.launches: list[LaunchRecord] = []
        self._libs: list[Library] = []
        self._handles: dict[str, ctypes.CDLL] = {}
        self._paths: dict[str, str] = {}

    # --- the Device protocol (gpu/fused.py) ---
    def empty(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """An uninitialised array (NaN-filled for floats, so unwritten outputs show)."""
        a = np.empty(shape, dtype)
        if a.dtype.kind == "f":
            a.fill(np.nan)
        return a

    def zeros(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        return np.zeros(shape, dtype)

    def asarray(self, a: Any, dtype: Any = None) -> np.ndarray:
        """A C-contiguous copy, as a copy to a GPU would be (kernels write in place)."""
        return np.array(a, dtype=dtype, order="C", copy=True)

    def address(self, a: np.ndarray) -> int:
        return a.ctypes.data

    def to_numpy(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    # --- building and launching ---
    def load(self, cu: str | Path, kernels: Iterable[str] | None = None,
             defines: Mapping[str, object] | None = None) -> Library:
        """Build (or take from the cache) and load the kernel file `cu`; returns its Library."""
        lib = build(self._resolve(cu), self.variant, kernels=kernels, defines=defines)
        if lib.path not in self._handles:
            handle = ctypes.CDLL(lib.path)
            for symbol in lib.symbols.values():
                fn = getattr(handle, symbol)
                fn.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.c_ulonglong,
                               ctypes.c_double, ctypes.POINTER(ctypes.c_void_p),
                               ctypes.c_char_p, ctypes.c_ulonglong]
                fn.restype = ctypes.c_int
            self._handles[lib.path] = handle
        self._libs.insert(0, lib)                       # the newest build of a file wins
        return lib

    def launch(self, cu: str | Path, kernel: str, grid: Any, block: Any,
               args: Sequence[Any], shared_bytes: int = 0) -> None:
        """Run `kernel` of file `cu` over `grid` x `block` threads on `args` (module doc)."""
        lib = self._library_with(cu, kernel)
        g, b = dims3(grid, "grid"), dims3(block, "block")
        threads = b[0] * b[1] * b[2]
        if threads > MAX_THREADS_PER_BLOCK or not 0 <= shared_bytes <= MAX_SHARED_BYTES:
            raise ValueError(f"{kernel}: block {b} has {threads} threads and asks for "
                             f"{shared_bytes} B of dynamic shared memory; a block may have at "
                             f"most {MAX_THREADS_PER_BLOCK} threads and {MAX_SHARED_BYTES} B.")
        params = lib.kernels[kernel.split("<")[0].strip()].params
        if len(args) != len(params):
            raise ValueError(f"{kernel} takes {len(params)} arguments "
                             f"({', '.join(p.name for p in params)}); got {len(args)}.")
        values = [_c_value(p, a, kernel) for p, a in zip(params, args)]
        argv = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        dims = (ctypes.c_uint * 6)(*g, *b)
        err = ctypes.create_string_buffer(1024)
        wrapper = getattr(self._handles[lib.path], lib.symbols[kernel])
        rc = wrapper(dims, shared_bytes, self.timeout_s, argv, err, len(err))
        self.launches.append(LaunchRecord(Path(cu).name, kernel, g, b, shared_bytes))
        if rc != 0:
            raise EmulatorError(f"{Path(cu).name}:{kernel} grid={g} block={b}: "
                                f"{err.value.decode()}")

    def _resolve(self, cu: str | Path) -> str:
        if str(cu) not in self._paths:
            mine = None if self.kernel_dir is None else self.kernel_dir / Path(cu).name
            use_mine = mine is not None and not Path(cu).is_absolute() and mine.exists()
            self._paths[str(cu)] = str(kernel_path(mine if use_mine else cu))
        return self._paths[str(cu)]

    def _library_with(self, cu: str | Path, kernel: str) -> Library:
        for lib in self._libs:
            if lib.source == self._resolve(cu) and kernel in lib.symbols:
                return lib
        lib = self.load(cu)
        if kernel not in lib.symbols:
            raise ValueError(f"{Path(cu).name} has no kernel {kernel!r}; it has "
                             f"{sorted(lib.symbols)} (load a template instantiation first: "
                             "emu.load(cu, kernels=[...])).")
        return lib


def dims3(d: Any, what: str) -> tuple[int, int, int]:
    """(x, y, z) of a grid or block given as an int or a 1-3 tuple; y, z default to 1."""
    t = (int(d),) if np.isscalar(d) else tuple(int(x) for x in d)
    if not 1 <= len(t) <= 3 or min(t) < 1:
        raise ValueError(f"{what} {d!r}: give 1 to 3 positive sizes (x, y, z).")
    return (t + (1, 1))[:3]


def _c_value(p: Param, a: Any, kernel: str) -> ctypes._SimpleCData:
    where = f"{kernel}: argument {p.name!r} ({p.ctype}{'*' * p.pointer})"
    if p.dtype is None:
        raise ValueError(f"{where}: the emulator does not know the type {p.ctype!r}.")
    if p.pointer == 0:
        if isinstance(a, np.ndarray) or not np.isscalar(a):
            raise ValueError(f"{where} is a scalar; got {type(a).__name__}.")
        return np.ctypeslib.as_ctypes_type(np.dtype(p.dtype))(np.dtype(p.dtype).type(a))
    if a is None:
        return ctypes.c_void_p(None)
    if not isinstance(a, np.ndarray) or a.dtype != np.dtype(p.dtype) \
            or not a.flags.c_contiguous:
        got = (type(a).__name__ if not isinstance(a, np.ndarray) else
               f"a {'' if a.flags.c_contiguous else 'non-contiguous '}{a.dtype} array")
        raise ValueError(f"{where} needs a C-contiguous {p.dtype} NumPy array; got {got}. "
                         "Convert with emu.asarray(a, dtype).")
    return ctypes.c_void_p(a.ctypes.data)
