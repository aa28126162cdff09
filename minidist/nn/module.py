"""Module and Parameter: a tree of layers whose leaves are named, seed-initialised tensors.

A Module is a plain Python object. Its parameters are the Parameter attributes it holds,
and its children are the Module attributes (a ModuleList holds numbered children). Walking
the attributes in the order they were assigned gives every parameter a full dotted name,
e.g. "blocks.1.mlp.fc.weight". Everything else keys off that name: initialisation
(seed.py draws each tensor from (seed, name)), checkpoints, optimizer state, and the
parallel layouts, which must hold the same names as the single-process model (a shard
keeps its full name and records the full shape and its slice).

A new Parameter is filled with NaN until `seed.init_parameters` fills it, so forgetting to
initialise is loud: the first loss is NaN. Models such as GPT initialise themselves.

One rank's view: every rank builds the same Module tree (or the part it owns), so names
agree across ranks without any communication.
Read next: nn/layers.py.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from minidist import backend
from minidist.autograd import Tensor
from minidist.seed import Init


class Parameter(Tensor):
    """A Tensor that requires grad and knows how to initialise itself (`init`).

    For a shard of a bigger tensor, `full_shape` is the shape of the whole tensor and
    `index` the tuple of slices this shard is, so `full[index]` has this shape; or, for a
    shard that is not a plain slice (padded, or a fused weight's pieces), `take` maps the
    full array to this shard (parallel/placement.py's shard()).
    """

    def __init__(self, shape: tuple[int, ...], init: Init, dtype: str = "float64", *,
                 full_shape: tuple[int, ...] | None = None, index: tuple | None = None,
                 take: Callable | None = None) -> None:
        super().__init__(backend.xp.full(tuple(shape), np.nan, dtype=dtype), requires_grad=True)
        self.init = init
        self.full_shape = None if full_shape is None else tuple(full_shape)
        self.index, self.take = index, take


class Module:
    """Base class: parameters and children are found by walking the attributes."""

    training: bool = True

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):                  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def named_children(self) -> Iterator[tuple[str, "Module"]]:
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        """(dotted name, module) for this module ("" or `prefix`) and every descendant."""
        yield prefix.rstrip("."), self
        for name, child in self.named_children():
            yield from child.named_modules(prefix + name + ".")

    def children(self) -> Iterator["Module"]:
        return (m for _, m in self.named_children())

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """(full dotted name, Parameter) in attribute order; a shared Parameter appears once."""
        seen: set[int] = set()
        for name, p in self._walk(prefix):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def _walk(self, prefix: str) -> Iterator[tuple[str, Parameter]]:
        for name, value in vars(self).items():
            if isinstance(value, Parameter):
                yield prefix + name, value
            elif isinstance(value, Module):
                yield from value._walk(prefix + name + ".")

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def num_parameters(self) -> int:
        return sum(int(p.size) for p in self.parameters())

    def train(self, mode: bool = True) -> "Module":
        """Set training mode (dropout on) here and in every descendant."""
        self.training = mode
        for child in self.children():
            child.train(mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def state_dict(self) -> dict[str, np.ndarray]:
        """{full name: NumPy copy of the values}: the format of checkpoints and results."""
        return {name: backend.to_numpy(p.data).copy() for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Copy values in by name; every name and shape must match exactly."""
        own = dict(self.named_parameters())
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(f"load_state_dict: missing {missing}, unexpected {unexpected}. "
                             "The state must come from a model with the same config.")
        for name, p in own.items():
            value = np.asarray(state[name])
            if value.shape != tuple(p.shape):
                raise ValueError(f"load_state_dict: {name} has shape {tuple(p.shape)} in the "
                                 f"model but {value.shape} in the state; configs differ.")
            p.data[...] = backend.xp.asarray(value.astype(p.dtype, copy=False))


class ModuleList(Module):
    """An ordered list of modules, named "0", "1", ... (as in "blocks.3.attn")."""

    def __init__(self, modules) -> None:
        for i, m in enumerate(modules):
            setattr(self, str(i), m)

    def __len__(self) -> int:
        return sum(1 for _ in self.named_children())

    def __getitem__(self, i: int | slice) -> "Module | list[Module]":
        """The i-th module, or a list of them for a slice (model.blocks[1:])."""
        if isinstance(i, slice):
            return [getattr(self, str(k)) for k in range(len(self))[i]]
        return getattr(self, str(range(len(self))[i]))

    def __iter__(self) -> Iterator[Module]:
        return self.children()


class ModuleSubset(ModuleList):
    """Some modules of a bigger ModuleList, each under its index THERE ("blocks.3",
    "experts.5"), so that every parameter keeps its single-process name when a rank holds
    only part of the list (a pipeline stage's blocks, an expert-parallel rank's experts).
    Indexing is by that global index."""

    def __init__(self, modules: dict[int, Module]) -> None:
        for i, m in sorted(modules.items()):
            setattr(self, str(i), m)

    def __getitem__(self, i: int) -> Module:
        return getattr(self, str(i))
