"""Compile gate: every kernel compiles for sm_90, spills nothing, and uses what the table says.

A CUDA kernel can be wrong in ways no CPU test sees: it may not compile for the target GPU
at all, or the register allocator may run out of its 255 registers per thread and spill
values to local memory (DRAM behind L1): a silent slowdown of the very loop the kernel
was written to speed up. ptxas reports both without a GPU:

    nvcc -arch=sm_90 --ptxas-options=-v -cubin -o <tmp> file.cu
    ptxas info : Compiling entry function 'sgemm_smem_32' for 'sm_90'
        0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info : Used 31 registers, used 1 barriers, 8192 bytes smem

Registers and shared memory per block decide how many blocks an SM can hold (its
occupancy: 64K registers and at most 228 KB of shared memory per SM on sm_90), so the
gate also keeps them in a checked-in table, gpu/kernels/resources.json. A change shows up
in review as a diff of that table, instead of as a surprise on the GPU.

One run's view (`gate`):
    1. list gpu/kernels/*.cu; compile each with nvcc for sm_90 and CuPy's flags (-ftz=true,
       --std=c++17: CUPY_FLAGS), two at a time (one per core), each result cached under a
       hash of (nvcc version, flags, source)
    2. parse ptxas' report: per entry function, registers, smem bytes, stack, spills
    3. when CuPy imports, compile each file again with NVRTC (CuPy's private
       `cupy.cuda.compiler._NVRTCProgram`, the only NVRTC path that needs no device), the
       compiler CuPy's RawModule uses at run time
    4. problems: a file that does not compile, a spill store or load, and a kernel whose
       registers or smem differ from resources.json (or that the table lacks or still lists)
`python -m minidist.gpu.compile_gate --update` rewrites the table after an intended change.

The table records the nvcc version it was made with: register counts move between
compiler releases, so a different nvcc compares compile success and spills only.

References: NVIDIA, "CUDA C++ Best Practices Guide", sections on register pressure and
    occupancy; NVIDIA, "NVRTC" documentation (runtime compilation); Volkov 2010, "Better
    performance at lower occupancy" (GTC) on registers versus occupancy.
Read next: gpu/hierarchy.py (the ladder these kernels form), gpu/emulate/runner.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minidist.cli import CliParser, at_least

KERNELS = Path(__file__).resolve().parent / "kernels"
TABLE = KERNELS / "resources.json"
ARCH = "sm_90"
# CuPy's RawModule compiles with NVRTC and appends -ftz=true to every compile
# (cupy/cuda/compiler.py, _compile_with_cache_cuda); fused.CupyDevice passes --std=c++17.
# The gate compiles with the same two, so its registers are the ones the GPU run gets.
CUPY_FLAGS = ("-ftz=true", "--std=c++17")
FLAGS = ("-arch=" + ARCH, "--ptxas-options=-v", "-cubin") + CUPY_FLAGS
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass(frozen=True)
class Resources:
    """What ptxas reports for one kernel: registers per thread, bytes of static shared
    memory per block, stack frame bytes, spill store and load bytes."""
    file: str
    registers: int
    smem: int
    stack: int
    spill_stores: int
    spill_loads: int


@dataclass(frozen=True)
class FileResult:
    """One .cu file through nvcc: its kernels, or the compiler's error."""
    file: str
    kernels: dict[str, Resources] = field(default_factory=dict)
    error: str = ""


def nvcc() -> str | None:
    """nvcc's path: on PATH, else under $CUDA_HOME or /usr/local/cuda; None when absent."""
    for candidate in (shutil.which("nvcc"),
                      os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin/nvcc")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def nvcc_version() -> str:
    """'13.0.88' from `nvcc --version` ('' without nvcc)."""
    path = nvcc()
    if path is None:
        return ""
    text = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"V(\d+\.\d+\.\d+)", text)
    return match.group(1) if match else text.strip().splitlines()[-1]


def parse_ptxas(text: str, file: str) -> dict[str, Resources]:
    """{kernel: Resources} from ptxas -v output (entry functions for any arch)."""
    found, name, frame = {}, None, (0, 0, 0)
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            name, frame = m.group(1), (0, 0, 0)
        elif (m := _FRAME.search(line)) and name:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _USED.search(line)) and name:
            smem = _SMEM.search(line)
            found[name] = Resources(file, int(m.group(1)), int(smem.group(1)) if smem else 0,
                                    *frame)
            name = None
    return found


def cache_dir() -> Path:
    """$MINIDIST_KERNEL_CACHE/compile_gate, else ~/.cache/minidist/compile_gate."""
    root = os.environ.get("MINIDIST_KERNEL_CACHE")
    base = Path(root) if root else Path(os.environ.get(
        "XDG_CACHE_HOME", Path.home() / ".cache")) / "minidist"
    return base / "compile_gate"


def compile_file(path: str | Path, extra: tuple[str, ...] = ()) -> FileResult:
    """nvcc one kernel file for sm_90 with ptxas -v (and `extra` flags); cached by hash."""
    path, exe = Path(path), nvcc()
    if exe is None:
        raise RuntimeError("compile_gate: nvcc not found on PATH, in $CUDA_HOME/bin or "
                           "/usr/local/cuda/bin; install the CUDA toolkit (13.x)")
    flags = FLAGS + tuple(extra)
    key = hashlib.sha256("\0".join([nvcc_version(), *flags, path.read_text()]).encode())
    cached = cache_dir() / f"{path.stem}-{key.hexdigest()[:20]}.json"
    if cached.exists():
        return _load_result(json.loads(cached.read_text()))
    with tempfile.TemporaryDirectory(prefix="minidist-gate-") as tmp:
        cmd = [exe, *flags, "-o", os.path.join(tmp, "out.cubin"), str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return FileResult(path.name, {}, f"$ {' '.join(cmd)}\n{done.stderr.strip()}")
    result = FileResult(path.name, parse_ptxas(done.stderr + done.stdout, path.name))
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp_json = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    tmp_json.write_text(json.dumps(asdict(result)))
    os.replace(tmp_json, cached)                        # atomic: no half-written cache entry
    return result


def _load_result(d: dict) -> FileResult:
    return FileResult(d["file"], {k: Resources(**v) for k, v in d["kernels"].items()},
                      d["error"])


def kernel_files(root: Path = KERNELS) -> list[Path]:
    """Every .cu file of gpu/kernels/, sorted."""
    return sorted(root.glob("*.cu"))


def compile_all(files: list[Path], jobs: int | None = None) -> list[FileResult]:
    """compile_file over `files`, `jobs` nvcc processes at a time (default: one per core)."""
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        return list(pool.map(compile_file, files))


def nvrtc_errors(files: list[Path]) -> tuple[list[str], str]:
    """(one message per file NVRTC cannot compile for sm_90, why NVRTC was skipped or '')."""
    try:
        from cupy.cuda import compiler
    except Exception as e:                     # ImportError, or a CuPy without its CUDA libs
        return [], f"CuPy is not importable ({type(e).__name__}: {e}); NVRTC path skipped"
    try:                                       # a trivial program: is NVRTC itself there?
        compiler._NVRTCProgram('extern "C" __global__ void probe() {}', name="probe.cu",
                               method="cubin").compile(("-arch=" + ARCH,))
    except Exception as e:                     # libnvrtc missing, or too old for sm_90
        return [], f"CuPy's NVRTC is unavailable ({type(e).__name__}: {e}); NVRTC path skipped"
    errors = []
    for path in files:
        try:
            program = compiler._NVRTCProgram(path.read_text(), name=path.name, method="cubin")
            program.compile(("-arch=" + ARCH,) + CUPY_FLAGS)
        except Exception as e:                 # CompileException carries NVRTC's log
            errors.append(f"{path.name}: NVRTC cannot compile it for {ARCH}: {e}")
    return errors, ""


def table(results: list[FileResult], version: str) -> dict:
    """The resources.json form: {"nvcc", "arch", "kernels": {name: Resources fields}}."""
    kernels = {name: asdict(r) for res in results for name, r in res.kernels.items()}
    return {"nvcc": version, "arch": ARCH, "kernels": dict(sorted(kernels.items()))}


def dump(t: dict) -> str:
    """The table as JSON text with one line per kernel, so a change is a one-line diff."""
    rows = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in t["kernels"].items()]
    head = "".join(f" {json.dumps(k)}: {json.dumps(v)},\n" for k, v in t.items() if k != "kernels")
    return "{\n" + head + ' "kernels": {\n' + ",\n".join(rows) + "\n }\n}\n"


def problems(results: list[FileResult], checked_in: dict | None, version: str) -> list[str]:
    """Every reason the gate fails: a file that does not compile, a spill, a kernel whose
    registers or smem differ from the checked-in table (same nvcc version only)."""
    out, seen = [], {}
    for res in results:
        if res.error:
            out.append(f"{res.file} does not compile for {ARCH}:\n{res.error}")
        for name, r in res.kernels.items():
            if name in seen:
                out.append(f"kernel {name} is defined in both {seen[name]} and {res.file}: "
                           "extern \"C\" names must be unique; rename one")
            seen[name] = res.file
            if r.spill_stores or r.spill_loads:
                out.append(f"{name} ({res.file}) spills: {r.spill_stores} bytes stored to and "
                           f"{r.spill_loads} bytes loaded from local memory with {r.registers} "
                           "registers. Use smaller thread tiles (fewer accumulators) or fewer "
                           "live values in the inner loop.")
    if checked_in is None or checked_in.get("nvcc") != version:
        return out
    now, then = table(results, version)["kernels"], checked_in.get("kernels", {})
    hint = ("if the change is intended, regenerate the table: "
            "python -m minidist.gpu.compile_gate --update")
    for name in sorted(set(now) | set(then)):
        a, b = then.get(name), now.get(name)
        if a is None or b is None:
            where = "missing from" if a is None else "listed in"
            state = "new" if a is None else "gone (or its file no longer compiles)"
            out.append(f"kernel {name} is {state} but {where} resources.json; {hint}")
        elif (a["registers"], a["smem"]) != (b["registers"], b["smem"]):
            out.append(f"{name} ({b['file']}): registers {a['registers']} -> {b['registers']}, "
                       f"smem {a['smem']} -> {b['smem']} bytes, against resources.json; {hint}")
    return out


@dataclass(frozen=True)
class Report:
    """gate()'s answer: the per-file results, the problems, and notes on what was skipped."""
    results: list[FileResult]
    problems: list[str]
    notes: list[str]


def gate(files: list[Path] | None = None, jobs: int | None = None,
         update: bool = False) -> Report:
    """Compile every kernel file (module doc, One run's view); with update=True, rewrite
    resources.json from this compile first (refused while a file fails or spills)."""
    files = kernel_files() if files is None else files
    version, results = nvcc_version(), compile_all(files, jobs)
    checked_in = json.loads(TABLE.read_text()) if TABLE.exists() else None
    notes, found = [], problems(results, None, version)
    if update and not found:
        TABLE.write_text(dump(table(results, version)))
        checked_in = json.loads(TABLE.read_text())
        count = sum(len(r.kernels) for r in results)
        notes.append(f"wrote gpu/kernels/{TABLE.name} ({count} kernels)")
    elif update:
        notes.append(f"{TABLE.name} NOT rewritten: fix the problems below first")
    if checked_in is None:
        notes.append(f"no {TABLE.name} yet: create it with --update")
    elif checked_in.get("nvcc") != version:
        notes.append(f"{TABLE.name} was made with nvcc {checked_in.get('nvcc')}, this is "
                     f"{version}: registers and smem not compared (compile and spills are)")
    nvrtc, why = nvrtc_errors(files)
    notes += [why] if why else [f"NVRTC (CuPy) compiled all {len(files)} files for {ARCH}"]
    return Report(results, problems(results, checked_in, version) + nvrtc, notes)


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist.gpu.compile_gate [--update]`: the table, then OK or FAIL."""
    ap = CliParser(prog="python -m minidist.gpu.compile_gate",
                   description=__doc__.splitlines()[0])
    ap.add_argument("--update", action="store_true",
                    help="rewrite gpu/kernels/resources.json from this compile")
    ap.add_argument("--jobs", type=at_least(1), default=None, help="nvcc processes at a time")
    a = ap.parse_args(argv)
    if nvcc() is None:
        print("compile gate skipped: nvcc not found (install the CUDA toolkit)")
        return 0
    report = gate(jobs=a.jobs, update=a.update)
    print(f"compile gate · nvcc {nvcc_version()} · {ARCH} · {len(report.results)} files")
    print(f"  {'kernel':<36} {'file':<26} {'regs':>4} {'smem B':>7} {'spill B':>7}")
    for res in report.results:
        for name, r in res.kernels.items():
            print(f"  {name:<36} {res.file:<26} {r.registers:>4} {r.smem:>7} "
                  f"{r.spill_stores + r.spill_loads:>7}")
    print("\n".join(f"note: {n}" for n in report.notes))
    if report.problems:
        print("\n".join(f"FAIL: {p}" for p in report.problems))
        return 1
    print(f"OK: every kernel compiles for {ARCH} without spills and matches {TABLE.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
