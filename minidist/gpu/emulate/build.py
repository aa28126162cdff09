"""Build a .cu file for the CPU: g++ with cuda_shim.h, into a shared library ctypes can load.

The kernel file is compiled as C++20 with the text nvcc sees (`g++ -include cuda_shim.h
-x c++`), but for one rewritten line per `extern __shared__` array
(source.rewrite_dynamic_shared). After it, one small launch wrapper per kernel is appended,
an `extern "C"` function with a fixed C signature that hands the kernel to
cuda_shim::launch, which deduces the argument types from the kernel itself:

    int minidist_launch_<i>(const unsigned* dims6, unsigned long long shared_bytes,
                            double timeout_s, void** args, char* err, unsigned long long n)

Three variants of every library:
    plain    -O1                                     the ordinary emulator
    thread   -O1 -g -fsanitize=thread                ThreadSanitizer: data races, e.g. a
                                                     missing __syncthreads
    address  -O1 -g -fsanitize=address               AddressSanitizer: reads and writes out
                                                     of bounds, e.g. a missing `if (i < n)`
A sanitizer library only loads into a process that has its runtime preloaded
(emulate/sanitize.py starts such a process).

Cache: the library's file name carries a hash of the compiler, the flags, cuda_shim.h and
the translation unit, under $MINIDIST_KERNEL_CACHE (default ~/.cache/minidist/emulate),
so a second build of the same source and flags costs one hash. Files are written to a
temporary name and renamed, so concurrent builds cannot see half a library.

One call's view (build):
    1. read the .cu, list its kernels (source.read_kernels), rewrite dynamic shared memory
    2. add the wrappers; hash everything that affects the result
    3. if the cache has that hash, return it; else run g++ and name the command and its
       stderr in the error when it fails

Read next: emulate/runner.py
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from minidist.gpu.emulate.source import Kernel, kernel_path, read_kernels, rewrite_dynamic_shared

SHIM = Path(__file__).resolve().parent / "cuda_shim.h"
BASE_FLAGS = ("-std=c++20", "-fPIC", "-shared", "-pthread", "-x", "c++")
VARIANTS: dict[str, tuple[str, ...]] = {
    "plain": ("-O1",),
    "thread": ("-O1", "-g", "-fsanitize=thread"),
    "address": ("-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"),
}
RUNTIMES = {"thread": "libtsan.so", "address": "libasan.so"}
_WRAPPER = """
extern "C" int {symbol}(const unsigned* d, unsigned long long shared_bytes, double timeout_s,
                        void** args, char* err, unsigned long long err_len) {{
  return cuda_shim::launch(&{expr}, dim3(d[0], d[1], d[2]), dim3(d[3], d[4], d[5]),
                           shared_bytes, timeout_s, args, err, err_len);
}}
"""


class BuildError(RuntimeError):
    """g++ failed; the message holds the command and its stderr."""


@dataclass(frozen=True)
class Library:
    """A compiled kernel file: the .so, its variant, and each kernel's wrapper symbol."""

    source: str
    path: str
    variant: str
    kernels: Mapping[str, Kernel] = field(repr=False)
    symbols: Mapping[str, str] = field(repr=False)      # kernel expression -> wrapper symbol


def compiler() -> str:
    """The C++ compiler: $CXX if set, else g++ (the emulator needs C++20's std::atomic_ref)."""
    return os.environ.get("CXX", "g++")


def compiler_missing() -> str | None:
    """Why no kernel can be built here, or None when the compiler is on PATH."""
    if shutil.which(compiler()) is None:
        return f"no C++ compiler: {compiler()!r} is not on PATH (install g++ >= 10 or set CXX)"
    return None


def sanitizer_runtime(variant: str) -> str | None:
    """The sanitizer runtime library's absolute path, or None when it is not installed."""
    if variant not in RUNTIMES or compiler_missing():
        return None
    out = subprocess.run([compiler(), f"-print-file-name={RUNTIMES[variant]}"],
                         capture_output=True, text=True).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else None


def sanitizer_missing(variant: str) -> str | None:
    """Why the `variant` ("thread" or "address") build cannot run here, or None."""
    reason = compiler_missing()
    if reason is None and sanitizer_runtime(variant) is None:
        reason = (f"{compiler()} has no {RUNTIMES[variant]} (install the sanitizer runtime, "
                  f"e.g. apt-get install lib{variant[0]}san2)")
    return reason


def cache_dir() -> Path:
    """Where built libraries are kept: $MINIDIST_KERNEL_CACHE or ~/.cache/minidist/emulate."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minidist"
    return Path(os.environ.get("MINIDIST_KERNEL_CACHE", default / "emulate"))


def build(cu: str | Path, variant: str = "plain", *, kernels: Iterable[str] | None = None,
          defines: Mapping[str, object] | None = None) -> Library:
    """Compile the kernel file `cu` (a path, or a name in gpu/kernels/) into a Library.

    kernels: the kernel expressions to wrap; default every `__global__` function of the file.
        A template kernel needs its arguments spelled out, e.g. "sgemm_tiled<64, 8>".
    defines: -D macros, e.g. {"BLOCK": 128}; part of the cache key.
    """
    if variant not in VARIANTS:
        raise ValueError(f"build: unknown variant {variant!r}; choose one of {list(VARIANTS)}")
    path = kernel_path(cu)
    declared = read_kernels(path)
    exprs = list(declared) if kernels is None else list(kernels)
    for expr in exprs:
        if expr.split("<")[0].strip() not in declared:
            raise ValueError(f"build: {path.name} declares no kernel {expr!r}; it declares "
                             f"{sorted(declared)}")
    symbols = {expr: f"minidist_launch_{i}" for i, expr in enumerate(exprs)}
    unit = (f'#line 1 "{path}"\n' + rewrite_dynamic_shared(path.read_text())
            + '\n#line 1 "minidist-launch-wrappers"\n'
            + "".join(_WRAPPER.format(symbol=s, expr=e) for e, s in symbols.items()))
    flags = list(BASE_FLAGS) + list(VARIANTS[variant]) + ["-include", str(SHIM)]
    flags += [f"-D{k}={v}" for k, v in sorted((defines or {}).items())]
    key = hashlib.sha256("\0".join([_compiler_version(), *flags, SHIM.read_text(), unit])
                         .encode()).hexdigest()[:20]
    out = cache_dir() / f"{path.stem}-{variant}-{key}.so"
    if not out.exists():
        _compile(flags, unit, out, path)
    return Library(str(path), str(out), variant, declared, symbols)


def build_many(sources: Iterable[str | Path], variant: str = "plain",
               jobs: int | None = None) -> list[Library]:
    """build() every file in `sources`, `jobs` compilers at a time (default: one per core)."""
    sources = list(sources)
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda s: build(s, variant), sources))


def _compile(flags: list[str], unit: str, out: Path, path: Path) -> None:
    reason = compiler_missing()
    if reason:
        raise BuildError(f"cannot build {path.name}: {reason}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{id(unit)}.tmp")
    src = tmp.with_suffix(".cpp")
    src.write_text(unit)
    cmd = [compiler(), *flags, str(src), "-o", str(tmp)]
    try:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # not a sanitized g++
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise BuildError(f"compiling {path} for the CPU emulator failed (exit "
                             f"{proc.returncode}).\ncommand: {' '.join(cmd)}\n{proc.stderr}")
        os.replace(tmp, out)
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


_VERSION: dict[str, str] = {}


def _compiler_version() -> str:
    cxx = compiler()
    if cxx not in _VERSION:
        try:
            _VERSION[cxx] = subprocess.run([cxx, "--version"], capture_output=True,
                                           text=True).stdout
        except OSError:
            _VERSION[cxx] = "missing"
    return _VERSION[cxx]
