"""ZeRO: data parallelism without the redundant copies -- shard the optimizer state (stage 1),
the gradients (stage 2) and the parameters (stage 3) over the W data-parallel ranks.

Plain data parallelism (parallel/data/ddp.py) keeps on every rank the full parameters (bΨ
bytes for Ψ numbers of b bytes), the full gradients (bΨ) and the full optimizer state
(AdamW: m and v, 2bΨ), and every rank performs the same update on the same numbers.
ZeRO notices that the update is elementwise: rank r can update only its 1/W of the
elements, provided it has the summed gradient for those elements, and then share the
result. Each stage removes one more replicated copy:

    stage 1  optimizer state sharded   bΨ_pad + bΨ_pad + 2b S
    stage 2  + gradients sharded       bΨ_pad + bS     + 2b S
    stage 3  + parameters sharded      bS     + bS     + 2b S     (+ the gathered units)
with S = sum over units of ceil(N_u / W) and Ψ_pad = W S (flat.py: units padded to W).

One rank's view of one step (rank r of W, M micro-batches; flat.py gives every unit u
a padded flat vector and rank r the slice [r S_u, (r+1) S_u) of it):
    stage 1: backward writes the full local gradient of every unit into a flat buffer
        (a grad hook moves each .grad there); step(): reduce_scatter(sum) each buffer,
        keeping the reduced slice in place -> dw_shard; norm; AdamW on (w_shard, dw_shard,
        m_shard, v_shard); all_gather(w_shard) into the full flat parameters.
    stage 2: the same, but as soon as the hooks have seen every parameter of a unit (in the
        last micro-batch's backward) its buffer is reduce-scattered into a persistent
        dw_shard (S_u,) and FREED, so only one unit's full gradient lives at a time (plus
        the root unit, whose tied embedding finishes last).
    stage 3: the model's parameters are placeholders; each unit keeps w_shard only.
        stage3.py wraps the model's hook points (the GPT's embed, each block's forward,
        head): a unit is gathered just before a call that reads it and freed after its
        last one, the next unit prefetched asynchronously; the call's graph is kept
        without the unit's parameters, and the backward gathers them again, puts them back
        into the graph, backpropagates and reduce-scatters the unit's gradient.
    all stages: ||g|| = sqrt(sum_r ||dw_shard_r||^2): each rank's sum of squares (padding
        is zero), all_gather of the W partial sums, added in rank order (bitwise equal on
        every rank); clip by max_norm / (||g|| + 1e-6) (optim.clip_to, as DDP does); then
        the optimizer DDP uses (optim.make_optimizer: AdamW or SGD) steps
        one flat.FlatShard per unit, (.data, .grad) = (w_shard, dw_shard), and holds the
        state shards m, v or the momentum buffer, (S_u,) each.

Gradient accumulation: backwards inside no_sync() only add the local gradient into the
full-size unit buffers (no communication, as in FSDP's no_sync); the last micro-batch
reduces. So every stage adds in the same order as DDP (local sum over micro-batches,
then the rank-order sum), and with algo "direct" the parameters of stages 0-3 are
bitwise equal. The price: during accumulation stages 2 and 3 hold full-size gradient
buffers, as stage 1 does.

Communication per step (ring; elements sent per rank; `zero_memory.comm_elements`):
    stage 1, 2: reduce_scatter (W-1) S + all_gather (W-1) S   = 2 Ψ_pad (W-1)/W
    stage 3:    all_gather twice per micro-batch + reduce_scatter = (2M + 1) Ψ_pad (W-1)/W
    plus (W-1) numbers for the norm. algo "direct" reduces through shared memory; the
    bytes its peers read count as sent (collectives/direct.py), so the totals agree.
    "auto" is "direct" where the group shares memory and "ring" where it does not (the
    MPI transport, runtime/mpi.py: `supports_shared` False); all-gathers use the ring.

Hybrid sharding (HSDP; Zhao et al. 2023, Sec. 3.2.2): `group` is then a shard group of S
of the dp ranks (inside a node) and `replica_group` the dp / S ranks holding the same
shard (across nodes). Each reduce-scatter over the shard group is followed by an all-reduce
of its shard over the replicas, so every replica holds the gradient summed over all dp
ranks and takes the same step; gathers (parameters, the norm's partial sums) stay inside
the shard group. Memory per rank: S in place of W above. Bytes per step: the shard group's
stage 1-2 traffic with W = S, plus 2 (R-1)/R S_shard per rank over the replicas (R = dp / S,
a ring all-reduce of my shard): only 1/S of the gradient crosses the slow tier.

Numerics: AdamW and SGD are elementwise, so the optimizer objects stepping a shard give
it the bits the full update would give. Step counters are Python ints and are not
counted as memory. Under expert parallelism a MoE block's experts are a unit of their own,
sharded over the experts' replicas (`expert_group`); the norm still sums every rank's
shards over dp, which counts each expert element once.

References: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models", arXiv:1910.02054, Sec. 5 (P_os, P_g, P_p), Sec. 7 (communication);
    Zhao et al. 2023, "PyTorch FSDP", arXiv:2304.11277 (units, prefetch, no_sync).
Read next: parallel/zero/stage3.py (stage 3 forward/backward), parallel/zero/memory.py.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from minidist import collectives as C
from minidist.nn import Module
from minidist.optim import clip_to
from minidist.optim import make_optimizer
from minidist.optim.clip import wide
from minidist.parallel.engine import Engine
from minidist.parallel.zero import stage3
from minidist.parallel.zero.flat import FlatShard, FlatUnit, split_units

ALGOS = ("auto", "direct", "ring", "halving")          # the algorithms with a reduce_scatter


class ZeroEngine(Engine):
    """ZeRO stage 1, 2 or 3 on `group`; the engine interface train.py drives."""

    def __init__(self, model: Module, group, stage: int, *, optimizer: str = "adamw",
                 lr: float = 1e-3, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), momentum: float = 0.0,
                 algo: str = "auto", sharding=None,
                 hook_points: list[tuple[Module, str]] | None = None,
                 expert_group=None, replica_group=None) -> None:
        """hook_points (stage 3): (module, method name) pairs in call order that stage3.py
        wraps; None: the GPT's (stage3.gpt_hook_points: embed, every block, head).
        replica_group: HSDP's replicas of my shards (module docstring), or None."""
        _check_args(stage, optimizer, algo)
        if replica_group is not None and expert_group is not None:
            raise ValueError("ZeroEngine: replica_group (HSDP) with expert_group (expert "
                             "parallelism) is not built; give one of them.")
        self.model, self.group, self.stage, self.sharding = model, group, stage, sharding
        self.replicas = replica_group if replica_group is not None and \
            replica_group.size > 1 else None
        self.replica_algo = algo if algo in ("ring", "halving") else "auto"   # no shared mem
        self.rank, W = group.rank, group.size
        self.rs_algo, self.ag_algo = algorithms(algo, group)
        # expert parallelism: the experts' units are sharded over their replicas only
        self.units: list[FlatUnit] = split_units(
            model, W, None if expert_group is None else expert_group.size)
        self.unit_groups = [expert_group if u.name.endswith(".experts") else group
                            for u in self.units]
        self.dtype = np.dtype(self.units[0].params[0].dtype)
        self._sync = True
        w_shards = self._shard_parameters()
        # gradients: stage 1 keeps full flat buffers (the reduced slice in place);
        # stages 2-3 keep a shard and build full buffers only while a unit is reduced
        self.g_acc: list[np.ndarray | None] = [
            np.zeros(u.padded, self.dtype) if stage == 1 else None for u in self.units]
        self.shards = [FlatShard(u.name, w, a[slice(*u.shard_range(self._rank(i)))]
                                 if stage == 1 else np.zeros(u.shard, self.dtype))
                       for i, (u, w, a) in enumerate(zip(self.units, w_shards, self.g_acc))]
        # DDP's optimizer, one "parameter" per unit: its state is sharded like the units
        self.opt = make_optimizer(optimizer, self.shards, lr, weight_decay, betas, momentum)
        self.peaks = {"unsharded_grads": 0, "gathered_params": 0}
        self.norm_mask = self._norm_masks()
        self._seen = [0] * len(self.units)
        self._unit_of = {id(p): (i, k) for i, u in enumerate(self.units)
                         for k, p in enumerate(u.params)}
        if stage < 3:
            for u in self.units:
                for p in u.params:
                    p.register_grad_hook(self._on_grad)
            self.stage3 = None
        else:
            self.stage3 = stage3.Zero3Hooks(self, hook_points)

    def _shard_parameters(self) -> list[np.ndarray]:
        """w_shard per unit. Stages 1-2: the model's Parameters become views of the unit
        flats (self.p_full) and w_shard a view of those; stage 3: w_shard is a copy, the
        only one this rank keeps (parallel/zero/stage3.py gives the Parameters placeholders)."""
        self.p_full: list[np.ndarray | None] = []
        w_shards = []
        for i, u in enumerate(self.units):
            full = u.pack([p.data for p in u.params], self.dtype)
            lo, hi = u.shard_range(self._rank(i))
            if self.stage < 3:
                for p, view in zip(u.params, u.views(full)):
                    p.data = view
                self.p_full.append(full)
                w_shards.append(full[lo:hi])
            else:
                self.p_full.append(None)
                w_shards.append(full[lo:hi].copy())
        return w_shards

    # --- the engine interface ---
    def forward(self, idx, targets=None, *, n_tokens: int | None = None,
                aux_weight: float = 1.0, dropout_key=None):
        """(logits, loss) of the model; under stage 3 its wrapped hook points gather."""
        return self.model(idx, targets, n_tokens=n_tokens, aux_weight=aux_weight,
                          dropout_key=dropout_key)

    def step(self, lr: float, clip_grad: float | None = None,
             skip: Callable[[float], bool] | None = None) -> float:
        """Reduce what is left, clip by the global norm, update the shards, gather (1-2).

        Returns the global gradient norm before clipping. Cost (stage 1-2, ring):
        (W-1) S reduce-scatter + (W-1) S all-gather + (W-1) norm numbers per rank.
        skip(norm) True (the same on every rank): zero the gradients, change nothing else.
        """
        if clip_grad is not None and not clip_grad > 0:
            raise ValueError(f"ZeroEngine.step: clip_grad={clip_grad}; it must be > 0 or None.")
        for i, u in enumerate(self.units):
            if self.stage == 1:
                lo, hi = u.shard_range(self._rank(i))
                self.g_acc[i][lo:hi] = self._reduce_scatter(self.g_acc[i], i)
            elif self.g_acc[i] is not None:          # still full: reduced only now
                self._reduce_unit(i)
        self._seen = [0] * len(self.units)
        norm = self.global_norm()
        if skip is None or not skip(norm):
            clip_to([s.grad for s in self.shards], norm, clip_grad)
            self.opt.lr = lr
            self.opt.step()                          # AdamW / SGD on (w_shard, dw_shard)
            if self.stage < 3:
                for i, s in enumerate(self.shards):
                    self.p_full[i][...] = self._all_gather(s.data, unit=i).reshape(-1)
        for g in self.g_acc if self.stage == 1 else [s.grad for s in self.shards]:
            g[...] = 0
        return norm

    def global_norm(self) -> float:
        """COLLECTIVE: sqrt of the sum over ranks (in rank order) of ||dw_shard||^2, each
        element counted once over tp too (norm_mask: 0 on Replicate parameters off tp rank 0)."""
        local = 0.0
        for s, mask in zip(self.shards, self.norm_mask):
            g = wide(s.grad)                     # 16-bit gradients: summed in fp32
            local += float(np.dot(g, g)) if mask is None else float(np.dot(g * mask, g))
        total = 0.0
        for part in self._all_gather(np.array([local])).reshape(-1):
            total += float(part)
        return self._norm(total)

    def _norm_masks(self) -> list[np.ndarray | None]:
        """Per unit: None if this rank owns every element (sharding.owned), else 1/0 of shard."""
        if self.sharding is None or all(self.sharding.owned):
            return [None] * len(self.units)
        masks = []
        for i, u in enumerate(self.units):
            full = u.pack([np.full(s.shape, float(self.sharding.owned[s.index]))
                           for s in u.slots], self.dtype)
            masks.append(full[slice(*u.shard_range(self._rank(i)))].copy())
        return masks

    def full_params(self) -> dict[str, np.ndarray]:
        """COLLECTIVE (stage 3): {name: full values} in model.named_parameters() order."""
        out = {}
        for i, u in enumerate(self.units):
            full = self.p_full[i] if self.stage < 3 else self.gather_unit(i)
            for slot, view in zip(u.slots, u.views(full)):
                out[slot.name] = view.copy()
        return self._global_params({name: out[name] for name, _ in self.model.named_parameters()})

    def full_optimizer_state(self) -> dict:
        """COLLECTIVE: the optimizer's state_dict() ("step", "m.u", "v.u" or
        "momentum_buffer.u" for the shard of unit u) gathered into baseline's layout ("step",
        "m.i", ... with i = index in model.parameters())."""
        state: dict = {}
        for key, value in self.opt.state_dict().items():
            if not isinstance(value, np.ndarray):
                state[key] = value
                continue
            prefix, i = key.rsplit(".", 1)
            u = self.units[int(i)]
            full = self._all_gather(value, unit=int(i)).reshape(-1)     # a new array:
            for slot, view in zip(u.slots, u.views(full)):                # its views are
                state[f"{prefix}.{slot.index}"] = view                     # the caller's
        return self._global_state(state)

    def load_full_state(self, params: dict, optimizer_state: dict) -> None:
        """The inverse of full_params / full_optimizer_state, between steps (engine.py):
        each unit's flat vector is packed from this rank's pieces (flat.py: zero padding, as
        a step leaves it) and cut to my shard; stages 1-2 overwrite the full flat copy
        (the Parameters are views of it, w_shard a view of those), stage 3 w_shard. The
        optimizer's m, v or momentum shards are cut alike, its step count set. No
        communication: every rank is handed the same global arrays."""
        local, state = self._local_full_state(params, optimizer_state)
        opt = {k: v for k, v in state.items() if not isinstance(v, np.ndarray)}
        prefixes = {k.rsplit(".", 1)[0] for k, v in state.items() if isinstance(v, np.ndarray)}
        for i, u in enumerate(self.units):
            lo, hi = u.shard_range(self._rank(i))
            full = u.pack([local[s.name] for s in u.slots], self.dtype)     # (W S_u,)
            if self.stage < 3:
                self.p_full[i][...] = full
            else:
                self.shards[i].data[...] = full[lo:hi]
            for prefix in prefixes:
                flat = u.pack([state[f"{prefix}.{s.index}"] for s in u.slots], self.dtype)
                opt[f"{prefix}.{i}"] = flat[lo:hi]
        self.opt.load_state_dict(opt)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now, from the arrays themselves (parallel/zero/memory.py predicts
        them): params, grads, optimizer; peak_unsharded_grads (stage 2-3) and
        peak_gathered_params (stage 3) are high-water marks since construction."""
        params = self.p_full if self.stage < 3 else [s.data for s in self.shards]
        out = {"params": sum(p.nbytes for p in params),
               "grads": sum(g.nbytes for g in self.g_acc if g is not None)
               + (0 if self.stage == 1 else sum(s.grad.nbytes for s in self.shards)),
               "optimizer": sum(a.nbytes for a in self.opt.state_dict().values()
                                if isinstance(a, np.ndarray))}
        if self.stage >= 2:
            out["peak_unsharded_grads"] = self.peaks["unsharded_grads"]
        if self.stage == 3:
            out["peak_gathered_params"] = self.peaks["gathered_params"]
        return out

    # --- gradients (called by the hooks, and by stage3.py for stage 3) ---
    def _on_grad(self, p) -> None:
        """Grad hook (stages 1-2): move p.grad into its unit's flat buffer, free it."""
        i, k = self._unit_of[id(p)]
        u = self.units[i]
        buf = self._grad_buffer(i)
        s = u.slots[k]
        buf[s.offset:s.offset + s.numel] += p.grad.reshape(-1)    # 0 + g = g exactly
        p.grad = None
        self._seen[i] += 1
        if self._seen[i] == len(u.params):
            self._seen[i] = 0
            if self.stage == 2 and self._sync:
                self._reduce_unit(i)

    def local_grad(self, p) -> np.ndarray:
        """Stages 1-2: p's gradient accumulated on this rank and not yet reduced (a view
        of its unit's buffer, writable in place: pipeline.sync_tied adds the tied copy's)."""
        if self.stage == 3:
            raise ValueError("ZeroEngine.local_grad: stage 3 keeps no full local gradient.")
        i, k = self._unit_of[id(p)]
        s = self.units[i].slots[k]
        return self._grad_buffer(i)[s.offset:s.offset + s.numel].reshape(s.shape)

    def _grad_buffer(self, i: int) -> np.ndarray:
        """Unit i's full local gradient buffer, made (zeros) if it does not exist."""
        if self.g_acc[i] is None:
            self.g_acc[i] = np.zeros(self.units[i].padded, self.dtype)
            self._note_peak("unsharded_grads", sum(g.nbytes for g in self.g_acc
                                                   if g is not None))
        return self.g_acc[i]

    def add_unit_grads(self, i: int, flat: np.ndarray) -> None:
        """Stage 3: one backward's full gradient of unit i -> its buffer; reduce if syncing."""
        if self.g_acc[i] is None:
            self.g_acc[i] = flat                      # take it: bitwise what += gives on 0
        else:
            self.g_acc[i] += flat
        if self._sync:
            self._reduce_unit(i)

    def _reduce_unit(self, i: int) -> None:
        """dw_shard_i += reduce_scatter(sum) of unit i's full buffer; free the buffer."""
        self.shards[i].grad += self._reduce_scatter(self.g_acc[i], i)
        self.g_acc[i] = None

    def _note_peak(self, what: str, nbytes: int) -> None:
        self.peaks[what] = max(self.peaks[what], nbytes)

    # --- collectives ---
    def _rank(self, i: int) -> int:
        """My rank in unit i's group (the dp group; an expert unit's replicas under ep)."""
        return self.unit_groups[i].rank

    def _reduce_scatter(self, flat: np.ndarray, unit: int) -> np.ndarray:
        """My shard of `flat` summed over unit `unit`'s group, and under HSDP over the
        shard's replicas too."""
        shard = C.reduce_scatter(flat, op="sum", group=self.unit_groups[unit],
                                 algo=self.rs_algo)
        if self.replicas is None:
            return shard
        return C.all_reduce(shard, op="sum", group=self.replicas, algo=self.replica_algo)

    def _all_gather(self, x: np.ndarray, async_op: bool = False, unit: int | None = None):
        """Over unit `unit`'s group; over the dp group for the norm (unit None)."""
        group = self.group if unit is None else self.unit_groups[unit]
        return C.all_gather(x, group=group, algo=self.ag_algo, async_op=async_op)

    def gather_async(self, i: int, backward: bool):
        """Stage 3's gather of unit i before a call (forward or backward): the Work of an
        async all_gather of every rank's shard; wait() gives (W, S_u). ZeRO++ overrides it."""
        return self._all_gather(self.shards[i].data, async_op=True, unit=i)

    def gather_unit(self, i: int) -> np.ndarray:
        """COLLECTIVE: unit i's full flat parameters (W S_u,), from every rank's shard."""
        return self._all_gather(self.shards[i].data, unit=i).reshape(-1)


def algorithms(algo: str, group) -> tuple[str, str]:
    """(reduce-scatter, all-gather) algorithms for `algo` on `group`.

    "auto" reduces with "direct" (rank-order sums through shared memory: bitwise equal to
    DDP's) where the group has shared memory, and with "ring" where it has none (the MPI
    transport). All-gathers copy, so their order does not matter: ring unless "halving".
    """
    shared = getattr(group, "supports_shared", False)
    if algo == "direct" and not shared:
        raise ValueError(f"ZeroEngine: algo='direct' sums through shared memory, which group "
                         f"'{getattr(group, 'name', '?')}' does not have (an MPI group?); use "
                         "algo='auto' or 'ring' (or 'halving' on a power-of-two group).")
    rs = ("direct" if shared else "ring") if algo == "auto" else algo
    return rs, algo if algo == "halving" else "ring"


def _check_args(stage, optimizer, algo) -> None:
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeroEngine: stage={stage!r} must be 1 (shard the optimizer state), "
                         "2 (+ gradients) or 3 (+ parameters); 0 is plain data parallelism.")
    if stage == 0:
        raise ValueError("ZeroEngine: stage=0 shards nothing; use parallel.data.DataParallel "
                         "(train.Plan(zero=0) does), or pick stage 1, 2 or 3.")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"ZeroEngine: optimizer={optimizer!r} is unknown; use 'adamw' or 'sgd'.")
    if algo not in ALGOS:
        raise ValueError(f"ZeroEngine: algo={algo!r} has no reduce_scatter; use one of "
                         f"{ALGOS} ('auto' = 'direct', rank order, on shared memory).")
