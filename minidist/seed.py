"""Layout-independent initialisation: every number drawn from (seed, name), never from order.

A parallel run must start from exactly the numbers the single-process run starts from,
or no test could compare them. So no tensor is ever drawn from a shared, stateful RNG
whose output depends on how many tensors were drawn before it. Instead every random
tensor has a *name* (the parameter's full dotted name, e.g. "blocks.1.attn.qkv.weight",
or a stream name such as ("dropout", step, layer)) and its numbers come from a
generator seeded by a stable hash of (global seed, name). Two models built in a
different order, or on different ranks, therefore draw bitwise identical tensors.

A parameter is always drawn IN FULL and then sliced. A tensor-parallel rank that owns
columns [r*F_tp, (r+1)*F_tp) of W (C, F) draws the whole (C, F) and keeps its columns,
so its shard equals the matching slice of the single-process tensor bit for bit. The
cost (each rank draws the full tensor once at start-up) is negligible next to training.

One rank's view:
    1. build the model; every Parameter carries an `Init` spec (normal(std), zeros, ...)
       and, when it is a shard, the full shape and the index of its slice;
    2. `init_parameters(model, seed)` walks `named_parameters()`; for each name it draws
       the full tensor with `draw(init, full_shape, seed, name)` and copies in its slice;
    3. any other randomness is keyed by what it is for, never by when it is asked for:
       `stream(seed, *key)` gives a Generator (a shuffle, a parameter), and for many small
       independent draws (data samples, dropout masks) `counter_uniform` / `counter_integers`
       give element number c of the stream `key` without drawing elements 0..c-1 first.

Hash: BLAKE2b over the UTF-8 text of `repr((seed, *key))`, first 16 bytes as an integer,
fed to NumPy's SeedSequence and the PCG64 bit generator. Python's hash() is salted per
process, so it must never be used here.
Counter-based draws: element c of stream `key` is splitmix64(k + (c + 1) * gamma), with
k = the stream's 64-bit hash and gamma = 0x9E3779B97F4A7C15 (Steele et al. 2014). It is a
pure function of (seed, key, c), so a rank computes the elements of its rows directly,
vectorised, and gets exactly the numbers the single process computes for those rows.
Numerics: normal draws are made in float64 and rounded to the parameter dtype, so a
float32 model starts from the float64 model's numbers rounded once.

References: Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3", SC'11
    (counter-based generation: the idea behind keying every stream by what it is for);
    Steele, Lea & Flood 2014, "Fast splittable pseudorandom number generators", OOPSLA
    (splitmix64);
    GPT-2 initialisation (normal, std 0.02) as in Radford et al. 2019.
Read next: data.py (batches addressed the same way), nn/module.py (Parameter).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from minidist import backend

_KINDS = ("normal", "zeros", "ones", "constant")


@dataclass(frozen=True)
class Init:
    """How to draw one parameter: N(0, std^2), all zeros, all ones or a constant."""

    kind: str = "normal"
    std: float = 0.02
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Init: kind={self.kind!r} is not one of {_KINDS}.")
        if self.kind == "normal" and not self.std >= 0.0:
            raise ValueError(f"Init: std={self.std} must be >= 0 for a normal initialiser.")


def normal(std: float) -> Init:
    """N(0, std^2) for every element."""
    return Init("normal", std=float(std))


def zeros() -> Init:
    """All zeros (biases)."""
    return Init("zeros")


def ones() -> Init:
    """All ones (LayerNorm gains)."""
    return Init("ones")


def derive_seed(seed: int, *key: object) -> int:
    """Return a 128-bit integer from a stable hash of (seed, *key); same input, same output.

    `key` may hold str, int, float and nested tuples of those: anything whose repr is
    stable across processes and Python runs.
    """
    text = repr((int(seed),) + tuple(key)).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(text, digest_size=16).digest(), "little")


def stream(seed: int, *key: object) -> np.random.Generator:
    """A NumPy Generator for the named stream (seed, *key), e.g. ("dropout", step, layer, row).

    Fresh every call: two calls with the same key give two generators that produce the
    same numbers, which is what makes the result independent of who asks and when.
    """
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(derive_seed(seed, *key))))


_MASK64 = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 output function on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def counter_bits(seed: int, key: tuple, counters: np.ndarray) -> np.ndarray:
    """64 random bits for each counter c >= 0: element c of the stream (seed, *key)."""
    k = np.full(np.shape(counters), derive_seed(seed, *key) & _MASK64, dtype=np.uint64)
    c = np.asarray(counters, dtype=np.uint64) + np.uint64(1)
    return _splitmix64(k + c * _GAMMA)


def counter_uniform(seed: int, key: tuple, counters: np.ndarray) -> np.ndarray:
    """Uniform float64 in [0, 1) for each counter (the top 53 bits)."""
    return (counter_bits(seed, key, counters) >> np.uint64(11)) * (1.0 / (1 << 53))


def counter_integers(seed: int, key: tuple, counters: np.ndarray, high: int) -> np.ndarray:
    """Integers in [0, high) for each counter (bias <= high / 2**64: negligible)."""
    return (counter_bits(seed, key, counters) % np.uint64(high)).astype(np.int64)


def draw(init: Init, shape: tuple[int, ...], seed: int, name: str,
         dtype: str | np.dtype = "float64") -> np.ndarray:
    """Return the FULL tensor for parameter `name` as a NumPy array of `shape` and `dtype`.

    Tensor-parallel code slices the result, e.g. `draw(...)[:, r*F_tp:(r+1)*F_tp]`.
    """
    shape = tuple(int(s) for s in shape)
    if init.kind == "zeros":
        return np.zeros(shape, dtype=dtype)
    if init.kind == "ones":
        return np.ones(shape, dtype=dtype)
    if init.kind == "constant":
        return np.full(shape, init.value, dtype=dtype)
    full = stream(seed, "param", name).standard_normal(shape)       # float64, then round once
    return (full * init.std).astype(dtype)


def init_parameters(module, seed: int, prefix: str = "") -> None:
    """Fill every parameter of `module` (an nn.Module) in place with its (seed, full name)
    draw.

    `prefix` is prepended to the names, so a sub-module built on its own (a pipeline stage
    holding "blocks.2") can be initialised exactly as inside the whole model.
    A parameter that is a shard (`p.full_shape` set, `p.index` a tuple of slices) draws the
    full tensor and keeps `full[p.index]`, or `p.take(full)` for a shard that is no slice.
    """
    for name, p in module.named_parameters():
        full_name = prefix + name
        full_shape = getattr(p, "full_shape", None) or tuple(p.shape)
        full = draw(p.init, full_shape, seed, full_name, dtype=p.dtype)
        index, take = getattr(p, "index", None), getattr(p, "take", None)
        values = take(full) if take is not None else full if index is None else full[index]
        if tuple(values.shape) != tuple(p.shape):
            raise ValueError(
                f"init_parameters: {full_name} has shape {tuple(p.shape)} but its slice "
                f"{index} of the full shape {full_shape} has shape {values.shape}. "
                "Set Parameter.full_shape and Parameter.index consistently.")
        p.data[...] = backend.xp.asarray(values)
