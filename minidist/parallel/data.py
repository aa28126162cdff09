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

Buckets and overlap (Li et al. 2020). The parameters, in reverse registration order
(roughly the order backward finishes them), are packed into flat buckets of at most
`bucket_bytes` (a larger parameter gets a bucket of its own). Each bucket is a
group.shared() region, and each parameter's `.grad` is a VIEW into its bucket, so the
autograd's `.grad += g` writes straight into shared memory and the all-reduce needs no
copy (collectives/direct.py, all_reduce_shared). A hook on each parameter
(Tensor.register_grad_hook) counts the finished gradients of its bucket; when a bucket is
complete, its all-reduce goes to the group's worker thread while backward continues with
the next layers. Buckets are launched strictly in bucket order, so every rank issues the
same sequence of collectives even if its backward finishes them in another order.

One rank's view of one step (M micro-batches):
    1. micro-batches 0..M-2 inside `no_sync()`: forward, backward; gradients accumulate
       in the buckets, no communication.
    2. micro-batch M-1: forward, backward; each completed bucket starts its all-reduce
       (overlap=False: none starts yet).
    3. step(): start any bucket not started, wait for all, clip, optimizer step, zero.
    4. every K steps (replica_check_every): hash every parameter, all_gather the digests,
       raise ReplicaDivergence naming the ranks and parameters that differ from rank 0.

Shapes and sharding: every parameter w[...] and gradient dw[...] replicated;
activations x[B/W, T, C] split over dp along the batch.
Communication: one all_reduce(sum) per bucket on the dp group per step: Ψ gradient
elements in all, 2(W-1)/W Ψ sent per rank (direct: on average over ranks; ring: per rank
when each bucket divides by W). Numerics: with algo "direct"/"auto" the sum is folded in
rank order, so replicas are bitwise identical and equal to a canonical fold; with the
other algorithms replicas are still bitwise identical (finished chunks are copied).
Limitation: a parameter that gets no gradient on any rank (an unused MoE expert) is
stepped with a zero gradient here, where baseline.py skips it.

References: Li et al. 2020, "PyTorch Distributed: experiences on accelerating data
    parallel training", arXiv:2006.15704, Sec. 3.2 (bucketing, overlap, no_sync);
    Goyal et al. 2017, arXiv:1706.02677 (large-batch data parallel SGD).
Read next: parallel/zero.py (shard the optimizer state, gradients and parameters).
"""

from __future__ import annotations

import hashlib
import time
import weakref

import numpy as np

from minidist import backend
from minidist import collectives as C
from minidist.baseline import make_optimizer
from minidist.collectives import direct
from minidist.nn import Module, Parameter
from minidist.optim import clip_to
from minidist.parallel.engine import Engine

ALGOS = ("auto", "direct", "ring", "tree", "halving")
# DataParallel engines made on each group so far: every rank makes them in the same order,
# so engine n's buckets get the same shared() tags everywhere and never reuse another's.
_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ReplicaDivergence(RuntimeError):
    """The parameters of some dp ranks differ from rank 0's."""


def plan_buckets(params: list[Parameter], bucket_bytes: int) -> list[list[int]]:
    """Indices into `params`, in reverse order, cut into buckets of <= bucket_bytes bytes.

    A bucket also ends where the dtype changes (a bucket is one flat array); a parameter
    bigger than bucket_bytes gets a bucket of its own.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)) \
            or bucket_bytes <= 0:
        raise ValueError(f"DataParallel: bucket_bytes={bucket_bytes!r} must be a positive int "
                         "(bytes of gradients per all-reduce), e.g. 1 << 20 for 1 MiB.")
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i in reversed(range(len(params))):
        nbytes, dt = params[i].data.nbytes, params[i].dtype
        if not buckets or dt != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, dt
        buckets[-1].append(i)
        size += nbytes
    return [b for b in buckets if b]


class _Bucket:
    """One flat gradient buffer in shared memory and the parameters whose .grad views it."""

    def __init__(self, index: int, params: list[Parameter], group, tag: str) -> None:
        self.index, self.params, self.dtype = index, params, np.dtype(params[0].dtype)
        self.count = sum(int(p.size) for p in params)
        self.region = group.shared(f"{tag}/bucket{index}", self.count * self.dtype.itemsize)
        self.flat = self.region.local(self.dtype, self.count)          # (N_bucket,)
        self.views, start = [], 0
        for p in params:
            self.views.append(self.flat[start:start + p.size].reshape(p.shape))
            start += p.size
        self.ready, self.work = 0, None


class DataParallel(Engine):
    """The stage-0 engine of train.py: replicated model, bucketed async all-reduce.

    The interface is parallel/engine.py's (shared with parallel/zero.py's ZeroEngine).
    """

    def __init__(self, model: Module, group, *, optimizer: str = "adamw", lr: float = 1e-3,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 momentum: float = 0.0, bucket_bytes: int = 1 << 20, algo: str = "auto",
                 overlap: bool = True, replica_check_every: int = 0, sharding=None) -> None:
        if algo not in ALGOS:
            raise ValueError(f"DataParallel: algo={algo!r} is unknown; use one of {ALGOS}.")
        if isinstance(replica_check_every, bool) or not isinstance(replica_check_every, int) \
                or replica_check_every < 0:
            raise ValueError(f"DataParallel: replica_check_every={replica_check_every!r} must "
                             "be an int >= 0 (0 = never check).")
        self.model, self.group, self.algo, self.overlap = model, group, algo, bool(overlap)
        self.sharding = sharding
        self.replica_check_every = replica_check_every
        named = list(model.named_parameters())
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.opt = make_optimizer(optimizer, self.params, lr, weight_decay, betas, momentum)
        n = _engines[group] = _engines.get(group, -1) + 1      # same count on every rank
        self.buckets = [_Bucket(i, [self.params[j] for j in idx], group, f"ddp{n}")
                        for i, idx in enumerate(plan_buckets(self.params, bucket_bytes))]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._view_of = {id(p): v for b in self.buckets for p, v in zip(b.params, b.views)}
        for p in self.params:
            p.register_grad_hook(self._on_grad_ready)
        self._sync, self._next, self.steps, self.comm_wait_s = True, 0, 0, 0.0
        self._zero_grads()

    # --- what train.py calls (no_sync() is inherited from Engine) ---
    def forward(self, idx, targets, *, n_tokens: int, aux_weight: float = 1.0,
                dropout_key=None):
        """(logits, loss) of the local replica; nothing to communicate in the forward."""
        return self.model(idx, targets, n_tokens=n_tokens, aux_weight=aux_weight,
                          dropout_key=dropout_key)

    def step(self, lr: float, clip_grad: float | None = None) -> float:
        """Finish the all-reduces, clip, update, zero the buckets; return the global norm."""
        t0 = time.perf_counter()
        self._launch_in_order(force=True)
        for b in self.buckets:
            result = None if b.work is None else b.work.wait()
            if result is not None:                 # a copying algorithm: write the sum back
                b.flat[...] = result.reshape(-1)
        self.comm_wait_s = time.perf_counter() - t0
        for p in self.params:
            if p.grad is not self._view_of[id(p)]:
                raise RuntimeError(f"{self.group.prefix} DataParallel: the .grad of a "
                                   "parameter was replaced; do not call zero_grad() or assign "
                                   ".grad yourself, step() zeroes the buckets.")
        grads = [p.grad for p in self.params]
        norm = self._norm(self.sharding.grad_sq(grads) if self.sharding is not None
                          else sum(float(g.reshape(-1) @ g.reshape(-1)) for g in grads))
        clip_to(grads, norm, clip_grad)
        self.opt.lr = lr
        self.opt.step()
        self._zero_grads()
        self.steps += 1
        if self.replica_check_every and self.steps % self.replica_check_every == 0:
            self.check_replicas()
        return norm

    def full_params(self) -> dict[str, np.ndarray]:
        """{name: full values}: every dp replica holds them (gathered over tp if sharded)."""
        return self._global_params({n: backend.to_numpy(p.data).copy()
                                    for n, p in zip(self.names, self.params)})

    def full_optimizer_state(self) -> dict:
        """The optimizer's state_dict(), the layout baseline.py returns (gathered over tp)."""
        return self._global_state(self.opt.state_dict())

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds: parameters, gradient buckets, optimizer state."""
        state = self.opt.state_dict()
        return {"params": sum(int(p.data.nbytes) for p in self.params),
                "grads": sum(b.flat.nbytes for b in self.buckets),
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

    # --- buckets ---
    def _on_grad_ready(self, p: Parameter) -> None:
        """Grad hook: count p's bucket; start every bucket that is complete, in order."""
        b = self._bucket_of[id(p)]
        if b.index < self._next:                   # its region is being reduced right now
            raise RuntimeError(f"{self.group.prefix} DataParallel: a backward reached "
                               f"bucket {b.index} after its all-reduce started; call step() "
                               "first, and run accumulation backwards inside no_sync().")
        if not self._sync:
            return
        b.ready += 1
        if self.overlap and b.ready == len(b.params):
            self._launch_in_order(force=False)

    def _launch_in_order(self, force: bool) -> None:
        """Start buckets _next, _next+1, ... while they are complete (all of them if force)."""
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if not force and b.ready < len(b.params):
                return
            b.work = self._all_reduce_async(b)
            self._next += 1

    def _all_reduce_async(self, b: _Bucket):
        """Work for the sum of bucket b over the group: in place (direct) or a copy (others);
        None on a group of one rank, where the local gradient already is the sum."""
        g = self.group
        if g.size == 1:
            return None
        if self.algo in ("auto", "direct"):
            def run():
                with g.collective("all_reduce", b.flat, reduce_op="sum", algo="direct"):
                    direct.all_reduce_shared(b.region, b.dtype, b.count, g, "sum")
            return g.submit(run)
        return C.all_reduce(b.flat, op="sum", group=g, algo=self.algo, async_op=True)

    def _zero_grads(self) -> None:
        for b in self.buckets:
            b.flat[...] = 0
            b.ready, b.work = 0, None
            for p, view in zip(b.params, b.views):
                p.grad = view
        self._next = 0
