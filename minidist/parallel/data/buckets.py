"""Data parallelism, fast path: gradients in shared-memory buckets, summed in place.

parallel/data/ddp.py is the algorithm: one all_reduce(.grad) per parameter, started by a grad
hook, waited for in step(). This module is the same engine made cheaper, for a group that
has shared memory (the spawn runtime; not MPI); parallel/compose.py picks it there.
It changes HOW the sum travels, never WHICH numbers are added in which order: with algo
"direct" (or "auto") both paths fold every element in rank order 0..W-1, so they give the
same bits (tests/parallel/data/test_ddp.py trains both and compares).

What the plain path pays, and what this one does instead (Li et al. 2020, Sec. 3.2):
    1. one collective per tensor: a latency per parameter (two barriers, or 2(W-1)
       messages), even for a LayerNorm bias of C numbers.
       -> The parameters, in reverse registration order (roughly the order backward
          finishes them), are packed into flat buckets of at most `bucket_bytes` (a larger
          parameter gets a bucket of its own; a dtype change ends a bucket): one
          all-reduce per bucket.
    2. a copy of every gradient into the collective and the sum back into .grad.
       -> Each bucket is a group.shared() region and each parameter's .grad is a VIEW
          into it, so the autograd's `.grad += g` writes straight into shared memory and
          collectives/direct.py's all_reduce_shared sums the region in place, reading the
          peers' regions: no copy in, no copy out.
A hook on each parameter counts the finished gradients of its bucket; a complete bucket's
all-reduce goes to the group's worker thread while backward continues. Buckets start
strictly in bucket order, so every rank issues the same sequence of collectives.
Under expert parallelism (`group_of`) a bucket holds the parameters of one group: the
experts' buckets are summed over the experts' replicas, the others over the whole group.

One rank's view of one step (M micro-batches):
    1. micro-batches 0..M-2 inside no_sync(): gradients accumulate in the buckets.
    2. micro-batch M-1: each completed bucket starts all_reduce_shared (overlap=False:
       none starts yet); a backward reaching a bucket already being reduced is refused.
    3. step(): start any bucket not started, wait; then ddp.py's step (norm, clip,
       update, replica check); zero the buckets and point every .grad at its view again.

Shapes: bucket b is a flat (N_b,) array; .grad of parameter i is flat[o_i:o_i + n_i]
reshaped to w_i's shape. Communication: one all_reduce(sum) per bucket on the dp group,
Ψ elements in all, 2(W-1)/W Ψ per rank (direct: on average over ranks). Other algorithms
(ring, tree, halving) take a bucket through collectives.all_reduce and copy the sum back.

Reference: Li et al. 2020, "PyTorch Distributed: experiences on accelerating data parallel
    training", arXiv:2006.15704, Sec. 3.2 (gradient bucketing, overlap, no_sync).
Read next: collectives/direct.py (all_reduce_shared), then parallel/zero/engine.py.
"""

from __future__ import annotations

import weakref

import numpy as np

from minidist import collectives as C
from minidist.collectives import direct
from minidist.nn import Parameter
from minidist.parallel.data.ddp import DataParallel, check_bucket_bytes

# Bucketed engines made on each group so far: every rank makes them in the same order, so
# engine n's buckets get the same shared() tags everywhere and never reuse another's.
_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_buckets(params: list[Parameter], bucket_bytes: int,
                 groups: list | None = None) -> list[list[int]]:
    """Indices into `params`, in reverse order, cut into buckets of <= bucket_bytes bytes.

    A bucket also ends where the dtype changes (a bucket is one flat array) or, given
    `groups` (the group summing each parameter), where the group changes (a bucket is one
    collective); a parameter bigger than bucket_bytes gets a bucket of its own.
    """
    check_bucket_bytes(bucket_bytes)
    groups = [None] * len(params) if groups is None else groups
    buckets: list[list[int]] = []
    size, kind = 0, None
    for i in reversed(range(len(params))):
        nbytes, k = params[i].data.nbytes, (params[i].dtype, id(groups[i]))
        if not buckets or k != kind or size + nbytes > bucket_bytes:
            buckets.append([])
            size, kind = 0, k
        buckets[-1].append(i)
        size += nbytes
    return [b for b in buckets if b]


class _Bucket:
    """One flat gradient buffer in shared memory, the parameters whose .grad views it, and
    the group that sums it."""

    def __init__(self, index: int, params: list[Parameter], group, tag: str) -> None:
        self.index, self.params, self.dtype = index, params, np.dtype(params[0].dtype)
        self.group = group
        self.count = sum(int(p.size) for p in params)
        self.region = group.shared(f"{tag}/bucket{index}", self.count * self.dtype.itemsize)
        self.flat = self.region.local(self.dtype, self.count)          # (N_bucket,)
        self.views, start = [], 0
        for p in params:
            self.views.append(self.flat[start:start + p.size].reshape(p.shape))
            start += p.size
        self.ready, self.work = 0, None


class BucketedDataParallel(DataParallel):
    """DataParallel with its gradients in shared-memory buckets (see the module docstring).

    Same constructor and interface as DataParallel; the group must have shared memory.
    Only the gradient sync below differs.
    """

    def __init__(self, model, group, **kwargs) -> None:
        for g in dict.fromkeys([group, *(kwargs.get("group_of") or {}).values()]):
            if not getattr(g, "supports_shared", False):
                raise ValueError(f"BucketedDataParallel: group '{getattr(g, 'name', '?')}' "
                                 "has no shared memory (MPI?), where its buckets live; use "
                                 "the plain DataParallel there.")
        super().__init__(model, group, **kwargs)

    def _setup_gradients(self, bucket_bytes: int) -> None:
        """Cut the parameters into buckets, each a shared region of the group that sums
        it; .grad views into them."""
        groups = [self.group_of.get(id(p), self.group) for p in self.params]
        tag = {}
        for g in dict.fromkeys(groups):                     # each group, in first-use order
            n = _engines[g] = _engines.get(g, -1) + 1       # the same on every member
            tag[g] = f"ddp{n}"
        self.buckets = []
        for i, idx in enumerate(plan_buckets(self.params, bucket_bytes, groups)):
            g = groups[idx[0]]
            self.buckets.append(_Bucket(i, [self.params[j] for j in idx], g, tag[g]))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._view_of = {id(p): v for b in self.buckets for p, v in zip(b.params, b.views)}
        self._zero_grads()

    def _on_grad_ready(self, p: Parameter) -> None:
        """Grad hook: count p's bucket; start every bucket that is complete, in order."""
        b = self._bucket_of[id(p)]
        if b.index < self._next:                   # its region is being reduced right now
            raise RuntimeError(f"{self.group.prefix} DataParallel: a backward reached "
                               f"bucket {b.index} after its all-reduce started; call step() "
                               "first, and run accumulation backwards inside no_sync().")
        if not self._sync or id(p) in self._held:
            return
        self._count(b)

    def release(self, p: Parameter) -> None:
        """p is ready: its bucket starts when complete and those before it have."""
        if self._sync:
            self._count(self._bucket_of[id(p)])

    def _count(self, b: _Bucket) -> None:
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
        g = b.group
        if g.size == 1:
            return None
        if self.algo in ("auto", "direct"):
            def run():
                with g.collective("all_reduce", b.flat, reduce_op="sum", algo="direct"):
                    direct.all_reduce_shared(b.region, b.dtype, b.count, g, "sum")
            return g.submit(run)
        return C.all_reduce(b.flat, op="sum", group=g, algo=self.algo, async_op=True)

    def _summed_grads(self) -> list:
        """Start what is left, wait for every bucket; the .grad views now hold the sums."""
        self._launch_in_order(force=True)
        for b in self.buckets:
            result = None if b.work is None else b.work.wait()
            if result is not None:                 # a copying algorithm: write the sum back
                b.flat[...] = result.reshape(-1)
        for p in self.params:
            if p.grad is not self._view_of[id(p)]:
                raise RuntimeError(f"{self.group.prefix} DataParallel: the .grad of a "
                                   "parameter was replaced; do not call zero_grad() or assign "
                                   ".grad yourself, step() zeroes the buckets.")
        return [p.grad for p in self.params]

    def _zero_grads(self) -> None:
        """Zero every bucket and point each .grad at its view again."""
        for b in self.buckets:
            b.flat[...] = 0
            b.ready, b.work = 0, None
            for p, view in zip(b.params, b.views):
                p.grad = view
        self._next = 0

    def _gradient_bytes(self) -> int:
        return sum(b.flat.nbytes for b in self.buckets)
