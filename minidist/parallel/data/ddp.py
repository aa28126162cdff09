"""Data parallelism (DDP): W replicas of the model, each on 1/W of every global batch.

Every rank of the dp group holds the whole model and the whole optimizer state. Each step,
rank r reads its own slice of the global batch (rows by global sample index, data.py),
runs forward and backward on it, and the W local gradients are SUMMED across the group
with an all-reduce. Every rank then applies the same optimizer step to the same summed
gradient, so the replicas stay identical without ever exchanging parameters.

Sum, never average: each micro-batch loss is already divided by the number of target
tokens in the WHOLE global batch (gpt.py, baseline.py), so the global-batch loss is the
sum of the local ones and so is its gradient. Dividing by the local token count and then
averaging would weigh a token by how many tokens its rank happened to get.

The algorithm, as this module writes it: a hook on each parameter
(Tensor.register_grad_hook) fires as soon as backward has finished that parameter's
gradient and starts `collectives.all_reduce(p.grad, op="sum", group=dp, async_op=True)`;
backward goes on with the earlier layers while the sum travels (overlap), and step()
waits for the sums. Two details make it right rather than merely plausible:
    - gradient accumulation: inside no_sync() the hook does nothing, so each gradient is
      all-reduced once, in the LAST micro-batch's backward, when .grad already holds the
      sum over all micro-batches;
    - one order on every rank: collectives must be called in the same order everywhere,
      but two ranks' backwards may finish parameters in different orders (a MoE router
      sends their tokens to different experts). So all-reduces start in one fixed order,
      reverse registration (roughly the order backward finishes them): a finished
      gradient waits until every gradient before it in that order has started.
A pipeline stage (parallel/pipeline/stage.py) runs each chunk's last backward outside
no_sync(), so its hooks start the sums during the schedule; hold(p) keeps the tied wte's
sum back until its two stages' shares are added (release(p)).

The fast path, parallel/data/buckets.py: one collective per tensor costs a latency per
parameter and a copy in and out of .grad. data_buckets.BucketedDataParallel, a subclass,
keeps the gradients in a few flat buckets in shared memory (.grad is a view) and sums
each bucket in place, one collective per bucket. Same interface, same bits with algo
"direct" (tests/parallel/data/test_ddp.py trains both paths and compares). The layout picks
the engine (parallel/compose.py: the buckets where the groups have shared memory, this
plain engine under MPI, runtime/mpi.py, or when the plan asks).

One rank's view of one step (M micro-batches):
    1. micro-batches 0..M-2 inside `no_sync()`: forward, backward; .grad accumulates
       locally, no communication.
    2. micro-batch M-1: forward, backward; each finished .grad starts its all-reduce, in
       the fixed order (overlap=False: none starts yet).
    3. step(): start any not started (a parameter without a gradient here sends zeros),
       wait for all, .grad = the sums; global norm, clip, optimizer step; .grad = None.
    4. every K steps (replica_check_every): hash every parameter, all_gather the digests,
       raise ReplicaDivergence naming the ranks and parameters that differ from rank 0.

Shapes and sharding: every parameter w[...] and gradient dw[...] replicated;
activations x[B/W, T, C] split over dp along the batch (under tp, "every parameter" means
this rank's tp shards, and `sharding` makes the norm and full_params global).
Communication: one all_reduce(sum) per parameter on the dp group per step, Ψ gradient
elements in all: 2(W-1)/W Ψ sent per rank with the ring (direct: on average over the
ranks, but a tensor of at most 4 KiB is read whole by every peer, (W-1) n per rank,
collectives/direct_small.py), and one latency per parameter, which the buckets save.
Numerics: algo "auto" on a shared-memory group means "direct": the sum is folded in rank
order, so replicas are bitwise identical and equal to the rank-order fold; the other
algorithms keep replicas bitwise identical too (finished chunks are copied).
A parameter that got no gradient on this rank is summed as zeros (every rank must join each
all-reduce); the GPT has none: a MoE expert without tokens still runs, on 0 rows.
Expert parallelism (parallel/expert/): an expert's gradient is summed over its replicas
only (`group_of`; the fast path gives the experts buckets of their own on that group).

References: Li et al. 2020, "PyTorch Distributed: experiences on accelerating data
    parallel training", arXiv:2006.15704, Sec. 3 (gradient hooks, no_sync, bucketing);
    Goyal et al. 2017, arXiv:1706.02677 (large-batch data parallel SGD).
Read next: parallel/data/buckets.py (the fast path), then parallel/zero/engine.py.
"""

from __future__ import annotations

import hashlib

from typing import Callable

import numpy as np

from minidist import backend
from minidist import collectives as C
from minidist.nn import Module, Parameter
from minidist.optim import clip_to
from minidist.optim import make_optimizer
from minidist.parallel.engine import ReplicatedEngine

ALGOS = ("auto", "direct", "ring", "tree", "halving")


class ReplicaDivergence(RuntimeError):
    """The parameters of some dp ranks differ from rank 0's."""


class DataParallel(ReplicatedEngine):
    """The ZeRO-stage-0 engine of train.py: replicated model, all-reduced gradients.

    The interface is parallel/engine.py's (shared with parallel/zero/engine.py's ZeroEngine);
    data_buckets.BucketedDataParallel is its fast path (a subclass: only the gradient sync
    differs). bucket_bytes sizes the fast path's buckets (the plain path has none).
    """

    def __init__(self, model: Module, group, *, optimizer: str = "adamw", lr: float = 1e-3,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 momentum: float = 0.0, bucket_bytes: int = 1 << 20, algo: str = "auto",
                 overlap: bool = True, replica_check_every: int = 0, sharding=None,
                 group_of: dict | None = None) -> None:
        _check_args(group, bucket_bytes, algo, replica_check_every)
        self.model, self.group, self.algo, self.overlap = model, group, algo, bool(overlap)
        self.sharding, self.replica_check_every = sharding, replica_check_every
        # id(p) -> the group holding p's replicas, where it is not `group` (an expert's:
        # expert parallelism, parallel/expert/expert_parallel.py)
        self.group_of = dict(group_of or {})
        named = list(model.named_parameters())
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.opt = make_optimizer(optimizer, self.params, lr, weight_decay, betas, momentum)
        self.steps = 0
        self._held: set[int] = set()     # ids of parameters whose hook is not final (hold)
        self._setup_gradients(bucket_bytes)
        for p in self.params:
            p.register_grad_hook(self._on_grad_ready)

    # --- the algorithm: one all-reduce per parameter, started by its grad hook ---
    def _setup_gradients(self, bucket_bytes: int) -> None:
        """The fixed launch order (reverse registration) and the algorithm to run."""
        self.order = self.params[::-1]
        self._position = {id(p): i for i, p in enumerate(self.order)}
        shared = getattr(self.group, "supports_shared", False)
        self._algo = "direct" if self.algo == "auto" and shared else self.algo
        self._zero_grads()

    def _on_grad_ready(self, p: Parameter) -> None:
        """Grad hook: p.grad is final for this backward; start what may start, in order."""
        if self._position[id(p)] < len(self._works):       # p.grad is being summed now
            raise RuntimeError(f"{self.group.prefix} DataParallel: a backward reached a "
                               "gradient after its all-reduce started; call step() first, "
                               "and run accumulation backwards inside no_sync().")
        if self._sync and id(p) not in self._held:        # no_sync(): just accumulate
            self._ready.add(id(p))
            if self.overlap:
                self._start_in_order(force=False)

    @property
    def overlaps_backward(self) -> bool:
        return self.overlap

    def hold(self, p: Parameter) -> None:
        self._held.add(id(p))

    def release(self, p: Parameter) -> None:
        """p is ready: its all-reduce starts when those before it in the order have."""
        if self._sync:
            self._ready.add(id(p))
            if self.overlap:
                self._start_in_order(force=False)

    def _start_in_order(self, force: bool) -> None:
        """all_reduce(.grad) of order[k], order[k+1], ... while they are ready (all if
        force): every rank issues the same sequence of collectives."""
        while len(self._works) < len(self.order):
            p = self.order[len(self._works)]
            if not force and id(p) not in self._ready:
                return
            g = p.grad if p.grad is not None else np.zeros_like(p.data)    # unused here
            self._works.append(C.all_reduce(g, op="sum", group=self.group_of.get(
                id(p), self.group), algo=self._algo, async_op=True))

    def _summed_grads(self) -> list:
        """Start what is left, wait for every sum, put it in .grad; return the grads."""
        self._start_in_order(force=True)
        for p, work in zip(self.order, self._works):
            p.grad = work.wait()
        return [p.grad for p in self.params]

    def _zero_grads(self) -> None:
        for p in self.params:
            p.grad = None
        self._ready = set()                     # ids of the parameters whose .grad is final
        self._works = []                        # Work of order[k], in launch order

    def _gradient_bytes(self) -> int:
        return sum(int(p.data.nbytes) for p in self.params)      # one .grad per parameter

    # --- what train.py calls (no_sync() is inherited from Engine) ---
    def step(self, lr: float, clip_grad: float | None = None,
             skip: Callable[[float], bool] | None = None) -> float:
        """Finish the all-reduces, clip by the global norm, update, zero; return the norm.
        skip(norm) True (the same on every rank: reliability/spike.py): zero the gradients
        and leave the parameters and the optimizer as they are."""
        grads = self._summed_grads()
        norm = self.grad_norm(grads)
        if skip is not None and skip(norm):
            self._zero_grads()
            return norm
        clip_to(grads, norm, clip_grad)
        self.opt.lr = lr
        self.opt.step()
        self._zero_grads()
        self.steps += 1
        if self.replica_check_every and self.steps % self.replica_check_every == 0:
            self.check_replicas()
        return norm

    def load_full_state(self, params: dict, optimizer_state: dict) -> None:
        """Every replica keeps its pieces (tp, stage, experts) of the global parameters and
        optimizer state (engine.py); copies only, no communication. Between steps (the
        gradient buffers, plain or buckets, hold nothing then)."""
        local, state = self._local_full_state(params, optimizer_state)
        xp = backend.xp
        for n, p in zip(self.names, self.params):       # in place: views of p.data stay live
            p.data[...] = xp.asarray(local[n])
        self.opt.load_state_dict({k: xp.asarray(v) if isinstance(v, np.ndarray) else v
                                  for k, v in state.items()})

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds: parameters, gradients (during a step), optimizer state."""
        state = self.opt.state_dict()
        return {"params": sum(int(p.data.nbytes) for p in self.params),
                "grads": self._gradient_bytes(),
                "optimizer": sum(int(a.nbytes) for a in state.values()
                                 if isinstance(a, np.ndarray))}

    def check_replicas(self) -> None:
        """COLLECTIVE: raise ReplicaDivergence unless every rank's parameters are bitwise
        rank 0's. Sends one 8-byte BLAKE2b digest per parameter (all_gather)."""
        mine = np.stack([np.frombuffer(hashlib.blake2b(np.ascontiguousarray(
            backend.to_numpy(p.data)).tobytes(), digest_size=8).digest(), np.uint8)
            for p in self.params])                                             # (P, 8)
        every = C.all_gather(mine, group=self.group)                           # (W, P, 8)
        differs = np.any(every != every[0], axis=2)                            # (W, P)
        ranks = [int(r) for r in np.flatnonzero(differs.any(axis=1))]
        if ranks:
            names = [self.names[i] for i in np.flatnonzero(differs.any(axis=0))]
            raise ReplicaDivergence(
                f"{self.group.prefix} after step {self.steps}: the parameters of dp ranks "
                f"{ranks} differ from rank 0's in {names[:5]}{' ...' if len(names) > 5 else ''}"
                f" ({len(names)} of {len(self.names)} tensors). Replicas must stay "
                "bitwise identical: every rank must read the same data order, use the same "
                "seed and reduce gradients with the same algorithm.")


def check_bucket_bytes(bucket_bytes) -> None:
    """ValueError unless bucket_bytes is a positive int (data_buckets.plan_buckets too)."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)) \
            or bucket_bytes <= 0:
        raise ValueError(f"DataParallel: bucket_bytes={bucket_bytes!r} must be a positive int "
                         "(bytes of gradients per all-reduce), e.g. 1 << 20 for 1 MiB.")


def _check_args(group, bucket_bytes, algo: str, replica_check_every) -> None:
    check_bucket_bytes(bucket_bytes)
    if algo not in ALGOS:
        raise ValueError(f"DataParallel: algo={algo!r} is unknown; use one of {ALGOS}.")
    if algo == "direct" and not getattr(group, "supports_shared", False):
        raise ValueError(f"DataParallel: algo='direct' reads the peers' memory, but group "
                         f"'{getattr(group, 'name', '?')}' has no shared memory (MPI?); use "
                         "algo 'auto', 'ring', 'tree' or 'halving'.")
    if isinstance(replica_check_every, bool) or not isinstance(replica_check_every, int) \
            or replica_check_every < 0:
        raise ValueError(f"DataParallel: replica_check_every={replica_check_every!r} must "
                         "be an int >= 0 (0 = never check).")
