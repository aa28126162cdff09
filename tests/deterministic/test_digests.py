"""The deterministic mode's results, pinned: the sha256 of every single-process reference run
that the deterministic tests compare layouts with (their losses, gradient norms and
parameters), recorded before the mode moved out of autograd/ and nn/ into its own package.

Every layout is tested == its reference (tests/parallel/test_deterministic*.py), so equal
references mean equal layouts: together the two pin every deterministic layout's bits.
A restructuring of the mode must leave this table unchanged; a change to what the mode
computes must say so in its commit and re-record the table:

    python -m tests.deterministic.test_digests        # prints the table for this machine

The bits depend on the BLAS kernels and NumPy's SIMD loops, which depend on the CPU: the
table is keyed by them, and on a machine with other kernels the test is skipped, naming
both keys (record a table for it with the command above). A machine with newer kernels can
record an older key's table too, by asking OpenBLAS and NumPy for the older kernels: the
Haswell table was re-recorded on an AVX-512 machine (SkylakeX) with

    OPENBLAS_CORETYPE=Haswell NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR" \
        python -m tests.deterministic.test_digests

after that command had first reproduced every digest recorded on a Haswell machine.
Re-recorded: the three token-tile runs, when a tree over token runs began to order the
runs from both ends inwards (deterministic/matmul.py, fold).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os

import numpy as np
import pytest

from minidist.baseline import train_single_process
from minidist.data import DataConfig
from minidist.nn import GPTConfig

DATA = DataConfig("sort", length=4)
STEPS, LR, CLIP = 3, 1e-2, 0.5


def _model(dtype: str, **changes) -> GPTConfig:
    base = dict(vocab_size=11, block_size=9, n_layer=4, n_head=4, n_embd=16, dropout=0.1,
                dtype=dtype)
    return GPTConfig(**{**base, **changes})


_MOE = dict(n_layer=2, moe_every=1, n_experts=4, moe_group_size=8)

# name: (model, global batch, grain, token_tiles): the references of the deterministic tests.
RUNS: dict[str, tuple[GPTConfig, int, int, int | None]] = {
    "2 layers, 2 heads, float64": (_model("float64", n_layer=2, n_head=2), 12, 1, None),
    "2 layers, 2 heads, float32": (_model("float32", n_layer=2, n_head=2), 12, 1, None),
    "4 layers, 2 heads, float64": (_model("float64", n_head=2), 12, 1, None),
    "4 layers, 2 heads, float32, grain 3": (_model("float32", n_head=2), 12, 3, None),
    "4 layers, 4 heads, float64": (_model("float64"), 12, 1, None),
    "4 layers, 4 heads, float32": (_model("float32"), 12, 1, None),
    "4 layers, 4 heads, float64, batch 10": (_model("float64"), 10, 1, None),
    "4 layers, 4 heads, float64, grain 3": (_model("float64"), 12, 3, None),
    "full recomputation, float32": (_model("float32", recompute="full"), 12, 1, None),
    "MoE, float64": (_model("float64", **_MOE), 12, 1, None),
    "MoE, float32": (_model("float32", **_MOE), 12, 1, None),
    "MoE every 2nd of 4 layers, float32": (_model("float32", **{**_MOE, "n_layer": 4,
                                                                  "moe_every": 2}), 12, 1, None),
    "token tiles 8, float64": (_model("float64"), 12, 1, 8),
    "token tiles 8, float32": (_model("float32"), 12, 1, 8),
    "token tiles 4, float64": (_model("float64"), 12, 1, 4),
}

# machine key -> {run name: sha256}
RECORDED: dict[str, dict[str, str]] = {
    'numpy 2.4.6 simd X86_V3 scipy-openblas 0.3.31.188.0 core Haswell': {
        '2 layers, 2 heads, float64':
            'd89a81c1ff2752850204bfcc15173fd010ecb65b918c81aff3611204044161ae',
        '2 layers, 2 heads, float32':
            '3c85a2ec2dacbfef9ed335a447bacdc62e00428dd14151316407f5b3d246308b',
        '4 layers, 2 heads, float64':
            '41d8bb4faaf1da0a3c20849ae6e77715ca3af9325d73482a1a97d22a68a24c1e',
        '4 layers, 2 heads, float32, grain 3':
            '9f8859ec30e44e29507a8d7a9e569b713c8542059ec79bebd4ff604d890290ae',
        '4 layers, 4 heads, float64':
            '2305d21abf071213a25d1c87a86a6d572d9eac64bb2541fdd37b344d3a0f0cb8',
        '4 layers, 4 heads, float32':
            '173db5857dfbf770e271f2da3d191db783374d1b55af6797eea6e46dae4845c6',
        '4 layers, 4 heads, float64, batch 10':
            'd36ca5b96105613281e88ab4201ad8e9b82308161cd3c6916c353ad4f23453d9',
        '4 layers, 4 heads, float64, grain 3':
            'ec862a655e6f41efe3d1efba7f4f8138d68816db48d4231a545bc35a83d0b89d',
        'full recomputation, float32':
            '173db5857dfbf770e271f2da3d191db783374d1b55af6797eea6e46dae4845c6',
        'MoE, float64':
            'd05fb8a63119e282e9a5803f28d5c611cd7354682bad189b2a9b6dad2991dc18',
        'MoE, float32':
            '2a00ec1d91b55da1ee86e5e5a591686a01ac98b8065e9068ac64faaf6a7c4c4a',
        'MoE every 2nd of 4 layers, float32':
            'cf811ab22c825bff7d80100d7c4b178be086ee443bc8d845f0402e234431b6fb',
        'token tiles 8, float64':
            '881815cf112c76ed699d81a84d4dda4ed27b9e89a625c4548ce2cd4377ea9d90',
        'token tiles 8, float32':
            '31959b2756a3f97a8a27428b6716540864077f83e281008c37f6a9807002e419',
        'token tiles 4, float64':
            'b2f7e18257d18eab58b4acb29d2c3b4a07ccf43e702be24d4afe6d3e1f797578',
    },
    'numpy 2.4.6 simd X86_V3+X86_V4+AVX512_ICL scipy-openblas 0.3.31.188.0 core SkylakeX': {
        '2 layers, 2 heads, float64':
            '78a28d1b2ad54e9328073185efd93fc4bfe430b8a94a587cfe84350283629508',
        '2 layers, 2 heads, float32':
            '0ffc6d8ec81cc5ec9cb6590bb81ce6568e630fa3a95654772970c2a44a2a7dc8',
        '4 layers, 2 heads, float64':
            '9dc142098e34456911d92d77e27bf8a33b41d7de10b169abf1b1afeec3a950e3',
        '4 layers, 2 heads, float32, grain 3':
            '51b6a9875c56e609163f084bb5e9f4955e31e09fa62e7145000d7dca4f423444',
        '4 layers, 4 heads, float64':
            '9377a70171e13f7e8fd5db9eff3f43a61928f4c901f62dced1d07cb180243217',
        '4 layers, 4 heads, float32':
            '9391c4b746bce54d97f38a8efec546927b4e687313268a607382ccf5ae90a11d',
        '4 layers, 4 heads, float64, batch 10':
            '7a99ac065b666d15e3027583f11083338e124b2e435d47181d0d75eef59d4129',
        '4 layers, 4 heads, float64, grain 3':
            'fb18c8719c62930465309a3ecb442117112f3150cac4f84867183c3aed577dbd',
        'full recomputation, float32':
            '9391c4b746bce54d97f38a8efec546927b4e687313268a607382ccf5ae90a11d',
        'MoE, float64':
            '5a170244d2a861509f76df20d58f9941c3d59887b5f5ba35df0c63fb558f13e9',
        'MoE, float32':
            '6b3ace860de9ef655ddcb3bff4383aac86b60c1f19452ca6ada6a3e7fcb08cb0',
        'MoE every 2nd of 4 layers, float32':
            'ddb16a0dbd47ce64bf8d15dd672fbfbb10a04ec21a4606533c73f3a0ed3f76e6',
        'token tiles 8, float64':
            '3e67662a0f88ab564080ff046b59a1ce3630d0d63559b7fa547ddff8cd085a54',
        'token tiles 8, float32':
            'd245ca76026f84b08a35db180939c2596b03cb2301c7f38c7cfb72f6796a8d7d',
        'token tiles 4, float64':
            'e9a514fd41c661eb3d431b5d6a7e8b1c0a89215b0b903d3dbed7a16ee273fcbd',
    },
}


def machine_key() -> str:
    """What the bits depend on: NumPy's version and SIMD targets in use, the BLAS and the
    kernel set it chose for this CPU."""
    from numpy._core import _multiarray_umath as umath
    simd = [t for t in umath.__cpu_dispatch__ if umath.__cpu_features__.get(t)]
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    return (f"numpy {np.__version__} simd {'+'.join(simd) or 'baseline'} "
            f"{blas.get('name')} {blas.get('version')} core {_openblas_core()}")


def _openblas_core() -> str:
    """The kernel set OpenBLAS picked at run time (DYNAMIC_ARCH builds), or '?'."""
    libs = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*")
    for path in glob.glob(libs):
        lib = ctypes.CDLL(path)
        for symbol in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename",
                       "openblas_get_corename64_", "openblas_get_corename"):
            if hasattr(lib, symbol):
                getter = getattr(lib, symbol)
                getter.restype = ctypes.c_char_p
                return getter().decode()
    return "?"


def digest(name: str) -> str:
    """sha256 of the run's losses, gradient norms and parameters (by name, raw bytes)."""
    cfg, batch, grain, token_tiles = RUNS[name]
    run = train_single_process(cfg, DATA, steps=STEPS, global_batch=batch, lr=LR,
                               clip_grad=CLIP, deterministic=True, grain=grain,
                               token_tiles=token_tiles)
    h = hashlib.sha256()
    h.update(np.asarray(run.losses, np.float64).tobytes())
    h.update(np.asarray(run.grad_norms, np.float64).tobytes())
    for key in sorted(run.params):
        h.update(key.encode())
        h.update(np.ascontiguousarray(run.params[key]).tobytes())
    return h.hexdigest()


# default: the cheapest reference of each family, dp/ZeRO (2 layers), tp/SP/pp (4 layers,
# 4 heads) and ep (MoE); the others (token tiles among them) run under -m slow
DEFAULT = {"2 layers, 2 heads, float64", "4 layers, 4 heads, float64, grain 3", "MoE, float32"}


@pytest.mark.parametrize("name", [name if name in DEFAULT else
                                  pytest.param(name, marks=pytest.mark.slow) for name in RUNS])
def test_the_deterministic_references_keep_their_recorded_bits(name):
    key = machine_key()
    if key not in RECORDED:
        pytest.skip(f"digests recorded for {sorted(RECORDED)}; this machine is '{key}' "
                    "(record its table: python -m tests.deterministic.test_digests)")
    assert digest(name) == RECORDED[key][name], \
        f"{name}: the deterministic mode's bits changed on '{key}'"


if __name__ == "__main__":
    print(f"    {machine_key()!r}: {{")
    for run_name in RUNS:
        print(f"        {run_name!r}:\n            {digest(run_name)!r},")
    print("    },")
