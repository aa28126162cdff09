"""Every kernel against its float64 twin: the checks, runnable on any Device.

A case builds float32 inputs from a seed, runs the fused op (gpu/fused.py) and its
unfused sequence (gpu/unfused.py) on a Device, computes the twin (gpu/twins.py) in float64,
and returns one Check per output compared: fused vs twin, unfused vs twin, fused vs
unfused. The same cases run on the CPU emulator (tests/gpu/test_emulated_kernels.py, also
under ThreadSanitizer and AddressSanitizer) and on a GPU through CupyDevice.

Error measure: rel_error(got, want) = max |got - want| / max |want|, the largest error
relative to the output's scale (an elementwise ratio would blow up on entries that are
zero, such as a masked probability). Tolerances (issue 12): 1e-5 for elementwise ops,
norms, softmax, cross-entropy and AdamW; 1e-4 for attention, whose dot products sum D
float32 products and whose softmax sums T of them.

Shapes: each case has three, one small, two not multiples of any block size, and two
block sizes. Grids: one block per row when N <= 8, else 3 blocks, so the kernels' grid-
stride loops give a block several rows.

One case's view (e.g. layernorm):
    1. draw x, w, b, dy from the seed (float32), copy them to the device
    2. run the fused forward and backward, the unfused ones; copy back to NumPy
    3. twin in float64; one Check per output and comparison
Read next: emulate/sanitize.py, tests/gpu/test_emulated_kernels.py
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from minidist.gpu import fused, twins, unfused

TOL, TOL_ATTENTION = 1e-5, 1e-4
F32 = np.float32


@dataclass(frozen=True)
class Check:
    """One comparison: what was compared, its relative error and the tolerance."""

    what: str
    error: float
    tol: float

    @property
    def ok(self) -> bool:
        return bool(self.error <= self.tol)        # a NaN error is never ok

    def __str__(self) -> str:
        verdict = "ok " if self.ok else "BAD"
        return f"{verdict} {self.what}: error {self.error:.2e} (tol {self.tol:g})"


def rel_error(got: Any, want: Any) -> float:
    """max |got - want| / max |want| (inf when the shapes differ)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    return float(np.abs(got - want).max(initial=0.0) / max(np.abs(want).max(initial=0.0), 1e-30))


def _grid(N: int) -> int | None:
    return None if N <= 8 else 3


def _compare(checks: list, label: str, got: dict, want: dict, tol: float, dev: Any) -> None:
    for name, value in got.items():
        checks.append(Check(f"{label} {name}", rel_error(dev.to_numpy(value), want[name]), tol))


def case_layernorm(dev: Any, rng: np.random.Generator, shape: tuple, block: int) -> list:
    N, C = shape
    x = (2.0 * rng.standard_normal((N, C)) + 0.5).astype(F32)
    w = (1 + 0.1 * rng.standard_normal(C)).astype(F32)
    b = (0.1 * rng.standard_normal(C)).astype(F32)
    dy = rng.standard_normal((N, C)).astype(F32)
    X, W, B, DY = (dev.asarray(a) for a in (x, w, b, dy))
    want_f, want_b = twins.layernorm_forward(x, w, b), twins.layernorm_backward(dy, x, w, b)
    y, mean, rstd = fused.layernorm_forward(dev, X, W, B, block=block, blocks=_grid(N))
    dx, dw, db = fused.layernorm_backward(dev, DY, X, W, mean, rstd, block=block,
                                          blocks=_grid(N))
    uy, umean, urstd, uxhat = unfused.layernorm_forward(dev, X, W, B, block=block)
    udx, udw, udb = unfused.layernorm_backward(dev, DY, uxhat, W, urstd, block=block)
    got_b, ugot_b = {"dx": dx, "dw": dw, "db": db}, {"dx": udx, "dw": udw, "db": udb}
    checks: list = []
    _compare(checks, "layernorm_forward fused", {"y": y, "mean": mean, "rstd": rstd}, want_f,
             TOL, dev)
    _compare(checks, "layernorm_backward fused", got_b, want_b, TOL, dev)
    _compare(checks, "layernorm_forward unfused", {"y": uy, "mean": umean, "rstd": urstd},
             want_f, TOL, dev)
    _compare(checks, "layernorm_backward unfused", ugot_b, want_b, TOL, dev)
    _compare(checks, "layernorm fused vs unfused", {"y": y, **got_b},
             {k: dev.to_numpy(v) for k, v in {"y": uy, **ugot_b}.items()}, TOL, dev)
    return checks


def case_bias_gelu(dev: Any, rng: np.random.Generator, shape: tuple, block: int) -> list:
    N, C = shape
    x, dy = (rng.standard_normal((N, C)).astype(F32) * 2 for _ in range(2))
    bias = rng.standard_normal(C).astype(F32)
    X, BIAS, DY = (dev.asarray(a) for a in (x, bias, dy))
    want_f, want_b = twins.bias_gelu_forward(x, bias), twins.bias_gelu_backward(dy, x, bias)
    y = fused.bias_gelu_forward(dev, X, BIAS, block=block, blocks=_grid(N))
    dx, dbias = fused.bias_gelu_backward(dev, DY, X, BIAS, block=block, row_groups=_grid(N))
    uy = unfused.bias_gelu_forward(dev, X, BIAS, block=block)
    udx, udbias = unfused.bias_gelu_backward(dev, DY, X, BIAS, block=block)
    checks: list = []
    _compare(checks, "bias_gelu_forward fused", {"y": y}, want_f, TOL, dev)
    _compare(checks, "bias_gelu_backward fused", {"dx": dx, "dbias": dbias}, want_b, TOL, dev)
    _compare(checks, "bias_gelu_forward unfused", {"y": uy}, want_f, TOL, dev)
    _compare(checks, "bias_gelu_backward unfused", {"dx": udx, "dbias": udbias}, want_b, TOL, dev)
    _compare(checks, "bias_gelu fused vs unfused", {"y": y, "dx": dx},
             {"y": dev.to_numpy(uy), "dx": dev.to_numpy(udx)}, TOL, dev)
    return checks


def case_softmax(dev: Any, rng: np.random.Generator, shape: tuple, block: int) -> list:
    BH, T = shape
    x, dy = (rng.standard_normal((BH, T, T)).astype(F32) * 3 for _ in range(2))
    scale = 0.35
    X, DY = dev.asarray(x), dev.asarray(dy)
    R = BH * T
    want_f = twins.softmax_forward(x.reshape(R, T), scale)
    want_b = twins.softmax_backward(dy.reshape(R, T), x.reshape(R, T), scale)
    y = fused.softmax_forward(dev, X, scale, block=block, blocks=_grid(R))
    dx = fused.softmax_backward(dev, DY, y, scale, block=block, blocks=_grid(R))
    uy = unfused.softmax_forward(dev, X, scale, block=block)
    udx = unfused.softmax_backward(dev, DY, uy, scale, block=block)
    flat = {k: dev.to_numpy(v).reshape(R, T) for k, v in (("y", y), ("dx", dx), ("uy", uy),
                                                         ("udx", udx))}
    checks: list = []
    _compare(checks, "softmax_forward fused", {"y": flat["y"]}, want_f, TOL, dev)
    _compare(checks, "softmax_backward fused", {"dx": flat["dx"]}, want_b, TOL, dev)
    _compare(checks, "softmax_forward unfused", {"y": flat["uy"]}, want_f, TOL, dev)
    _compare(checks, "softmax_backward unfused", {"dx": flat["udx"]}, want_b, TOL, dev)
    _compare(checks, "softmax fused vs unfused", {"y": flat["y"], "dx": flat["dx"]},
             {"y": flat["uy"], "dx": flat["udx"]}, TOL, dev)
    return checks


def case_cross_entropy(dev: Any, rng: np.random.Generator, shape: tuple, block: int) -> list:
    N, V = shape
    z = (3 * rng.standard_normal((N, V))).astype(F32)
    masked = min(2, V - 1)              # masked columns (-inf, as a padded vocabulary's) come
    z[:, :masked] = -np.inf             # first: the online max starts at -inf and must stay
    t = rng.integers(masked, V, N).astype(np.int32)                      # finite after them
    t[1::4] = -100                                          # some rows are ignored
    checks: list = []
    for reduction in ("mean", "sum"):
        want = twins.cross_entropy(z, t, reduction=reduction)
        logits, T = dev.asarray(z), dev.asarray(t)
        loss, losses = fused.cross_entropy(dev, logits, T, reduction=reduction, block=block,
                                           blocks=_grid(N))
        uloss, ulosses, udz = unfused.cross_entropy(dev, dev.asarray(z), T, reduction=reduction,
                                                    block=block)
        got = {"losses": losses, "loss": loss, "dlogits": logits}   # logits now hold dz
        _compare(checks, f"cross_entropy ({reduction}) fused", got, want, TOL, dev)
        _compare(checks, f"cross_entropy ({reduction}) unfused",
                 {"losses": ulosses, "loss": uloss, "dlogits": udz}, want, TOL, dev)
        _compare(checks, f"cross_entropy ({reduction}) fused vs unfused", {"dlogits": logits},
                 {"dlogits": dev.to_numpy(udz)}, TOL, dev)
    return checks


def case_adamw(dev: Any, rng: np.random.Generator, shape: tuple, block: int) -> list:
    hyper = dict(lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, t=3)
    ps = [rng.standard_normal(n).astype(F32) for n in shape]
    gs = [rng.standard_normal(n).astype(F32) for n in shape]
    ms = [0.1 * rng.standard_normal(n).astype(F32) for n in shape]
    vs = [0.01 * rng.random(n).astype(F32) for n in shape]
    want = twins.adamw(ps, gs, ms, vs, **hyper)
    runs = {}
    for name in ("fused", "unfused"):
        P, G, M, Vv = ([dev.asarray(a) for a in arrays] for arrays in (ps, gs, ms, vs))
        if name == "fused":          # a small chunk: tensors span several table rows
            fused.adamw_multi_tensor(dev, P, G, M, Vv, block=block, chunk=2 * block, **hyper)
        else:
            unfused.adamw(dev, P, G, M, Vv, block=block, **hyper)
        runs[name] = {"p": P, "m": M, "v": Vv}
    checks: list = []
    for key in ("p", "m", "v"):
        for i in range(len(shape)):
            got = {name: dev.to_numpy(runs[name][key][i]) for name in runs}
            checks.append(Check(f"adamw fused {key}[{i}]", rel_error(got["fused"], want[key][i]),
                                TOL))
            checks.append(Check(f"adamw unfused {key}[{i}]",
                                rel_error(got["unfused"], want[key][i]), TOL))
            checks.append(Check(f"adamw fused vs unfused {key}[{i}]",
                                rel_error(got["fused"], got["unfused"]), TOL))
    return checks


def case_flash_attention(dev: Any, rng: np.random.Generator, shape: tuple, block: int) -> list:
    q, k, v = (rng.standard_normal(shape).astype(F32) for _ in range(3))
    Q, K, V = (dev.asarray(a) for a in (q, k, v))
    checks: list = []
    for causal in (True, False):
        want = twins.attention(q, k, v, causal=causal)
        o, lse = fused.flash_attention_forward(dev, Q, K, V, causal=causal, block=block)
        uo = unfused.attention_forward(dev, Q, K, V, causal=causal, block=block)
        tiled = twins.flash_attention(q, k, v, causal=causal, block_q=block, block_k=32)
        label = "causal" if causal else "full"
        _compare(checks, f"flash_attention ({label}) fused", {"o": o, "lse": lse}, want,
                 TOL_ATTENTION, dev)
        _compare(checks, f"attention ({label}) unfused", {"o": uo}, want, TOL_ATTENTION, dev)
        _compare(checks, f"flash_attention ({label}) fused vs unfused", {"o": o},
                 {"o": dev.to_numpy(uo)}, TOL_ATTENTION, dev)
        checks.append(Check(f"flash_attention ({label}) NumPy tiles vs plain formula",
                            rel_error(tiled["o"], want["o"]), 1e-12))
    return checks


Case = Callable[[Any, np.random.Generator, tuple, int], list]
CASES: dict[str, tuple[Case, list[tuple], tuple[int, int]]] = {
    # name: (case, shapes, block sizes); shapes' last axes are not multiples of the blocks
    "layernorm": (case_layernorm, [(1, 32), (7, 100), (19, 300)], (64, 128)),
    "bias_gelu": (case_bias_gelu, [(1, 5), (7, 100), (19, 300)], (64, 128)),
    "softmax": (case_softmax, [(1, 1), (3, 13), (2, 70)], (32, 64)),
    "cross_entropy": (case_cross_entropy, [(1, 10), (9, 100), (17, 300)], (64, 128)),
    "adamw": (case_adamw, [(1,), (100, 37), (300, 5, 64)], (32, 64)),
    "flash_attention": (case_flash_attention, [(1, 1, 8), (2, 45, 16), (3, 70, 64)], (32, 64)),
}


def run_case(name: str, dev: Any, shape: tuple, block: int, seed: int = 0) -> list[Check]:
    """The Checks of case `name` at one shape and block size."""
    case = CASES[name][0]
    return case(dev, np.random.default_rng(seed), tuple(shape), block)


def run_all(dev: Any, which: str = "all") -> list[Check]:
    """Every case at every shape and block ("all"), or at its middle shape and first block
    ("one": what a sanitizer run or a quick GPU check needs)."""
    checks = []
    for name, (_, shapes, blocks) in CASES.items():
        for shape in (shapes if which == "all" else shapes[1:2]):
            for block in (blocks if which == "all" else blocks[:1]):
                checks += run_case(name, dev, shape, block)
    return checks
