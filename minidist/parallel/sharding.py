"""Model sharding: which slice of every parameter this rank holds, and the global views of it.

The first of a training step's three jobs (parallel/compose.py). Every rank draws the
whole GPT from (seed, name), exactly as the single process does, and keeps its slice:
under tensor parallelism parallel/tensor/ replaces the layers by their sharded twins,
and every parameter records its placement over each mesh axis (parallel/placement.py).
Under context parallelism (parallel/context/) every cp rank keeps the whole (tp-local)
weights; only its attention is told to cross the cp group, and its layout which positions
it holds.
Everything that needs the GLOBAL model is then written once, from the placements, for
every layout (the engines add what the dp axis does; zero/engine.py shards over dp as well):

    sum_over_model(x)       a number summed over the model-parallel ranks, in rank order
    grad_sq(grads)          this rank's share of ||g||^2: a Replicate parameter counts on
                            tp rank 0 only, so no parameter is counted twice
    full_values(local)      {name: full array}: Shard pieces all-gathered and unsharded
                            (padding cropped); Replicate values as they are
    full_optimizer_state    the same for m, v or momentum buffers ("m.i" has param i's
                            placement), in baseline.py's state_dict() layout
    local_values(full)      the inverse, with no communication (every rank is handed the
    local_optimizer_state   full arrays): this rank's pieces, cut as at initialisation
                            (placement.shard, padding zeros), only my stage's parameters
                            and my ep rank's experts, the state renumbered to my order:
                            so the global state saved under one Plan loads under any other

Check mode adds a runtime proof of the placements of the gradients: a parameter that is
Replicate over tp must end every backward with the SAME gradient on every tp rank (its
contributions are complete on each). A hook on each such parameter all-gathers an 8-byte
digest of its .grad over tp and raises PlacementError naming it if they differ, which is
what happens when the LayerNorm gradients under sequence parallelism are not summed over
tp (each rank would keep the part from its own positions).

Under expert parallelism (parallel/expert/) a rank keeps E/ep experts of each MoE layer,
under their global names; their squares in the norm are summed over ep, and full_values
fetches every expert from the ep rank holding it. Under expert tensor parallelism each of
those experts is split over the etp group (placements over "etp"): its squares are summed
over ep x etp (the replicated output bias counted on etp rank 0), full_values gathers its
pieces over etp first.
Under pipeline parallelism (parallel/pipeline/stage.py) a rank keeps only its stage's layers
(`PipelineCut.cut`), each parameter under its global name. The tied wte lives on the first
and the last stage; the first owns it (it counts once in the norm). Sums over the model
run over the pp x tp ranks (`model_group`), and full_values / full_optimizer_state fetch
every parameter from the stage that owns it (a broadcast over pp), renumbering the
optimizer state from this stage's parameter order to the single-process one.

One rank's view: compose.parallelize draws GPT(cfg, seed), notes the single process's names
and shapes, and applies tp, cp, ep and the pipeline cut to it in that order; ModelSharding
records what that left on this rank and hands it to the gradient-sync engine of the dp x cp
group (parallel/data/ddp.py, parallel/zero/engine.py).
Communication: none to shard, nor to take my pieces of the global values (local_values);
full_values all-gathers each sharded parameter over tp and broadcasts it over pp from its
stage.
Read next: parallel/data/ddp.py.
"""

from __future__ import annotations

import hashlib

import numpy as np

from minidist import backend
from minidist import collectives as C
from minidist.nn import GPT
from minidist.optim.clip import wide
from minidist.parallel import placement as pl
from minidist.parallel.expert.expert_parallel import is_expert_parameter
from minidist.parallel.tensor.tensor_parallel import TensorParallel


class ModelSharding:
    """What this rank holds of GPT(cfg, seed): `model`, the plain GPT after compose.parallelize
    applied the model-parallel axes to it, and `whole`, the (name, shape) of every parameter
    of the single-process model in its order. tp (None or of size 1: whole weights) is the
    TensorParallel applied; cut (parallel/pipeline/stage.PipelineCut), pp and model_group
    (pp x tp) are my pipeline stage, its pp group and the group of the model's pieces; ep the
    expert-parallel group."""

    def __init__(self, model: GPT, whole: list[tuple[str, tuple]],
                 tp: TensorParallel | None = None, *, check: bool = False, cut=None, pp=None,
                 model_group=None, ep=None, etp=None, experts_group=None) -> None:
        """etp: the expert-tensor-parallel group; experts_group: ep x etp, over which an
        expert's squares are summed (ep when there is no etp)."""
        cfg = model.cfg
        self.model = model
        self.global_names = [n for n, _ in whole]           # the baseline's order
        self.global_shapes = [tuple(shape) for _, shape in whole]
        self.tp = tp if tp is not None and tp.group.size > 1 else None
        self.ep = ep if ep is not None and ep.size > 1 else None
        self.etp = etp if etp is not None and etp.size > 1 else None
        self.experts_group = experts_group if experts_group is not None and \
            experts_group.size > 1 else None
        self.etp_rank = 0 if self.etp is None else self.etp.rank
        self.cut, self.pp = cut, pp if cut is not None else None
        self.model_group = model_group if cut is not None else (
            None if self.tp is None else self.tp.group)
        if cut is not None:
            self.owner = [min(s for s in range(cut.stages) if _stage(cut, s).holds(
                n, cfg.tie_weights)) for n in self.global_names]
        named = list(self.model.named_parameters())
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.tp_rank = 0 if self.tp is None else self.tp.group.rank
        self.owned = [pl.owns_uniquely(p, "tp", self.tp_rank) and self._stage_owns(n)
                      and (not is_expert_parameter(n) or self.etp is None
                           or pl.owns_uniquely(p, "etp", self.etp_rank)) for n, p in named]
        self.expert = [self.experts_group is not None and is_expert_parameter(n)
                       for n in self.names]
        if check and self.tp is not None:
            for name, p in named:
                if not isinstance(pl.placement_of(p, "tp"), pl.Shard):
                    p.register_grad_hook(self._replicated_grad_check(name))

    def _stage_owns(self, name: str) -> bool:
        """Does this pipeline stage own `name` (not a tied copy of another stage's)?"""
        return self.cut is None or self.owner[self.global_names.index(name)] == self.cut.stage

    # --- sums over the model-parallel ranks ---
    def sum_over_model(self, x: float) -> float:
        """x summed over the model's pieces (tp, and pp stages) in rank order (bitwise the
        same on every rank)."""
        if self.model_group is None:
            return float(x)
        total = 0.0
        for part in C.all_gather(np.array([x], np.float64), group=self.model_group).reshape(-1):
            total += float(part)
        return total

    def grad_sq(self, grads) -> float:
        """sum of squares of the grads (one per parameter, None skipped) that this rank owns."""
        total, experts = 0.0, 0.0
        for g, own, expert in zip(grads, self.owned, self.expert):
            if g is not None and own:
                flat = wide(g.reshape(-1))          # 16-bit gradients: summed in fp32
                if expert:                       # my experts only: summed over ep below
                    experts += float(backend.xp.dot(flat, flat))
                else:
                    total += float(backend.xp.dot(flat, flat))
        if self.experts_group is not None:     # ep x etp: every expert, every piece
            for part in C.all_gather(np.array([experts]),
                                     group=self.experts_group).reshape(-1):
                total += float(part)
        return total

    # --- global views ---
    def full_values(self, local: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """{name: full array} from {name: this rank's piece} (COLLECTIVE over tp and pp)."""
        out = {}
        for name, p in zip(self.names, self.params):
            out[name] = self._full(local[name], p)
        return self._over_stages(out)

    def full_optimizer_state(self, state: dict) -> dict:
        """baseline's state_dict() layout from this rank's ("m.i" pieces of parameter i)."""
        out, tensors = {}, {}
        for key, value in state.items():
            if not isinstance(value, np.ndarray):
                out[key] = value
                continue
            prefix, i = key.rsplit(".", 1)
            tensors.setdefault(prefix, {})[self.names[int(i)]] = self._full(
                value, self.params[int(i)])
        for prefix, values in tensors.items():      # renumbered in the baseline's order
            full = self._over_stages(values)
            out.update({f"{prefix}.{self.global_names.index(n)}": v for n, v in full.items()})
        return out

    # --- the inverse: this rank's pieces of the global values (no communication) ---
    def local_values(self, full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """{name: this rank's piece} of {name: full array} (every parameter of the
        single-process model, as full_values returns them): the tp piece that
        placement.shard cuts at initialisation (padding zeros), only the parameters of my
        pipeline stage, only my ep rank's experts. ValueError naming the key for a missing
        or unexpected name, a wrong shape or dtype (check_values)."""
        check_values(full, self.global_names, self.global_shapes, self._dtype)
        return {n: self._piece(full[n], p) for n, p in zip(self.names, self.params)}

    def local_optimizer_state(self, full_state: dict, layout: tuple | None = None) -> dict:
        """This rank's optimizer state_dict() from baseline's layout: "m.j" (j in the
        single-process order) -> "m.i" (i in this rank's order), cut like parameter i;
        scalars ("step") as they are. layout (optimizer name, scalar keys, prefixes) is what
        the optimizer keeps (check_state: ValueError on another optimizer's state)."""
        prefixes = check_state(full_state, self.global_names, self.global_shapes, self._dtype,
                               layout)
        out = {k: int(v) for k, v in full_state.items() if not isinstance(v, np.ndarray)}
        j = {n: k for k, n in enumerate(self.global_names)}
        for prefix in prefixes:
            for i, (n, p) in enumerate(zip(self.names, self.params)):
                out[f"{prefix}.{i}"] = self._piece(full_state[f"{prefix}.{j[n]}"], p)
        return out

    @property
    def _dtype(self) -> np.dtype:
        return np.dtype(self.model.cfg.dtype)

    def _piece(self, full: np.ndarray, p) -> np.ndarray:
        """My piece of one full array, cut as parameter p was at initialisation (a copy)."""
        if self.etp is not None and isinstance(pl.placement_of(p, "etp"), pl.Shard):
            return pl.shard(full, pl.placement_of(p, "etp"), self.etp.size, self.etp_rank)
        if self.tp is None:
            return np.array(full, copy=True)
        return pl.shard(full, pl.placement_of(p, "tp"), self.tp.group.size, self.tp_rank)

    def _over_experts(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """COLLECTIVE over ep: every expert of my layers, each broadcast from the ep rank
        holding it (expert e lives on ep rank e // (E/ep)); other values as they are."""
        if self.ep is None:
            return values
        cfg, out = self.model.cfg, {}
        per = cfg.n_experts // self.ep.size
        for name in self.global_names:
            if is_expert_parameter(name) and (name in values or self.cut is None
                                              or self.cut.holds(name, cfg.tie_weights)):
                e = int(name.split(".moe.experts.")[1].split(".")[0])
                shape = self.global_shapes[self.global_names.index(name)]
                x = values[name] if e // per == self.ep.rank else np.empty(shape, cfg.dtype)
                out[name] = C.broadcast(np.ascontiguousarray(x), root=e // per, group=self.ep)
            elif name in values:
                out[name] = values[name]
        return out

    def _over_stages(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """COLLECTIVE over ep and pp: {name: value} for every parameter of the model, each
        broadcast from the rank that holds it (without ep, pp: `values` as they are)."""
        values = self._over_experts(values)
        if self.cut is None:
            return {n: values[n] for n in self.global_names}
        out = {}
        for j, name in enumerate(self.global_names):
            mine = self.owner[j] == self.cut.stage
            x = values[name] if mine else np.empty(self.global_shapes[j], self.model.cfg.dtype)
            out[name] = C.broadcast(np.ascontiguousarray(x), root=self.owner[j], group=self.pp)
        return out

    def _full(self, piece: np.ndarray, p) -> np.ndarray:
        if self.etp is not None and isinstance(pl.placement_of(p, "etp"), pl.Shard):
            pieces = list(C.all_gather(np.ascontiguousarray(piece), group=self.etp))
            return pl.unshard(pieces, pl.placement_of(p, "etp"),
                              p.full_shape[pl.placement_of(p, "etp").dim])
        placement = pl.placement_of(p, "tp")
        if self.tp is None or not isinstance(placement, pl.Shard):
            return np.array(piece, copy=True)
        pieces = list(C.all_gather(np.ascontiguousarray(piece), group=self.tp.group))
        n = p.full_shape[placement.dim]
        return pl.unshard(pieces, placement, n)

    # --- check mode ---
    def _replicated_grad_check(self, name: str):
        tp = self.tp

        def check(p) -> None:
            mine = np.frombuffer(hashlib.blake2b(np.ascontiguousarray(
                backend.to_numpy(p.grad)).tobytes(), digest_size=8).digest(), np.uint8)
            every = C.all_gather(mine, group=tp.group)                    # (W, 8)
            differ = [r for r in range(len(every)) if not np.array_equal(every[r], every[0])]
            if differ:
                raise pl.PlacementError(
                    f"{tp.prefix} the gradient of {name!r} differs between tp ranks "
                    f"{[0] + differ}, but the parameter is Replicate over tp, so its gradient "
                    "must be the same sum on every rank. Under sequence parallelism each rank "
                    "sees only its positions: pass the parameter through f "
                    "(TensorParallel.sum_grad) so its gradient is summed over tp.")
        return check


def check_values(full: dict, names: list[str], shapes: list[tuple], dtype) -> None:
    """ValueError unless `full` holds exactly `names`, names[i] a numpy array of shape
    shapes[i] and of `dtype` (a load only copies, so nothing is cast or reshaped)."""
    if not isinstance(full, dict):
        raise ValueError(f"load_full_state: params is a {type(full).__name__}; expected a "
                         "dict {name: full array}, as full_params() returns it.")
    expected = dict(zip(names, shapes))
    for name in full:
        if name not in expected:
            raise ValueError(f"load_full_state: params has an unexpected key {name!r}, which "
                             f"is no parameter of this model; expected the {len(names)} names "
                             f"of the single-process model ({names[0]!r}, ..., {names[-1]!r}).")
    for name, shape in expected.items():
        if name not in full:
            raise ValueError(f"load_full_state: params has no {name!r}; expected every "
                             f"parameter of the single-process model, full shape {shape}.")
        _check_array(f"params[{name!r}]", full[name], shape, dtype)


def check_state(state: dict, names: list[str], shapes: list[tuple], dtype,
                layout: tuple | None = None) -> tuple[str, ...]:
    """ValueError unless `state` is an optimizer state_dict() in baseline's layout: the
    scalars (int >= 0) and, per prefix, "prefix.i" for every parameter i (shape shapes[i],
    `dtype`), nothing else. layout = (optimizer name, scalar keys, prefixes) it must be
    (None: whatever `state` holds). Returns the prefixes."""
    if not isinstance(state, dict):
        raise ValueError(f"load_full_state: optimizer_state is a {type(state).__name__}; "
                         "expected a dict, as full_optimizer_state() returns it.")
    arrays = {k.rsplit(".", 1)[0] for k, v in state.items() if isinstance(v, np.ndarray)}
    name, scalars, prefixes = layout if layout is not None else (
        "the optimizer", tuple(k for k, v in state.items() if not isinstance(v, np.ndarray)),
        tuple(sorted(arrays)))
    keys = ", ".join([repr(s) for s in scalars] + [f"'{p}.i'" for p in prefixes]) or "nothing"
    keeps = f"keeps {keys} (i < {len(names)})"
    want = f"{name} {keeps}"
    if arrays - set(prefixes):
        raise ValueError(f"load_full_state: optimizer_state holds {sorted(arrays)} state, but "
                         f"this engine's optimizer is {name}, which {keeps}: an optimizer kind "
                         "mismatch. Load a state saved with the same optimizer.")
    valid = {*scalars, *(f"{p}.{i}" for p in prefixes for i in range(len(names)))}
    for key in state:
        if key not in valid:
            raise ValueError(f"load_full_state: optimizer_state has an unexpected key {key!r};"
                             f" {want}.")
    for key in scalars:
        if key not in state:
            raise ValueError(f"load_full_state: optimizer_state has no {key!r}; {want}.")
        v = state[key]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"load_full_state: optimizer_state[{key!r}] is {v!r}; {want}, "
                             f"{key!r} an int >= 0.")
    for prefix in prefixes:
        for i, (n, shape) in enumerate(zip(names, shapes)):
            key = f"{prefix}.{i}"
            if key not in state:
                raise ValueError(f"load_full_state: optimizer_state has no {key!r} (the state "
                                 f"of parameter {i}, {n!r}); {want}.")
            _check_array(f"optimizer_state[{key!r}] (parameter {n!r})", state[key], shape, dtype)
    return tuple(prefixes)


def _check_array(what: str, x, shape: tuple, dtype) -> None:
    if not isinstance(x, np.ndarray):
        raise ValueError(f"load_full_state: {what} is a {type(x).__name__}; expected a numpy "
                         f"array of shape {tuple(shape)} and dtype {np.dtype(dtype)}.")
    if x.shape != tuple(shape) or x.dtype != np.dtype(dtype):
        raise ValueError(f"load_full_state: {what} has shape {x.shape} and dtype {x.dtype}; "
                         f"expected the full tensor, shape {tuple(shape)}, dtype "
                         f"{np.dtype(dtype)} (a load only copies: nothing is cast or cut).")


def _stage(cut, stage: int):
    """The PipelineCut of another stage of the same pipeline."""
    return type(cut)(stage, cut.stages, cut.pieces, cut.placement)
