"""The dense layers of a GPT: Linear, Embedding, LayerNorm, Dropout and the MLP built on them.

Linear stores its weight as (in, out) so the code reads like the math, y = x @ W + b, and
a tensor-parallel split of the output features is a split of W's last axis (columns).

Dropout never uses a hidden RNG state. Its mask element j of batch row b is element
(sample_id[b] * n + j) of the counter-based stream (seed, "dropout", step, layer name),
n = elements per row, from a `DropoutKey`; so a data-parallel rank holding rows 4..7 of
a global batch draws exactly the masks the single process draws for those rows.

Shapes: x (..., C) -> (..., F) for Linear(C, F); ids (...) -> (..., C) for Embedding.
Initialisation: weights N(0, 0.02^2) (GPT-2), biases 0, LayerNorm gain 1 and shift 0.
References: LayerNorm -- Ba et al. 2016, arXiv:1607.06450; GELU -- Hendrycks & Gimpel 2016,
    arXiv:1606.08415; dropout -- Srivastava et al. 2014, JMLR 15.
Read next: nn/attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minidist import backend
from minidist import seed as seeding
from minidist.autograd import Tensor
from minidist.autograd import functional as F
from minidist.nn.module import Module, Parameter

STD = 0.02                                            # GPT-2's initialiser


@dataclass(frozen=True)
class DropoutKey:
    """Which masks to draw: global seed, training step and the global index of every row."""

    seed: int
    step: int
    sample_ids: tuple[int, ...]


class Linear(Module):
    """y = x @ W + b with W (in_features, out_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype: str = "float64", std: float = STD) -> None:
        self.weight = Parameter((in_features, out_features), seeding.normal(std), dtype)
        self.bias = Parameter((out_features,), seeding.zeros(), dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)           # (..., C) @ (C, F) + (F,)


class Embedding(Module):
    """Row lookup: out[..., :] = W[ids[...], :] with W (num_embeddings, C)."""

    def __init__(self, num_embeddings: int, dim: int, dtype: str = "float64",
                 std: float = STD) -> None:
        self.weight = Parameter((num_embeddings, dim), seeding.normal(std), dtype)

    def forward(self, ids) -> Tensor:
        return F.embedding(self.weight, ids)               # (...) -> (..., C)


class LayerNorm(Module):
    """(x - mean) / sqrt(var + eps) * g + b over the last axis (biased variance)."""

    def __init__(self, dim: int, bias: bool = True, dtype: str = "float64",
                 eps: float = 1e-5) -> None:
        self.weight = Parameter((dim,), seeding.ones(), dtype)
        self.bias = Parameter((dim,), seeding.zeros(), dtype) if bias else None
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight, self.bias, eps=self.eps)


class Dropout(Module):
    """Inverted dropout with masks addressed by (seed, step, layer name, global element index).

    `name` keys the mask stream; `nn.name_dropouts(model)` sets it to the layer's full
    dotted name. Element (b, i1, i2, ...) of the GLOBAL activation (sample_ids[b], full
    sizes n1, n2, ...) draws counter ((sample_ids[b] n1 + i1) n2 + i2) ...: its row-major
    index. A rank that holds only a slice of an axis (heads under tensor parallelism,
    positions under sequence parallelism) passes `shards={axis: (start, full size)}`, or
    `{axis: (global indices, full size)}` for a slice that is not contiguous (zig-zag
    context parallelism), and draws exactly the mask elements the single process draws.
    Identity when p == 0 or in eval mode; training with p > 0 needs a key.
    """

    # sequence(rows) -> shards: where an activation of `rows` positions on this rank sits in
    # the global sequence; the GPT points it at its layout (sequence and context
    # parallelism split the positions), and forward uses it when no shards are given
    sequence = None

    def __init__(self, p: float, name: str = "dropout") -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p={p} must be in [0, 1).")
        self.p, self.name = float(p), name

    def forward(self, x: Tensor, key: DropoutKey | None,
                shards: dict[int, tuple[int, int]] | None = None) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        if shards is None and self.sequence is not None:
            shards = self.sequence(x.shape[1])
        if key is None or len(key.sample_ids) != x.shape[0]:
            got = None if key is None else len(key.sample_ids)
            raise ValueError(f"Dropout {self.name}: training with p={self.p} needs a DropoutKey "
                             f"with one sample id per row ({x.shape[0]} rows, got {got}). Pass "
                             "dropout_key=DropoutKey(seed, step, ids) or call model.eval().")
        return x * backend.xp.asarray(self.scale(x.shape, x.dtype, key, shards))

    def scale(self, shape: tuple[int, ...], dtype, key: DropoutKey,
              shards: dict | None = None) -> np.ndarray:
        """The mask times 1/(1-p), (shape): 0 where dropped. For code that applies dropout
        inside its own Function (ring attention drops one block of scores at a time)."""
        counters = global_counters(shape, key.sample_ids, shards or {})
        keep = seeding.counter_uniform(key.seed, ("dropout", key.step, self.name),
                                       counters) >= self.p
        return keep.astype(dtype) / (1.0 - self.p)


def global_counters(shape: tuple[int, ...], sample_ids, shards: dict[int, tuple[int, int]]
                    ) -> np.ndarray:
    """Row-major index of every element of a local block (shape) in the global tensor.

    Axis 0 holds the rows sample_ids; axis a >= 1 holds elements start .. start+shape[a]-1
    of a global axis of size full, with (start, full) = shards.get(a, (0, shape[a])), or
    the elements at the given global indices when `start` is an array of them.
    """
    counters = np.asarray(sample_ids, dtype=np.int64).reshape((-1,) + (1,) * (len(shape) - 1))
    for a in range(1, len(shape)):
        start, full = shards.get(a, (0, shape[a]))
        index = np.asarray(start, np.int64) if np.ndim(start) else \
            np.arange(start, start + shape[a])
        if index.shape != (shape[a],):
            raise ValueError(f"dropout: axis {a} has {shape[a]} elements but {index.size} "
                             "global indices were given for it.")
        counters = counters * full + index.reshape((-1,) + (1,) * (len(shape) - 1 - a))
    return counters


class MLP(Module):
    """fc: (C, F) -> GELU(tanh) -> proj: (F, C) -> dropout. `proj_std` scales the residual write."""

    def __init__(self, dim: int, hidden: int, bias: bool = True, dropout: float = 0.0,
                 dtype: str = "float64", proj_std: float = STD) -> None:
        self.fc = Linear(dim, hidden, bias, dtype)
        self.proj = Linear(hidden, dim, bias, dtype, std=proj_std)
        self.drop = Dropout(dropout)

    def forward(self, x: Tensor, key: DropoutKey | None = None) -> Tensor:
        h = F.gelu(self.fc(x), approximate="tanh")     # (..., C) -> (..., F)
        return self.drop(self.proj(h), key)            # (..., F) -> (..., C)


def name_dropouts(model: Module) -> None:
    """Give every Dropout inside `model` its full dotted name, the key of its mask stream."""
    for name, m in model.named_modules():
        if isinstance(m, Dropout):
            m.name = name
