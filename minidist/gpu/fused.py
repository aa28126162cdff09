"""Kernel fusion: each fused op as the kernel launches it makes, on a GPU or on the emulator.

A fused kernel does in one pass over memory what a framework does in several launches:
LayerNorm reads x once and writes y once instead of writing and re-reading the
normalised x; softmax cross-entropy writes its gradient over the logits instead of
materialising the softmax; AdamW updates every tensor of a model in one launch. The
kernels are in gpu/kernels/*.cu; their unfused counterparts, for measuring what fusion
saves, in gpu/unfused.py and gpu/kernels/unfused.cu.

Each op below is written once, for a `Device`: it allocates outputs with dev.empty, and
launches kernels with dev.launch(file, kernel, grid, block, args). Two devices exist:
    CupyDevice (here)      CuPy arrays on a CUDA GPU; every .cu file is compiled by NVRTC
                           into a cupy.RawModule on first use
    Emulator (emulate/)    NumPy arrays; the same .cu source built with g++ and a C++ shim,
                           blocks run on CPU threads
so the launch sequences (grids, argument order, host-side set-up) that run on the GPU are
the ones the CPU tests check against the float64 twins (gpu/twins.py). Both devices count
launches in dev.launches. Scalars are cast to the exact C type each kernel declares, read
from its source (emulate/source.py): CuPy does not check, and a Python float would arrive
as a double where the kernel reads a float.

One op's view (e.g. layernorm_forward): check shapes and block size, allocate y, mean,
rstd, launch one block per row (at most MAX_BLOCKS, the kernel strides over the rest).
Shapes: activations (..., C) float32 C-contiguous, treated as (N, C) rows.
Reference: llm.c's dev/cuda kernels (Karpathy 2024) pair each kernel with a CPU check.
Read next: gpu/unfused.py, emulate/cases.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from minidist import backend
from minidist.gpu.emulate.runner import LaunchRecord, dims3
from minidist.gpu.emulate.source import Param, kernel_path, read_kernels

MAX_BLOCKS = 1024            # grid cap: kernels stride over rows / elements past it
MAX_PARTIALS = 256           # rows of partial sums in two-stage column reductions
LN_BWD_BLOCKS = 1024         # layernorm_backward's grid: ~8 blocks of 128 threads per SM on
                             # the H200's 132 SMs, one wave; one partial row per block
MAX_SHARED = 227 * 1024      # dynamic shared memory per block on sm_90 (above 48 KiB opt-in)
FA_MAX_D, FA_MAX_BLOCK = 64, 256     # flash_attention.cu: registers per thread
MAX_GRID_Y = 65535                   # CUDA's limit on gridDim.y (and z)


class Device(Protocol):
    """Where arrays live and kernels run: CupyDevice or emulate.runner.Emulator."""

    launches: list

    def empty(self, shape: Any, dtype: Any = np.float32) -> Any: ...
    def zeros(self, shape: Any, dtype: Any = np.float32) -> Any: ...
    def asarray(self, a: Any, dtype: Any = None) -> Any: ...
    def address(self, a: Any) -> int: ...
    def to_numpy(self, a: Any) -> np.ndarray: ...
    def launch(self, cu: str | Path, kernel: str, grid: Any, block: Any,
               args: Sequence[Any], shared_bytes: int = 0) -> None: ...


class CupyDevice:
    """The Device on a CUDA GPU through CuPy (NVRTC compiles each .cu file once).

    Per (file, kernel) the compiled function and its parameter list are looked up once and
    kept, so a launch costs the argument casts and CuPy's own call, not a lookup. `cp` may
    be gpu/standin.StandIn, which stands in for CuPy in the CPU tests and `--dry-run`.
    """

    OPTIONS = ("--std=c++17",)       # NVRTC flags; CuPy adds -ftz=true (compile_gate.py)

    def __init__(self, cp: Any = None) -> None:
        if cp is None:
            problem = backend.gpu_problem()
            if problem is not None:
                raise RuntimeError(
                    f"CupyDevice: the fused GPU path needs CuPy and a CUDA device: {problem}. "
                    "Install the 'gpu' extra on a GPU machine, or run the same kernels on the "
                    "CPU with minidist.gpu.emulate.runner.Emulator().")
            import cupy as cp
        self.cp, self.launches = cp, []
        self._modules: dict[Path, Any] = {}
        self._paths: dict[str, Path] = {}
        self._functions: dict[tuple[Path, str], tuple[Any, tuple[Param, ...]]] = {}

    def empty(self, shape: Any, dtype: Any = np.float32) -> Any:
        return self.cp.empty(shape, dtype)

    def zeros(self, shape: Any, dtype: Any = np.float32) -> Any:
        return self.cp.zeros(shape, dtype)

    def asarray(self, a: Any, dtype: Any = None) -> Any:
        return self.cp.ascontiguousarray(self.cp.asarray(a, dtype))

    def address(self, a: Any) -> int:
        return int(a.data.ptr) if hasattr(a, "data") and hasattr(a.data, "ptr") \
            else int(a.ctypes.data)

    def to_numpy(self, a: Any) -> np.ndarray:
        return self.cp.asnumpy(a)

    def synchronize(self) -> None:
        """Wait for every launch so far; an asynchronous CUDA error surfaces here."""
        self.cp.cuda.Device().synchronize()

    def function(self, cu: str | Path, kernel: str) -> tuple[Any, tuple[Param, ...]]:
        """(the compiled kernel, its parameters) of file cu, compiled and looked up once."""
        path = self._paths.get(str(cu))
        if path is None:
            path = self._paths[str(cu)] = kernel_path(cu)
        key = (path, kernel)
        if key not in self._functions:
            if path not in self._modules:
                self._modules[path] = self.cp.RawModule(code=path.read_text(),
                                                        options=self.OPTIONS)
            kernels = read_kernels(path)
            if kernel not in kernels:
                raise ValueError(f"{path.name} has no kernel {kernel!r}; it has "
                                 f"{sorted(kernels)}.")
            self._functions[key] = (self._modules[path].get_function(kernel),
                                    kernels[kernel].params)
        return self._functions[key]

    def launch(self, cu: str | Path, kernel: str, grid: Any, block: Any,
               args: Sequence[Any], shared_bytes: int = 0) -> None:
        """Launch `kernel` of file `cu` on the current device (same arguments as Emulator)."""
        fn, params = self.function(cu, kernel)
        if len(args) != len(params):
            raise ValueError(f"{kernel} takes {len(params)} arguments; got {len(args)}.")
        if shared_bytes > 48 * 1024 and fn.max_dynamic_shared_size_bytes < shared_bytes:
            fn.max_dynamic_shared_size_bytes = shared_bytes   # above 48 KiB is opt-in
        g, b = dims3(grid, "grid"), dims3(block, "block")
        fn(g, b, tuple(self._arg(p, a, kernel) for p, a in zip(params, args)),
           shared_mem=shared_bytes)
        self.launches.append(LaunchRecord(Path(str(cu)).name, kernel, g, b, shared_bytes))

    def _arg(self, p: Param, a: Any, kernel: str) -> Any:
        if p.pointer == 0:
            t = np.dtype(p.dtype)
            if t.kind in "iu" and not np.iinfo(t).min <= int(a) <= np.iinfo(t).max:
                raise ValueError(f"{kernel}: argument {p.name!r} = {int(a)} does not fit the "
                                 f"kernel's {p.ctype} ({t}); the kernel would see a wrapped "
                                 "value. Split the work or widen the parameter.")
            return t.type(a)
        if a is None:
            return np.uint64(0)
        if not isinstance(a, self.cp.ndarray) or a.dtype != np.dtype(p.dtype) \
                or not a.flags.c_contiguous:
            raise ValueError(f"{kernel}: argument {p.name!r} needs a C-contiguous {p.dtype} "
                             f"CuPy array; got {type(a).__name__} {getattr(a, 'dtype', '')}.")
        return a


# ---- helpers shared with unfused.py ----
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


def grid_for(n: int, per_block: int = 1, cap: int = MAX_BLOCKS) -> int:
    """Blocks for n items at per_block items a block, at least 1 and at most cap."""
    return max(1, min(cdiv(n, per_block), cap))


def check_block(block: int, op: str, warp_multiple: bool = True, most: int = 1024) -> None:
    """A ValueError unless block is a positive multiple of 32 (when asked) and <= most."""
    if not 0 < block <= most or (warp_multiple and block % 32):
        need = "a multiple of 32 (its reductions use whole warps)" if warp_multiple else "> 0"
        raise ValueError(f"{op}: block={block} threads; it must be {need} and at most {most}.")


def rows_of(x: Any, op: str) -> tuple[int, int]:
    """(N, C) of an activation (..., C), which must be a C-contiguous float32 array."""
    if x.dtype != np.float32 or not x.flags.c_contiguous or x.ndim < 1:
        raise ValueError(f"{op}: x must be a C-contiguous float32 array (..., C); got "
                         f"{x.dtype} {x.shape}. The kernels are written for float32.")
    C = x.shape[-1]
    return (x.size // C if C else 0), C


def ce_setup(dev: Device, targets: Any, V: int, reduction: str,
             ignore_index: int) -> tuple[int, float]:
    """(count of counted rows, dloss = dL/dloss_n) for cross-entropy; checks the targets.

    It copies the targets to the host (the GPU waits for it): call it once per batch of
    targets and hand `count` to cross_entropy, not inside a timed or hot loop."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"cross_entropy: reduction={reduction!r}; use 'mean' or 'sum'.")
    t = dev.to_numpy(targets)
    if t.dtype != np.int32:
        raise ValueError(f"cross_entropy: targets must be int32 (the kernel reads int); "
                         f"got {t.dtype}.")
    bad = t[(t != ignore_index) & ((t < 0) | (t >= V))]
    if bad.size:
        raise ValueError(f"cross_entropy: target {int(bad[0])} is outside [0, {V}) and is not "
                         f"ignore_index={ignore_index}.")
    count = int((t != ignore_index).sum())
    return count, ce_dloss(count, reduction)


def ce_dloss(count: int, reduction: str) -> float:
    """dL/dloss_n: 1/count for a mean over the counted rows, 1 for a sum."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"cross_entropy: reduction={reduction!r}; use 'mean' or 'sum'.")
    return 1.0 / max(count, 1) if reduction == "mean" else 1.0


def check_aligned(dev: Device, op: str, **arrays: Any) -> None:
    """A ValueError unless every array starts on a 16-byte boundary (float4 loads)."""
    for name, a in arrays.items():
        if dev.address(a) % 16:
            raise ValueError(f"{op}: {name} starts at an address that is not a multiple of 16 "
                             "bytes, and the kernel loads float4s; pass a whole array (or a "
                             "view starting at a multiple of 4 floats).")


# ---- the fused ops ----
def layernorm_forward(dev: Device, x: Any, w: Any, b: Any, eps: float = 1e-5, *,
                      block: int = 128, blocks: int | None = None) -> tuple[Any, Any, Any]:
    """y = LayerNorm(x) * w + b, and the mean and rstd the backward needs; one launch."""
    N, C = rows_of(x, "layernorm_forward")
    check_block(block, "layernorm_forward")
    y, mean, rstd = dev.empty(x.shape), dev.empty((N,)), dev.empty((N,))
    dev.launch("layernorm.cu", "layernorm_forward", blocks or grid_for(N), block,
               (x, w, b, y, mean, rstd, N, C, eps))
    return y, mean, rstd


def layernorm_backward(dev: Device, dy: Any, x: Any, w: Any, mean: Any, rstd: Any, *,
                       block: int = 128, blocks: int | None = None) -> tuple[Any, Any, Any]:
    """dx, dw, db of LayerNorm: stage 1 over row blocks, stage 2 sums the partial rows.

    Stage 1 runs G = min(N, LN_BWD_BLOCKS) blocks (enough to fill an H200), each keeping
    its partial dw, db row in 8 C bytes of shared memory and writing it once; stage 2 is
    blocks of (32, R) threads, R = min(G, 32) row groups, 32 columns each, adding the G
    partial rows (32 x 32 threads when G ~ 1000: G / R = 32 dependent adds a thread)."""
    N, C = rows_of(x, "layernorm_backward")
    check_block(block, "layernorm_backward")
    shared = 2 * C * 4                     # the block's partial dw, db rows (+128 B static)
    if shared + 128 > MAX_SHARED:
        raise ValueError(f"layernorm_backward: C = {C} columns need {shared + 128} B of shared "
                         f"memory for a block's partial dw and db rows; a block may have at "
                         f"most {MAX_SHARED} B (C <= {(MAX_SHARED - 128) // 8}). Split the "
                         "columns.")
    G = blocks or grid_for(N, cap=LN_BWD_BLOCKS)
    dx, dw, db = dev.empty(x.shape), dev.empty((C,)), dev.empty((C,))
    dw_part, db_part = dev.empty((G, C)), dev.empty((G, C))
    dev.launch("layernorm.cu", "layernorm_backward", G, block,
               (dy, x, w, mean, rstd, dx, dw_part, db_part, N, C), shared_bytes=shared)
    dev.launch("layernorm.cu", "layernorm_param_grads", grid_for(C, 32, cap=2**31 - 1),
               (32, min(G, 32)), (dw_part, db_part, dw, db, G, C))
    return dx, dw, db


def bias_gelu_forward(dev: Device, x: Any, bias: Any, *, block: int = 256,
                      blocks: int | None = None) -> Any:
    """y = gelu_tanh(x + bias) in one elementwise pass."""
    N, C = rows_of(x, "bias_gelu_forward")
    check_block(block, "bias_gelu_forward", warp_multiple=False)
    y = dev.empty(x.shape)
    dev.launch("bias_gelu.cu", "bias_gelu_forward", blocks or grid_for(N * C, block), block,
               (x, bias, y, N * C, C))
    return y


def bias_gelu_backward(dev: Device, dy: Any, x: Any, bias: Any, *, block: int = 128,
                       row_groups: int | None = None) -> tuple[Any, Any]:
    """dx = dy * gelu'(x + bias) and dbias = column sums of dx (two launches)."""
    N, C = rows_of(x, "bias_gelu_backward")
    check_block(block, "bias_gelu_backward", warp_multiple=False)
    G = row_groups or grid_for(N, cap=MAX_PARTIALS)
    dx, dbias, part = dev.empty(x.shape), dev.empty((C,)), dev.empty((G, C))
    dev.launch("bias_gelu.cu", "bias_gelu_backward", (cdiv(C, block), G), block,
               (dy, x, bias, dx, part, N, C))
    dev.launch("bias_gelu.cu", "bias_gelu_dbias", grid_for(C, block), block,
               (part, dbias, G, C))
    return dx, dbias


def softmax_forward(dev: Device, x: Any, scale: float, *, block: int = 128,
                    blocks: int | None = None) -> Any:
    """y = causal softmax(scale * x) of scores (..., T, T); one launch, a block per row."""
    R, T = _scores(x, "softmax_forward")
    check_block(block, "softmax_forward")
    y = dev.empty(x.shape)
    dev.launch("softmax.cu", "softmax_forward", blocks or grid_for(R), block,
               (x, y, R, T, scale))
    return y


def softmax_backward(dev: Device, dy: Any, y: Any, scale: float, *, block: int = 128,
                     blocks: int | None = None) -> Any:
    """dx = scale * y * (dy - rowsum(dy * y)); one launch."""
    R, T = _scores(y, "softmax_backward")
    check_block(block, "softmax_backward")
    dx = dev.empty(y.shape)
    dev.launch("softmax.cu", "softmax_backward", blocks or grid_for(R), block,
               (dy, y, dx, R, T, scale))
    return dx


def cross_entropy(dev: Device, logits: Any, targets: Any, *, reduction: str = "mean",
                  ignore_index: int = -100, block: int = 128, blocks: int | None = None,
                  count: int | None = None) -> tuple[Any, Any]:
    """(loss, per-row losses); the logits (N, V) are overwritten with d loss / d logits.

    count: the rows whose target is not ignore_index, from ce_setup; without it the targets
    are checked and counted here, which copies them to the host."""
    N, V = rows_of(logits, "cross_entropy")
    check_block(block, "cross_entropy")
    if count is None:
        count, dloss = ce_setup(dev, targets, V, reduction, ignore_index)
    else:
        dloss = ce_dloss(count, reduction)
    losses = dev.empty((N,))
    dev.launch("cross_entropy.cu", "cross_entropy_forward_backward", blocks or grid_for(N),
               block, (logits, targets, losses, N, V, dloss, ignore_index))
    return losses.sum() * (1.0 / max(count, 1) if reduction == "mean" else 1.0), losses


class ChunkTable:
    """The device tables of one adamw_multi_tensor launch: the four arrays' addresses per
    tensor, (n_chunks, 3) int64 rows (tensor, start, count), built on the host and copied
    once. A table is for the arrays it was built from: build it once, step many times."""

    def __init__(self, dev: Device, params: Sequence[Any], grads: Sequence[Any],
                 ms: Sequence[Any], vs: Sequence[Any], chunk: int = 4096) -> None:
        if chunk < 1:
            raise ValueError(f"adamw_multi_tensor: chunk={chunk} must be >= 1.")
        rows = []
        for i, group in enumerate(zip(params, grads, ms, vs)):
            for a, name in zip(group, "pgmv"):
                rows_of(a, f"adamw_multi_tensor ({name} of tensor {i})")
                if a.size != group[0].size:
                    raise ValueError(f"adamw_multi_tensor: tensor {i}: {name} has {a.size} "
                                     f"elements, the parameter {group[0].size}.")
            rows += [(i, s, min(chunk, group[0].size - s))
                     for s in range(0, group[0].size, chunk)]
        self.n_chunks, self.chunk = len(rows), chunk
        self.tables = [dev.asarray(np.array([dev.address(a) for a in arrays], np.uint64))
                       for arrays in (params, grads, ms, vs)]
        self.chunks = dev.asarray(np.array(rows, np.int64).reshape(-1, 3))


def adamw_multi_tensor(dev: Device, params: Sequence[Any], grads: Sequence[Any],
                       ms: Sequence[Any], vs: Sequence[Any], *, lr: float, b1: float,
                       b2: float, eps: float, wd: float, t: int, block: int = 256,
                       chunk: int = 4096, blocks: int | None = None,
                       table: ChunkTable | None = None) -> None:
    """One AdamW step on every tensor, in place, in one launch over a table of chunks
    (`table`, built here when not given: pass one to step the same tensors again)."""
    if t < 1:
        raise ValueError(f"adamw_multi_tensor: step t={t} must be >= 1.")
    check_block(block, "adamw_multi_tensor", warp_multiple=False)
    table = table or ChunkTable(dev, params, grads, ms, vs, chunk)
    if not table.n_chunks:
        return
    dev.launch("adamw.cu", "adamw_multi_tensor", blocks or grid_for(table.n_chunks), block,
               (*table.tables, table.chunks, table.n_chunks, lr, b1, b2, eps, wd,
                1.0 - b1 ** t, 1.0 - b2 ** t))


def flash_attention_forward(dev: Device, q: Any, k: Any, v: Any, *, causal: bool = True,
                            scale: float | None = None, block: int = 64) -> tuple[Any, Any]:
    """o = softmax(scale q k^T + mask) v and lse for heads (..., T, D); one launch."""
    T, D = q.shape[-2], q.shape[-1]
    rows_of(q, "flash_attention_forward")
    if k.shape != q.shape or v.shape != q.shape or not 0 < D <= FA_MAX_D:
        raise ValueError(f"flash_attention_forward: q {q.shape}, k {k.shape}, v {v.shape} "
                         f"must share one shape (..., T, D) with D <= {FA_MAX_D} (the kernel "
                         "keeps a row of q and of o in registers).")
    check_block(block, "flash_attention_forward", warp_multiple=False, most=FA_MAX_BLOCK)
    BH = q.size // (T * D) if T else 0
    if BH > MAX_GRID_Y:
        raise ValueError(f"flash_attention_forward: {BH} heads (B x H) exceed the grid's y "
                         f"limit of {MAX_GRID_Y} (one block row per head); split the batch.")
    o, lse = dev.empty(q.shape), dev.empty(q.shape[:-1])
    scale = D ** -0.5 if scale is None else scale
    grid = (grid_for(T, block, cap=2**31 - 1), max(BH, 1))      # (query blocks, heads)
    dev.launch("flash_attention.cu", "flash_attention_forward", grid, block,
               (q, k, v, o, lse, T, D, scale, int(causal)))
    return o, lse


def _scores(x: Any, op: str) -> tuple[int, int]:
    R, T = rows_of(x, op)
    if x.ndim < 2 or x.shape[-2] != T:
        raise ValueError(f"{op}: scores must be (..., T, T) (row r's query position is "
                         f"r % T); got {x.shape}.")
    return R, T
