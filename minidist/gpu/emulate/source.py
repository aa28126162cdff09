"""Kernel source: where the .cu files live, which kernels a file declares, and their parameters.

A kernel's parameter list is the only description of its arguments that both launchers
need: the CPU emulator (runner.py) must hand each argument over as the exact C type, and
so must the CuPy launcher (gpu/fused.py), since CuPy does not check arguments (a Python
float would arrive as a double where the kernel reads a float). So both read the list
from the source instead of repeating it by hand.

Rules this parser relies on (every file in gpu/kernels/ follows them):
    - a kernel is `extern "C" __global__ void name(params)`, so that its symbol is its name
      for the emulator's launch wrapper and for CuPy's RawModule.get_function;
    - parameters are scalars (float, double, int, unsigned, long long, size_t, bool),
      arrays as pointers (`const float* __restrict__ x`), or tables of pointers
      (`float* const* params`, handed over as uint64 addresses).

One call's view (read_kernels):
    1. drop the comments, find each `__global__ ... void name(`, take the text up to the
       matching parenthesis
    2. split it at top-level commas; per parameter drop const / __restrict__, count the `*`,
       the last word is the name and the words before it the C type
    3. map the C type to a NumPy dtype (float -> float32, int -> int32, ...; None if unknown)

Read next: emulate/build.py
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"

_DTYPES = {
    "float": "float32", "double": "float64", "bool": "bool", "char": "int8",
    "unsigned char": "uint8", "short": "int16", "unsigned short": "uint16",
    "int": "int32", "int32_t": "int32", "unsigned": "uint32", "unsigned int": "uint32",
    "uint32_t": "uint32", "long": "int64", "long long": "int64", "long long int": "int64",
    "int64_t": "int64", "unsigned long": "uint64", "unsigned long long": "uint64",
    "uint64_t": "uint64", "size_t": "uint64", "float2": "float32", "float4": "float32",
    "int2": "int32", "int4": "int32",
}
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict"}
_DECL = re.compile(r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+"
                   r"(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")
_DYNAMIC_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?([A-Za-z_][\w ]*?)\s+"
    r"(?:__align__\s*\(\s*\d+\s*\)\s+)?(\w+)\s*\[\s*\]\s*;")


@dataclass(frozen=True)
class Param:
    """One kernel parameter: `pointer` 0 = scalar, 1 = array, 2 = table of addresses."""

    name: str
    ctype: str            # the base C type, qualifiers dropped: "float", "long long"
    pointer: int
    dtype: str | None     # NumPy dtype of the scalar / of the array's elements (uint64 for
                          # a table of addresses); None for a type this parser does not know


@dataclass(frozen=True)
class Kernel:
    """A `__global__` function of a .cu file and its parameters, in order."""

    name: str
    params: tuple[Param, ...]
    path: str

    def signature(self) -> str:
        """The parameter list as C, e.g. 'layernorm_forward(float* x, int N)'."""
        args = ", ".join(f"{p.ctype}{'*' * p.pointer} {p.name}" for p in self.params)
        return f"{self.name}({args})"


def kernel_path(name: str | Path) -> Path:
    """The path of a kernel file: a bare name ('layernorm.cu') is looked up in gpu/kernels/."""
    path = Path(name)
    if not path.is_absolute() and not path.exists() and (KERNELS_DIR / path).exists():
        path = KERNELS_DIR / path
    if not path.exists():
        raise ValueError(f"kernel source {str(name)!r} not found: neither that path nor "
                         f"{KERNELS_DIR / path.name} exists. Name a file in gpu/kernels/ "
                         f"or give a path.")
    return path.resolve()


def strip_comments(text: str) -> str:
    """The source without // and /* */ comments (newlines kept, so line numbers hold)."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def read_kernels(path: str | Path) -> dict[str, Kernel]:
    """Every `__global__` function declared in the file at `path`, by name, in file order."""
    path = kernel_path(path)
    text = strip_comments(path.read_text())
    kernels: dict[str, Kernel] = {}
    for match in _DECL.finditer(text):
        body = _up_to_matching_paren(text, match.end(), path)
        params = tuple(_param(p, path) for p in _split_top_level(body) if p.strip())
        kernels.setdefault(match.group(1), Kernel(match.group(1), params, str(path)))
    return kernels


def rewrite_dynamic_shared(text: str) -> str:
    """`extern __shared__ T name[];` -> a pointer to the launch's dynamic shared buffer.

    The only change the emulator makes to kernel text: C++ has no storage whose size is
    chosen at launch, so the array becomes a pointer into the buffer the shim allocates
    with exactly the launch's shared-memory size. One line in, one line out.
    """
    return _DYNAMIC_SHARED.sub(
        lambda m: f"{m.group(1)}* {m.group(2)} = reinterpret_cast<{m.group(1)}*>"
                  f"(cuda_shim::dynamic_shared());", text)


def _up_to_matching_paren(text: str, start: int, path: Path) -> str:
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    raise ValueError(f"{path}: a kernel's parameter list opened at offset {start} never closes")


def _split_top_level(body: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in body:
        depth += {"(": 1, "<": 1, ")": -1, ">": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _param(text: str, path: Path) -> Param:
    tokens = re.findall(r"\w+|\*|&", text)
    words = [t for t in tokens if t not in _QUALIFIERS and t not in "*&"]
    if len(words) < 2 or "&" in tokens:
        raise ValueError(f"{path}: cannot read the kernel parameter {text.strip()!r}: expected "
                         "'type name' or 'type* name' (references are not kernel parameters).")
    ctype, pointer = " ".join(words[:-1]), tokens.count("*")
    dtype = "uint64" if pointer >= 2 else _DTYPES.get(ctype)
    return Param(words[-1], ctype, pointer, dtype)
