"""FLOPs and compulsory bytes of each op of the GPT, as one fused kernel or as unfused passes.

An op is written down twice, as lists of kernels (name, matmul FLOPs, other FLOPs, bytes
read, bytes written):
    fused    what one kernel (or the few of a two-stage reduction) must move: every input
             read once, every output written once, intermediates kept on chip. These are
             the COMPULSORY bytes: no implementation of the op can move fewer.
    unfused  one kernel per NumPy pass of the op's twin (autograd/fused.py, nn/attention.py,
             optim/adamw.py), in the order the twin runs them; each pass reads its inputs
             from memory and writes its result back.
The ratio of the two byte counts is what fusion can save (LayerNorm forward 6x, bias + GELU
13x, AdamW 32/7 = 4.6x), the ratio of the kernel counts what it saves in launches.
The ops of a Llama block that minidist's GPT does not have (RMSNorm, rotary positions,
SwiGLU, grouped-query attention; hardware/architecture.py) have no twin in nn/: their
unfused passes are those of the plain NumPy expression each docstring writes out.

One op's view (how each function below is written):
    1. walk the twin's code line by line: each NumPy expression is one unfused kernel, its
       inputs (a row vector of R or C elements counts as `extra`) and its output;
    2. the fused kernel reads the op's inputs and writes its outputs (and what its own
       backward needs: LayerNorm's mean and 1/std, attention's row log-sum-exp);
    3. FLOPs follow observe/op_flops.py: 2 per multiply-add (matmul); every other pass one
       per element, a reduction of C numbers C - 1 (a mean C); a fused kernel does its
       twin's arithmetic plus what it recomputes instead of reading.
The tests check the unfused FLOPs against op_flops.py's rules, and hand counts.

Shapes: R rows of width C (R = B*T); attention (B, H, T, D) with n = B*H*T*T scores;
s = bytes per element of the precision; token ids and targets are 4-byte integers.
No communication: a rank's ops on its own shards are these formulas at smaller shapes.

References: Dao et al. 2022, "FlashAttention", arXiv:2205.14135, Alg. 1 (the forward reads
    q, k, v once) and App. B (the backward, Alg. 4); Loshchilov & Hutter 2019,
    arXiv:1711.05101, Alg. 2 (AdamW).
Read next: hardware/roofline.py (these kernels under a machine's roofs).
"""

from __future__ import annotations

from dataclasses import dataclass

INDEX_BYTES = 4                                                  # int32 token ids, targets


@dataclass(frozen=True)
class Kernel:
    """One launch: its FLOPs and the bytes it reads and writes (each array once)."""

    name: str
    matmul: int = 0          # FLOPs on the matmul units: 2 per multiply-add
    other: int = 0           # every other FLOP
    read: int = 0            # bytes
    written: int = 0         # bytes

    @property
    def flops(self) -> int:
        return self.matmul + self.other

    @property
    def bytes(self) -> int:
        return self.read + self.written


Kernels = tuple[Kernel, ...]


def _pass(name: str, n: int, s: int, inputs: int = 1, extra: int = 0,
          flops: int | None = None, out: int | None = None) -> Kernel:
    """An elementwise pass over n elements: reads `inputs` arrays of n (+ `extra` more
    elements), writes `out` elements (default n), `flops` FLOPs (default n)."""
    return Kernel(name, 0, n if flops is None else flops, s * (inputs * n + extra),
                  s * (n if out is None else out))


def _rows(name: str, n: int, R: int, s: int, mean: bool = False) -> Kernel:
    """A row reduction (sum, max) of n elements to R: n - R FLOPs; a mean also divides
    each of the R results: n FLOPs."""
    return _pass(name, n, s, flops=n if mean else n - R, out=R)


def gemm(M: int, K: int, N: int, s: int, bias: bool = False) -> tuple[Kernels, Kernels]:
    """y (M, N) = x (M, K) @ W (K, N) [+ b]: (fused, unfused). Fused adds b in the GEMM's
    epilogue; unfused runs the GEMM, then a bias pass."""
    mm = Kernel("gemm", 2 * M * K * N, 0, s * (M * K + K * N), s * M * N)
    if not bias:
        return (mm,), (mm,)
    fused = Kernel("gemm + bias", mm.matmul, M * N, mm.read + s * N, mm.written)
    return (fused,), (mm, _pass("+ bias", M * N, s, extra=N))


def gemm_backward(M: int, K: int, N: int, s: int, bias: bool = False
                  ) -> tuple[Kernels, Kernels]:
    """dx = g W^T (M, K), dW = x^T g (K, N), db = sum_rows g (N,): fused sums db inside
    dW's GEMM (it reads g anyway), unfused in a reduction of its own."""
    dx = Kernel("dx = g W^T", 2 * M * N * K, 0, s * (M * N + K * N), s * M * K)
    dw = Kernel("dW = x^T g", 2 * M * K * N, 0, s * (M * K + M * N), s * K * N)
    if not bias:
        return (dx, dw), (dx, dw)
    db = _rows("sum g: db", M * N, N, s)
    fused = Kernel("dW = x^T g, db", dw.matmul, db.other, dw.read, dw.written + s * N)
    return (dx, fused), (dx, dw, db)


def layernorm(R: int, C: int, s: int, bias: bool = True,
              centered: bool = True) -> tuple[Kernels, Kernels]:
    """y = (x - mu) r w + b over rows of C (autograd/fused.LayerNorm.forward's passes).
    centered=False is RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), y = x r w with
    r = 1 / sqrt(mean(x^2) + eps): the same passes without the two that centre x (nn/
    builds no RMSNorm; these are the passes of that expression). The fused kernel also
    writes what its backward needs: mu (LayerNorm) and r, R each."""
    n = R * C
    centre = [_rows("mean", n, R, s, mean=True), _pass("x - mu", n, s, extra=R)]
    unfused = (centre if centered else []) + [
        _pass("xc * xc" if centered else "x * x", n, s),
        _rows("mean: var" if centered else "mean: ms", n, R, s, mean=True),
        _pass("+ eps", R, s), _pass("sqrt", R, s), _pass("1 / .", R, s),
        _pass("xhat = xc * r" if centered else "xhat = x * r", n, s, extra=R),
        _pass("* w", n, s, extra=C)]
    if bias:
        unfused.append(_pass("+ b", n, s, extra=C))
    flops = sum(k.other for k in unfused)
    vectors = (1 + bias) * C
    return ((Kernel("layernorm" if centered else "rmsnorm", 0, flops, s * (n + vectors),
                    s * (n + (1 + centered) * R)),), tuple(unfused))


def layernorm_backward(R: int, C: int, s: int, bias: bool = True,
                       centered: bool = True) -> tuple[Kernels, Kernels]:
    """dx, dw (and db) of layernorm (LayerNorm.backward's passes, given xhat and r;
    centered=False: RMSNorm's, dx = r (dxhat - xhat mean(dxhat xhat)), without the
    subtraction of mean(dxhat)). Fused: one kernel rebuilds xhat = (x - mu) r (2 FLOPs an
    element; RMSNorm x r, 1), writes dx and per-block partial sums of dw, db; a second
    adds the partials (their few KB are left out of the bytes): the two-stage reduction."""
    n = R * C
    centre = [_rows("mean", n, R, s, mean=True), _pass("dx = dxhat - mean", n, s, extra=R)]
    unfused = [_pass("dxhat = g * w", n, s, extra=C)] + (centre if centered else []) + [
        _pass("dxhat * xhat", n, s, 2),
        _rows("mean", n, R, s, mean=True), _pass("xhat * mean", n, s, extra=R),
        _pass("dx -= .", n, s, 2), _pass("dx *= r", n, s, extra=R),
        _pass("g * xhat", n, s, 2), _rows("sum: dw", n, C, s)]
    if bias:
        unfused.append(_rows("sum: db", n, C, s))
    vectors = (1 + bias) * C
    first = Kernel(f"{'layernorm' if centered else 'rmsnorm'} backward", 0,
                   sum(k.other for k in unfused) + (1 + centered) * n,
                   s * (2 * n + C + (1 + centered) * R), s * (n + vectors))
    return (first, Kernel("dw, db: add the block partials")), tuple(unfused)


def softmax(R: int, C: int, s: int) -> tuple[Kernels, Kernels]:
    """y = exp(x - max) / sum over rows of C (autograd/fused.Softmax.forward's passes)."""
    n = R * C
    unfused = (_rows("max", n, R, s), _pass("x - max", n, s, extra=R), _pass("exp", n, s),
               _rows("sum", n, R, s), _pass("/ sum", n, s, extra=R))
    return (Kernel("softmax", 0, 5 * n - 2 * R, s * n, s * n),), unfused


def softmax_backward(R: int, C: int, s: int) -> tuple[Kernels, Kernels]:
    """dx = y * (g - sum_j g_j y_j) (Softmax.backward's passes)."""
    n = R * C
    unfused = (_pass("g * y", n, s, 2), _rows("sum", n, R, s),
               _pass("y * sum", n, s, extra=R), _pass("-", n, s, 2))
    return (Kernel("softmax backward", 0, 4 * n - R, 2 * s * n, s * n),), unfused


def scaled_masked_softmax(R: int, T: int, s: int) -> tuple[Kernels, Kernels]:
    """y = softmax(scale x + causal mask) over R rows of T scores: nn/attention.py's scale
    and mask passes (the mask, 0 or -inf (T, T), is added), then Softmax's; fused, one
    kernel (gpu/kernels/softmax.cu), which masks by comparing positions: no add."""
    n = R * T
    unfused = (_pass("* scale", n, s), Kernel("+ mask", 0, n, s * (n + T * T), s * n),
               *softmax(R, T, s)[1])
    return (Kernel("scaled causal softmax", 0, 6 * n - 2 * R, s * n, s * n),), unfused


def scaled_masked_softmax_backward(R: int, T: int, s: int) -> tuple[Kernels, Kernels]:
    """dx = scale y (g - rowsum(g y)): Softmax's backward, then the scale's (the added mask
    passes the gradient through untouched: no pass)."""
    n = R * T
    unfused = (*softmax_backward(R, T, s)[1], _pass("* scale", n, s))
    return (Kernel("scaled causal softmax backward", 0, 5 * n - R, 2 * s * n, s * n),), unfused


def attention(B: int, H: int, T: int, D: int, s: int,
              kv_heads: int | None = None) -> tuple[Kernels, Kernels]:
    """Causal y = softmax(q k^T / sqrt(D) + mask) v, q k v (B, H, T, D) (nn/attention.py's
    passes). Fused: FlashAttention's one kernel reads q, k, v once and writes y and the row
    log-sum-exp L for its backward; the n scores never reach memory. Both count the whole
    T x T square, as the twin computes it (a kernel skipping masked tiles does ~half).
    kv_heads G: grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245), k and v
    (B, G, T, D), each shared by H / G query heads: the FLOPs of H heads, the k and v bytes
    of G (default G = H)."""
    G = H if kv_heads is None else kv_heads
    n, r, a, kv = B * H * T * T, B * H * T, B * H * T * D, B * G * T * D
    sm_fused, sm = scaled_masked_softmax(r, T, s)
    unfused = (Kernel("S = q k^T", 2 * n * D, 0, s * (a + kv), s * n), *sm,
               Kernel("y = P v", 2 * n * D, 0, s * (n + kv), s * a))
    flash = Kernel("flash attention", 4 * n * D, sm_fused[0].other, s * (a + 2 * kv),
                   s * (a + r))
    return (flash,), unfused


def attention_backward(B: int, H: int, T: int, D: int, s: int,
                       kv_heads: int | None = None) -> tuple[Kernels, Kernels]:
    """dq, dk, dv of attention. Unfused: the twin's backward (two GEMMs per product, the
    softmax backward, mask and scale). Fused: FlashAttention's backward reads q, k, v, y,
    dy and L, rebuilds P tile by tile (5 GEMMs instead of 4) and writes dq, dk, dv.
    kv_heads G: dk and dv (B, G, T, D), each summed over its group's query heads."""
    G = H if kv_heads is None else kv_heads
    n, r, a, kv = B * H * T * T, B * H * T, B * H * T * D, B * G * T * D
    unfused = (Kernel("dP = dy v^T", 2 * n * D, 0, s * (a + kv), s * n),
               Kernel("dv = P^T dy", 2 * n * D, 0, s * (n + a), s * kv),
               *scaled_masked_softmax_backward(r, T, s)[1],
               Kernel("dq = dS k", 2 * n * D, 0, s * (n + kv), s * a),
               Kernel("dk = dS^T q", 2 * n * D, 0, s * (n + a), s * kv))
    # P = exp(S / sqrt(D) - L): 3n; rowsum(dy * y): 2a; dS = P (dP - rowsum) / sqrt(D): 3n
    flash = Kernel("flash attention backward", 10 * n * D, 6 * n + 2 * a,
                   s * (3 * a + 2 * kv + r), s * (a + 2 * kv))
    return (flash,), unfused


def rotary(B: int, T: int, heads: int, D: int, s: int) -> tuple[Kernels, Kernels]:
    """Rotary positions (Su et al. 2021, RoFormer, arXiv:2104.09864, Eq. 34) on x (B, T,
    heads, D), the query and key heads together: y = x cos + rotate_half(x) sin, cos and sin
    (T, D) tables. Its backward is the rotation by minus the angle, the same passes, so
    this one pair serves both directions. Unfused: x * cos, the half rotation (a copy that
    negates half), * sin, the add; fused: one kernel reads x and both tables, writes y."""
    n, table = B * T * heads * D, T * D
    unfused = (_pass("x * cos", n, s, extra=table), _pass("rotate_half", n, s, flops=n // 2),
               _pass("* sin", n, s, extra=table), _pass("+", n, s, 2))
    return (Kernel("rotary", 0, sum(k.other for k in unfused), s * (n + 2 * table), s * n),
            ), unfused


_SWIGLU_FORWARD = (("-g", 1), ("exp", 1), ("+ 1", 1), ("silu = g / .", 2), ("* u", 2))
_SWIGLU_BACKWARD = (("-g", 1), ("exp", 1), ("+ 1", 1), ("sig = 1 / .", 1),
                    ("silu = g * sig", 2), ("du = dy * silu", 2), ("1 - sig", 1),
                    ("g * .", 2), ("+ 1", 1), ("sig * .", 2), ("dy * u", 2), ("dg = . * .", 2))


def swiglu(R: int, F: int, s: int) -> tuple[Kernels, Kernels]:
    """y = silu(g) * u, g and u (R, F) the gate and up projections' outputs (Shazeer 2020,
    "GLU Variants Improve Transformer", arXiv:2002.05202, Eq. 6, Swish with beta = 1), silu(g)
    = g / (1 + exp(-g)). nn/ has no twin: the unfused passes are those of this expression
    in NumPy (_SWIGLU_FORWARD). Fused: one kernel reads g and u and writes y."""
    n = R * F
    unfused = tuple(_pass(name, n, s, k) for name, k in _SWIGLU_FORWARD)
    return (Kernel("swiglu", 0, sum(k.other for k in unfused), 2 * s * n, s * n),), unfused


def swiglu_backward(R: int, F: int, s: int) -> tuple[Kernels, Kernels]:
    """du = dy silu(g), dg = dy u silu'(g), silu'(g) = sig (1 + g (1 - sig)), sig = 1 / (1 +
    exp(-g)) (_SWIGLU_BACKWARD's passes). Fused: one kernel reads g, u and dy, rebuilds sig
    and writes dg and du."""
    n = R * F
    unfused = tuple(_pass(name, n, s, k) for name, k in _SWIGLU_BACKWARD)
    return (Kernel("swiglu backward", 0, sum(k.other for k in unfused), 3 * s * n,
                   2 * s * n),), unfused


_GELU_FORWARD = ("x * x", "* c3", "+ c1", "* x", "exp", "+ 1", "-2 / .", "+ 1", "t + 1",
                 "* 0.5", "* x")
_GELU_BACKWARD = ("x * x", "* 3 c3", "+ 1", "* c1 / 2", "* x", "t * t", "1 - .", "d *= .",
                  "0.5 * t", "d += .", "+ 0.5", "* g")
_TWO_INPUTS = {"* x", "d *= .", "d += .", "* g"}


def _gelu_passes(names: tuple[str, ...], n: int, s: int) -> list[Kernel]:
    return [_pass(p, n, s, 2 if p in _TWO_INPUTS else 1) for p in names]


def bias_gelu(R: int, F: int, s: int, bias: bool = True) -> tuple[Kernels, Kernels]:
    """y = GELU_tanh(h + b), h (R, F) (the bias of mlp.fc, then autograd/fused.Gelu's 11
    passes; the twin keeps t = tanh(u) for its backward)."""
    n = R * F
    unfused = ([_pass("+ b", n, s, extra=F)] if bias else []) + _gelu_passes(_GELU_FORWARD, n, s)
    fused = Kernel("bias + gelu" if bias else "gelu", 0, sum(k.other for k in unfused),
                   s * (n + bias * F), s * n)
    return (fused,), tuple(unfused)


def bias_gelu_backward(R: int, F: int, s: int, bias: bool = True) -> tuple[Kernels, Kernels]:
    """dh = g GELU'(h + b) and db = sum_rows dh (Gelu.backward's 12 passes, then the sum).
    Fused: one kernel reads h, b, g, recomputes t (the forward's first 8 passes, 9 with the
    bias), writes dh and per-block partial sums of db; with a bias, a second adds the
    partials (their few KB left out of the bytes), as gpu/kernels/bias_gelu.cu does."""
    n = R * F
    unfused = _gelu_passes(_GELU_BACKWARD, n, s) + ([_rows("sum: db", n, F, s)] if bias else [])
    recompute = (8 + bias) * n
    fused = Kernel("bias + gelu backward" if bias else "gelu backward", 0,
                   sum(k.other for k in unfused) + recompute, s * (2 * n + bias * F),
                   s * (n + bias * F))
    second = (Kernel("db: add the block partials"),) if bias else ()
    return (fused, *second), tuple(unfused)


def cross_entropy(N: int, V: int, s: int) -> tuple[Kernels, Kernels]:
    """sum_n (log sum_v exp z_nv - z_{n, t_n}), z (N, V) (autograd/fused.CrossEntropy's
    forward passes, reduction "sum"; its bookkeeping on the N targets, keep, t_safe and w,
    left out; an ignored row's loss is set to 0, a masked store with no arithmetic). Fused: ONE kernel for forward and backward that writes the loss of each
    row and dz = softmax(z) - onehot(t) over z, in place."""
    NV = N * V
    unfused = (_rows("max", NV, N, s), _pass("z - max", NV, s, extra=N), _pass("exp", NV, s),
               _rows("sum", NV, N, s), _pass("p = . / sum", NV, s, extra=N),
               _pass("log sum", N, s), _pass("+ max", N, s, 2),
               Kernel("z[t]", 0, 0, INDEX_BYTES * N + s * N, s * N),
               _pass("- z[t]", N, s, 2), Kernel("ignored rows: loss = 0", 0, 0, N + s * N,
                                                 s * N), _rows("sum", N, 1, s))
    flops = sum(k.other for k in unfused + cross_entropy_backward(N, V, s)[1])
    fused = Kernel("cross-entropy, dz in place", 0, flops, s * NV + INDEX_BYTES * N,
                   s * (NV + N))
    return (fused,), unfused


def cross_entropy_backward(N: int, V: int, s: int) -> tuple[Kernels, Kernels]:
    """dz = w (p - onehot(t)) (CrossEntropy.backward's passes); fused: nothing left to do,
    the forward kernel wrote dz."""
    unfused = (_pass("w * g", N, s), _pass("dz = p * w", N * V, s, extra=N),
               Kernel("dz[t] -= w", 0, N, INDEX_BYTES * N + 2 * s * N, s * N))
    return (), unfused


def embedding(B: int, T: int, C: int, s: int, positions: bool = True
              ) -> tuple[Kernels, Kernels]:
    """h_0 = wte[idx] + wpe[0..T-1]: two row gathers and an add, or one kernel.
    positions=False (rotary positions, applied inside attention): the token gather alone."""
    n = B * T * C
    tokens = Kernel("wte[idx]", 0, 0, INDEX_BYTES * B * T + s * n, s * n)
    if not positions:
        return (tokens,), (tokens,)
    unfused = (tokens, Kernel("wpe[pos]", 0, 0, INDEX_BYTES * T + s * T * C, s * T * C),
               _pass("+", n, s, extra=T * C))
    fused = Kernel("wte[idx] + wpe", 0, n, INDEX_BYTES * B * T + s * (n + T * C), s * n)
    return (fused,), unfused


def embedding_backward(B: int, T: int, C: int, V: int, s: int, positions: bool = True
                       ) -> tuple[Kernels, Kernels]:
    """dwpe = sum over the batch of g (with positions); dwte += g scattered to the rows of
    idx (add.at). The same kernels fused or not."""
    n = B * T * C
    ks = ((_rows("sum over B: dwpe", n, T * C, s),) if positions else ()) + \
        (Kernel("dwte: add.at", 0, n, INDEX_BYTES * B * T + s * n, s * V * C),)
    return ks, ks


def residual(n: int, s: int) -> tuple[Kernels, Kernels]:
    """x + y (forward), or the sum of a tensor's two gradients (backward): one pass."""
    k = (_pass("x + y", n, s, 2),)
    return k, k


def grad_norm(sizes: list[int], s: int) -> tuple[Kernels, Kernels]:
    """sqrt(sum of g^2) over all gradients (optim/clip.global_grad_norm): one dot per
    array, or one multi-tensor kernel."""
    unfused = tuple(Kernel("dot(g, g)", 0, 2 * n - 1, s * n, s) for n in sizes)
    return (Kernel("multi-tensor norm", 0, sum(k.other for k in unfused), s * sum(sizes), s),
            ), unfused


_ADAMW = (("m *= b1", 1), ("(1 - b1) g", 1), ("m += .", 2), ("v *= b2", 1), ("g * g", 1),
          ("(1 - b2) .", 1), ("v += .", 2), ("v / (1 - b2^t)", 1), ("sqrt", 1), ("+ eps", 1),
          ("m / (1 - b1^t)", 1), ("/ denom", 2))
_ADAMW_WD = (("wd * p", 1), ("+= .", 2))
_ADAMW_END = (("* lr", 1), ("p -= .", 2))


def adamw(sizes: list[int], s: int, weight_decay: float = 0.0) -> tuple[Kernels, Kernels]:
    """One AdamW step over arrays of these sizes (optim/adamw.adamw_step's 14 passes, 16
    with weight decay, per array). Fused: one multi-tensor kernel reads p, g, m, v and
    writes p, m, v: 7 elements of traffic per parameter instead of 32 (37 with decay)."""
    passes = _ADAMW + (_ADAMW_WD if weight_decay else ()) + _ADAMW_END
    unfused = tuple(_pass(name, n, s, k) for n in sizes for name, k in passes)
    N = sum(sizes)
    return (Kernel("multi-tensor adamw", 0, len(passes) * N, 4 * s * N, 3 * s * N),), unfused
