"""Run emulated kernels under ThreadSanitizer or AddressSanitizer, in a child process.

A sanitizer watches every memory access of the code it instrumented, so the kernels of a
`thread` or `address` build (build.py) are checked as they run on the emulator's threads:

    ThreadSanitizer: two threads touch the same address, at least one writes, and no
        barrier (no happens-before edge) orders them: a data race. Remove a __syncthreads
        between writing shared memory and reading it, and TSan names both lines.
    AddressSanitizer: a read or write lands outside any allocation (the NumPy array's heap
        block, or a static __shared__ array): out of bounds. Remove an `if (i < n)` guard
        and launch more threads than elements, and ASan names the line and the array.

Python itself is not instrumented, so its runtime must be loaded first (LD_PRELOAD) in a
fresh interpreter; this module starts one, runs your code there and reads the reports
from its stderr. The code builds its kernels with Emulator(variant) as usual.

One call's view (run_python):
    1. find the runtime (g++ -print-file-name=libtsan.so / libasan.so)
    2. run `python -c code` with LD_PRELOAD=runtime and the sanitizer's options (report
       every finding, do not stop at the first; ASan's leak check off: Python keeps its
       objects until exit on purpose)
    3. collect each "WARNING: ThreadSanitizer: ..." / "ERROR: AddressSanitizer: ..." line

References: Serebryany & Iskhodzhanov 2009, "ThreadSanitizer: data race detection in
practice" (WBIA); Serebryany et al. 2012, "AddressSanitizer: A Fast Address Sanity Checker"
(USENIX ATC).
Read next: emulate/cases.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

from minidist.gpu.emulate.build import sanitizer_missing, sanitizer_runtime

OPTIONS = {
    "thread": ("TSAN_OPTIONS", "halt_on_error=0 exitcode=66 report_signal_unsafe=0"),
    "address": ("ASAN_OPTIONS", "detect_leaks=0 halt_on_error=0 exitcode=67"),
}
_FINDING = re.compile(r"(WARNING: ThreadSanitizer: .*|ERROR: AddressSanitizer: .*)")


@dataclass(frozen=True)
class Report:
    """What a sanitized run said: its exit code, its findings and its whole stderr."""

    variant: str
    returncode: int
    findings: tuple[str, ...]
    stdout: str
    stderr: str

    @property
    def clean(self) -> bool:
        """True when the code ran to the end and the sanitizer found nothing."""
        return self.returncode == 0 and not self.findings


def run_python(code: str, variant: str, timeout_s: float = 300.0) -> Report:
    """Run `code` in a fresh Python with the `variant` sanitizer runtime preloaded."""
    reason = sanitizer_missing(variant) if variant in OPTIONS else f"unknown {variant!r}"
    if reason:
        raise ValueError(f"run_python(variant={variant!r}): cannot run sanitized: {reason}")
    name, opts = OPTIONS[variant]
    env = dict(os.environ, LD_PRELOAD=sanitizer_runtime(variant) or "", PYTHONUNBUFFERED="1")
    env[name] = f"{opts} {env.get(name, '')}".strip()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    findings = tuple(m.group(1).strip() for m in _FINDING.finditer(proc.stderr))
    return Report(variant, proc.returncode, findings, proc.stdout, proc.stderr)
