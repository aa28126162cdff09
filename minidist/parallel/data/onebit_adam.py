"""1-bit Adam: after a warm-up, data parallelism sends one bit per gradient element.

DDP sums full-precision gradients every step: 2 (W-1)/W Psi numbers of 32 (or 64) bits per
rank. Adam's update divides the momentum by sqrt(v), and v settles early in training; Tang
et al. (2021) freeze it after a warm-up and then communicate only the momentum, compressed
to its signs and one scale, with error feedback so that what the compression drops is
carried to the next step and nothing is lost on average.

One rank's view (rank r of the W dp ranks; every step t after `warmup` steps of plain Adam
on all-reduced gradients, v frozen then as v_hat = v / (1 - b2^warmup)):
    1. local momentum   c_r = b1 m + (1 - b1) W g_r + e_r          (W g_r: the gradient of
                        my rows' mean loss; m: the momentum every rank agreed on; e_r: my
                        worker error)
    2. compress         C(c_r) = s_r sign(c_r), s_r = ||c_r||_2 / sqrt(n);
                        e_r = c_r - C(c_r)                           (error feedback)
    3. all_to_all       rank j receives chunk j of every C(c_r): the signs packed 8 to a
                        byte (np.packbits), and every s_r (an all_gather of W numbers)
    4. server j         a_j = (1/W) sum_r C(c_r)[chunk j] + e'_j; compress it again,
                        e'_j = a_j - C(a_j)                          (server error)
    5. all_gather       every C(a_j): packed signs and scales; m = the concatenation
    6. update           p = p - lr (m / (sqrt(v_hat) + eps) + wd p)
Error feedback makes the compression unbiased over steps: for any sequence x_t,
sum_t C(x_t + e_t) = sum_t x_t - e_T, and e stays bounded (||e|| <= ||x + e|| at every
step), so the compressed sum only lags by the last error (`compress`; tested).

Communication per rank and step after the warm-up: (W-1) n / (8 W) bytes of signs in the
all_to_all and as many in the all_gather, plus 2 (W-1) scales of 8 B: about 1/32 of DDP's
2 (W-1)/W n x 4 B in fp32 (1/64 in float64). The warm-up steps cost DDP's.
Not an exact method: the momentum is a compressed estimate, and the returned norm is that
of this rank's own (scaled) gradient, the global one being unknown. Clipping uses it too.
Reference: Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training with
    Adam's Convergence Speed", arXiv:2102.02888 (Algorithm 1); Seide et al. 2014, "1-bit
    SGD" (error feedback).
Read next: parallel/data/ddp.py (the full-precision sum the warm-up uses).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from minidist import collectives as C
from minidist.nn import Module
from minidist.optim import AdamW, clip_to
from minidist.parallel.engine import ReplicatedEngine


def compress(x: np.ndarray, error: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """(signs as bools, scale, the new error) of x + error: C = scale (2 signs - 1),
    scale = ||x + e||_2 / sqrt(n), new error = x + e - C (step 2 of the module docstring)."""
    c = x + error
    scale = float(np.linalg.norm(c) / math.sqrt(max(c.size, 1)))
    signs = c >= 0
    return signs, scale, c - scale * (2.0 * signs - 1.0)


def decompress(signs: np.ndarray, scale: float) -> np.ndarray:
    return scale * (2.0 * signs - 1.0)


class OneBitAdam(ReplicatedEngine):
    """Adam on all-reduced gradients for `warmup` steps, then 1-bit compressed momentum with
    error feedback (module docstring); the engine interface of parallel/engine.py."""

    def __init__(self, model: Module, group, *, warmup: int, lr: float = 1e-3,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 algo: str = "auto", sharding=None, optimizer: str = "adamw",
                 momentum: float = 0.0) -> None:
        if optimizer != "adamw":
            raise ValueError(f"OneBitAdam: optimizer={optimizer!r}; 1-bit Adam compresses "
                             "Adam's momentum, use optimizer='adamw'.")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"OneBitAdam: warmup={warmup!r} must be an int >= 1 (Adam's "
                             "variance must be estimated before it is frozen).")
        self.model, self.group, self.sharding, self.warmup = model, group, sharding, warmup
        named = list(model.named_parameters())
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.opt = AdamW(self.params, lr, betas=betas, weight_decay=weight_decay)
        shared = getattr(group, "supports_shared", False)
        self.algo = "direct" if algo == "auto" and shared else algo
        self.sizes = [int(p.data.size) for p in self.params]
        n, W = sum(self.sizes), group.size
        self.chunk = -(-n // (8 * W)) * 8                 # elements per server chunk
        self.n, self.padded = n, self.chunk * W
        self.worker_error = np.zeros(self.padded)
        self.server_error = np.zeros(self.chunk)
        self.v_hat: list[np.ndarray] | None = None        # frozen after the warm-up

    # --- what train.py calls (forward and the full state: ReplicatedEngine's; the replicas
    # take the same steps, the momentum every rank uses being the all_gather's) ---
    def step(self, lr: float, clip_grad: float | None = None,
             skip: Callable[[float], bool] | None = None) -> float:
        """A warm-up step (all-reduced gradients, Adam) or a 1-bit step; returns the norm
        (the global one in the warm-up, this rank's scaled one after)."""
        warm = self.opt.t < self.warmup
        W = self.group.size
        grads = self.local_gradients(
            lambda i, g: C.all_reduce(g, op="sum", group=self.group, algo=self.algo)
            if warm else g * W)
        norm = self.grad_norm(grads)
        if warm:
            if self.update(grads, norm, lr, clip_grad, skip) and self.opt.t == self.warmup:
                b2 = self.opt.betas[1]                    # freeze Adam's variance
                self.v_hat = [v / (1.0 - b2 ** self.opt.t) for v in self.opt.v]
        elif skip is None or not skip(norm):
            clip_to(grads, norm, clip_grad)
            self._compressed_step(grads, lr)
        for p in self.params:
            p.grad = None
        return norm

    def _compressed_step(self, grads: list, lr: float) -> None:
        """Steps 1-6 of the module docstring."""
        b1, W, k = self.opt.betas[0], self.group.size, self.chunk
        local = np.zeros(self.padded)
        local[:self.n] = np.concatenate([(b1 * m + (1.0 - b1) * g).reshape(-1)
                                         for m, g in zip(self.opt.m, grads)])
        signs, scale, self.worker_error = compress(local, self.worker_error)
        self.worker_error[self.n:] = 0.0                  # padding carries nothing
        bits = np.packbits(signs)                         # (padded / 8,) uint8
        mine = C.all_to_all(bits, split_sizes=[k // 8] * W, group=self.group,
                            recv_sizes=[k // 8] * W).reshape(W, k // 8)
        scales = C.all_gather(np.array([scale]), group=self.group, algo="ring").reshape(-1)
        avg = sum(decompress(np.unpackbits(mine[r]).astype(bool), scales[r])
                  for r in range(W)) / W
        real = max(0, min(k, self.n - self.group.rank * k))   # my chunk's real elements
        avg[real:] = 0.0
        s_signs, s_scale, self.server_error = compress(avg, self.server_error)
        self.server_error[real:] = 0.0
        every = C.all_gather(np.packbits(s_signs), group=self.group, algo="ring")
        s_scales = C.all_gather(np.array([s_scale]), group=self.group,
                                algo="ring").reshape(-1)
        momentum = np.concatenate([decompress(np.unpackbits(every[j]).astype(bool),
                                              s_scales[j]) for j in range(W)])[:self.n]
        self.opt.t += 1
        eps, wd, offset = self.opt.eps, self.opt.weight_decay, 0
        for p, m, v_hat, size in zip(self.params, self.opt.m, self.v_hat, self.sizes):
            m[...] = momentum[offset:offset + size].reshape(m.shape)
            offset += size
            update = m / (np.sqrt(v_hat) + eps)
            if wd:
                update = update + wd * p.data
            p.data -= lr * update

    def load_full_state(self, params: dict, optimizer_state: dict) -> None:
        """Load parameters and Adam's state; errors reset (a resumed run restarts them)."""
        local, state = self._local_full_state(params, optimizer_state)
        for n, p in zip(self.names, self.params):
            p.data[...] = local[n]
        self.opt.load_state_dict(state)
        self.worker_error[...] = 0.0
        self.server_error[...] = 0.0
        if self.opt.t >= self.warmup:
            b2 = self.opt.betas[1]
            self.v_hat = [v / (1.0 - b2 ** self.warmup) for v in self.opt.v]

    def memory(self) -> dict[str, int]:
        """Parameters, Adam's m and v, the frozen v_hat and the two error buffers."""
        state = sum(int(a.nbytes) for a in self.opt.state_dict().values()
                    if isinstance(a, np.ndarray))
        extra = self.worker_error.nbytes + self.server_error.nbytes + \
            (sum(v.nbytes for v in self.v_hat) if self.v_hat is not None else 0)
        return {"params": sum(int(p.data.nbytes) for p in self.params), "grads": 0,
                "optimizer": state + extra}
