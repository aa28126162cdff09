"""Single-process training: the ground truth that every parallel layout must reproduce.

One process holds the whole model and reads the whole global batch of every step. Nothing
here knows about ranks, groups or shared memory (it imports nothing from runtime/ or
parallel/), so when a 4-rank layout and this function disagree, the layout is wrong.

One training step (step s, global batch B, M = grad_accum micro-batches of B/M rows):
    1. x, y = data.global_batch(s, B)                        (B, T) each, by sample index
    2. n = number of targets != -100 in the WHOLE global batch
    3. for each micro-batch m: loss_m = sum CE over its tokens / n
                                        + (B/M / B) * aux_m;  loss_m.backward()
       (aux_m: the MoE layers' weighted auxiliary losses, means over routing groups)
       The gradients add up in .grad, so after M micro-batches .grad is the gradient of
       the global-batch loss, sum_m loss_m (not a mean of per-micro-batch means, which
       would weigh a token by how many answer tokens its micro-batch happens to hold).
    4. optional: clip the global gradient norm; set lr from the schedule (optim.lr_at)
    5. optimizer step (AdamW or SGD), zero the gradients.
A dense model gives the same gradients (to rounding) for any M; so does a MoE model whose
routing groups (nn/moe.py: capacity and the aux losses are decided per group of G tokens)
lie inside the micro-batches, i.e. B/M rows hold whole groups.

Determinism: same arguments -> bitwise the same result (the parameters come from
(seed, name), batches from (data seed, step), dropout masks from (seed, step, layer, row);
BLAS should run single-threaded, OMP_NUM_THREADS=1, for run-to-run bitwise equality).

CLI: `python -m minidist train --task sort --steps 300` (see `main`).
Read next: train.py (the per-rank loop that applies a parallel Plan).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from minidist import backend, optim
from minidist.deterministic.layers import determinize
from minidist.deterministic.tree_sum import TreeSum, combine
from minidist.data import DataConfig, SyntheticData
from minidist.nn import GPT, DropoutKey, GPTConfig


@dataclass(frozen=True)
class TrainResult:
    """What a run produced: one entry per step, final parameters and optimizer state."""

    losses: tuple[float, ...]
    grad_norms: tuple[float, ...]           # global gradient norm before clipping
    lrs: tuple[float, ...]
    params: dict[str, np.ndarray]           # full name -> final values
    optimizer_state: dict


def check_compatible(model_cfg: GPTConfig, data_cfg: DataConfig) -> None:
    """ValueError unless the model's vocabulary and context fit the task."""
    if model_cfg.vocab_size < data_cfg.vocab_size or model_cfg.block_size < data_cfg.block_size:
        raise ValueError(
            f"model vocab_size={model_cfg.vocab_size}, block_size={model_cfg.block_size} is too "
            f"small for task {data_cfg.task!r}, which needs vocab_size >= {data_cfg.vocab_size} "
            f"and block_size >= {data_cfg.block_size}; use model_config_for(data_cfg, ...).")


def model_config_for(data_cfg: DataConfig, **overrides) -> GPTConfig:
    """A GPTConfig whose vocab_size and block_size match the task; other fields overridable."""
    fields = dict(vocab_size=data_cfg.vocab_size, block_size=data_cfg.block_size)
    fields.update(overrides)
    return GPTConfig(**fields)


def train_single_process(model_cfg: GPTConfig, data_cfg: DataConfig, *, steps: int,
                         global_batch: int, lr: float, seed: int = 0, grad_accum: int = 1,
                         optimizer: str = "adamw", weight_decay: float = 0.0,
                         betas: tuple[float, float] = (0.9, 0.999), momentum: float = 0.0,
                         clip_grad: float | None = None, warmup_steps: int = 0,
                         lr_schedule: str = "constant", min_lr: float = 0.0,
                         on_step: Callable[[int, float, GPT], None] | None = None,
                         deterministic: bool = False, grain: int = 1,
                         token_tiles: int | None = None) -> TrainResult:
    """Train GPT(model_cfg, seed) on `steps` global batches of `data_cfg`; the ground truth.

    lr_schedule "constant" keeps lr; "cosine" uses optim.lr_at (linear warm-up over
    warmup_steps, cosine decay to min_lr at `steps`). on_step(step, loss, model) is called
    after each optimizer step (progress printing). deterministic: every sample is its own
    micro-batch, and the per-sample gradients and losses are added in the fixed tree of
    minidist/deterministic/tree_sum.py, so the bits depend on no grouping: grad_accum changes nothing,
    and the layouts that do the same (train.py --deterministic) equal this run bit for bit.
    grain (deterministic only): samples per micro-batch (the leaves of the tree are runs of
    `grain` consecutive rows); every layout compared must use the same grain. token_tiles
    (deterministic only): every sum over positions is a tree over runs of T / token_tiles
    of them (what context-parallel layouts need; deterministic/attention.py).
    """
    check_compatible(model_cfg, data_cfg)
    if steps < 0 or grad_accum < 1 or global_batch % grad_accum:
        raise ValueError(f"steps={steps}, global_batch={global_batch}, grad_accum={grad_accum}:"
                         " need steps >= 0 and global_batch a multiple of grad_accum >= 1.")
    if deterministic and (not isinstance(grain, int) or grain < 1 or global_batch % grain):
        raise ValueError(f"grain={grain!r}: the deterministic grain must be an int >= 1 that "
                         f"divides global_batch={global_batch}.")
    if lr_schedule not in ("constant", "cosine"):
        raise ValueError(f"lr_schedule={lr_schedule!r} is unknown; use 'constant' or 'cosine'.")
    model, data = GPT(model_cfg, seed), SyntheticData(data_cfg)
    if deterministic:                        # matmuls over the tiles every layout uses
        determinize(model, token_tiles)
    opt = optim.make_optimizer(optimizer, model.parameters(), lr, weight_decay, betas,
                               momentum)
    losses, norms, lrs = [], [], []
    for step in range(steps):
        opt.lr = lr if lr_schedule == "constant" else optim.lr_at(
            step, lr=lr, warmup_steps=warmup_steps, total_steps=steps, min_lr=min_lr)
        losses.append(_accumulate_canonical(model, data, step, global_batch, seed, grain)
                      if deterministic else
                      _accumulate_gradients(model, data, step, global_batch, grad_accum, seed))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(optim.clip_grad_norm(model.parameters(), clip_grad)
                     if clip_grad is not None
                     else optim.global_grad_norm(grads))
        lrs.append(float(opt.lr))
        opt.step()
        opt.zero_grad()
        if on_step is not None:
            on_step(step, losses[-1], model)
    return TrainResult(losses=tuple(losses), grad_norms=tuple(float(n) for n in norms),
                       lrs=tuple(lrs), params=model.state_dict(),
                       optimizer_state=opt.state_dict())


def _accumulate_gradients(model: GPT, data: SyntheticData, step: int, global_batch: int,
                          grad_accum: int, seed: int) -> float:
    """Backward every micro-batch of `step` into .grad; return the global-batch loss."""
    ids = data.global_indices(step, global_batch)                    # (B,)
    x, y = data.batch(ids)                                           # (B, T) each
    n_tokens = int((y != -100).sum())                                # over the GLOBAL batch
    rows = global_batch // grad_accum
    total = 0.0
    for m in range(grad_accum):
        part = slice(m * rows, (m + 1) * rows)
        key = DropoutKey(seed, step, tuple(int(i) for i in ids[part]))
        _, loss = model(x[part], y[part], n_tokens=n_tokens,
                        aux_weight=rows / global_batch, dropout_key=key)
        loss.backward()
        total += float(loss.item())
    return total


def _accumulate_canonical(model: GPT, data: SyntheticData, step: int, global_batch: int,
                          seed: int, grain: int = 1) -> float:
    """_accumulate_gradients with `grain` samples per micro-batch, whose gradients and losses
    are summed in the aligned tree of tree_sum.py (leaf b: rows b grain .. (b+1) grain - 1)."""
    ids = data.global_indices(step, global_batch)                    # (B,)
    x, y = data.batch(ids)                                           # (B, T) each
    n_tokens = int((y != -100).sum())                                # over the GLOBAL batch
    params = model.parameters()
    grads, losses = TreeSum(), TreeSum()
    leaves = global_batch // grain
    for b in range(leaves):
        rows = slice(b * grain, (b + 1) * grain)
        key = DropoutKey(seed, step, tuple(int(i) for i in ids[rows]))
        _, loss = model(x[rows], y[rows], n_tokens=n_tokens,
                        aux_weight=grain / global_batch, dropout_key=key)
        loss.backward()
        grads.push(b, flat_grads(params))
        losses.push(b, loss.data.astype(np.float64))
        for p in params:
            p.grad = None
    set_flat_grads(params, combine(grads.nodes(), leaves))
    return float(combine(losses.nodes(), leaves))


def flat_grads(params: list) -> np.ndarray:
    """The .grad of params, in order, as one flat array (zeros for a parameter without)."""
    return np.concatenate([(p.grad if p.grad is not None else np.zeros_like(p.data))
                           .reshape(-1) for p in params])


def set_flat_grads(params: list, flat: np.ndarray) -> None:
    """The inverse of flat_grads: each parameter's .grad becomes its slice of flat."""
    at = 0
    for p in params:
        p.grad = flat[at:at + p.data.size].reshape(p.data.shape).copy()
        at += p.data.size


def answer_accuracy(model: GPT, data: SyntheticData, n: int = 64, split: str = "eval"
                    ) -> tuple[float, list[str]]:
    """Greedy-decode the answers of n held-out samples; return (exact-match rate, lines)."""
    c = data.cfg
    samples = [data.sample(i, split) for i in range(n)]
    prompts = np.stack([np.concatenate([p, [c.sep]]) for p, _ in samples])    # (n, L + 1)
    out = model.generate(prompts, c.answer_len)[:, c.prompt_len + 1:]       # (n, A)
    lines = [data.format_example(p, o, a) for (p, a), o in zip(samples, out)]
    hits = sum(np.array_equal(o, a) for (_, a), o in zip(samples, out))
    return hits / n, lines


class CliParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr, `error: ...`, with exit code 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def cli_error(message: object) -> int:
    """Print a user error as one line on stderr, `error: ...`; return exit code 2."""
    print("error: " + " ".join(str(message).split()), file=sys.stderr)
    return 2


def at_least(low: float, kind: type = int) -> Callable[[str], float]:
    """An argparse type: `kind(text)`, refused unless it is >= low."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value >= low:
            raise argparse.ArgumentTypeError(f"must be {'an int' if kind is int else 'a number'}"
                                             f" >= {low}, got {text!r}")
        return value
    return parse


def train_arguments(prog: str) -> argparse.ArgumentParser:
    """The options of `python -m minidist train` (train.py adds the parallel ones)."""
    ap = CliParser(prog=prog, description=main.__doc__)
    ap.add_argument("--task", default="sort", choices=["copy", "reverse", "sort", "add"])
    ap.add_argument("--length", type=int, default=6, help="prompt length (copy/reverse/sort)")
    ap.add_argument("--steps", type=at_least(0), default=300,
                    help="optimizer steps (0 trains nothing and shows no samples)")
    ap.add_argument("--batch", type=at_least(1), default=32, help="global batch (sequences)")
    ap.add_argument("--grad-accum", type=at_least(1), default=1)
    ap.add_argument("--lr", type=at_least(0.0, float), default=3e-3)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=32)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--moe-every", type=int, default=0, help="every k-th block a MoE (0: none)")
    ap.add_argument("--n-experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=1, help="experts per token (MoE)")
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--moe-group-size", type=int, default=0,
                    help="tokens per MoE routing group (0: one sequence)")
    ap.add_argument("--z-loss", type=float, default=0.0, help="router z-loss coefficient")
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                    help="activation recomputation: selective = the attention core, full = "
                         "every block (memory/recompute.py; the same numbers, less memory)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--deterministic", action="store_true",
                    help="bitwise the same parameters and losses under every dp x ZeRO layout "
                         "and micro-batch count: one sample per micro-batch, summed in a "
                         "fixed tree (minidist/deterministic/tree_sum.py)")
    ap.add_argument("--grain", type=int, default=1,
                    help="--deterministic: samples per leaf of the tree (default 1); larger "
                         "is faster, and runs compare bitwise only at the same grain")
    ap.add_argument("--token-tiles", type=int, default=None,
                    help="--deterministic: every sum over positions in a tree over this "
                         "many runs per sequence (context parallelism needs it; runs "
                         "compare bitwise only at the same value)")
    ap.add_argument("--device", type=_device, default=os.environ.get(backend.DEVICE_ENV, ""),
                    help="cpu (NumPy) or gpu (CuPy; needs the 'gpu' extra and a CUDA "
                         f"device); default ${backend.DEVICE_ENV}, else cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=at_least(1), default=25, help="print every N steps")
    return ap


def _device(text: str) -> str:
    """--device (and its default, $MINIDIST_DEVICE): 'cpu' or 'gpu' (backend.parse_device)."""
    try:
        return backend.parse_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def configs_from(a: argparse.Namespace) -> tuple[GPTConfig, DataConfig]:
    """(model config, data config) from parsed train_arguments (ValueError if they make
    no model or no task)."""
    data_cfg = DataConfig(task=a.task, length=a.length, seed=a.seed)
    cfg = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head,
                           moe_every=a.moe_every, n_experts=a.n_experts, top_k=a.top_k,
                           capacity_factor=a.capacity_factor, moe_group_size=a.moe_group_size,
                           z_loss_coef=a.z_loss, dtype=a.dtype, recompute=a.recompute)
    return cfg, data_cfg


def show_samples(cfg: GPTConfig, data_cfg: DataConfig, params: dict[str, np.ndarray]) -> float:
    """Print a few held-out prompts with the trained model's answers; return the accuracy."""
    model = GPT(cfg, seed=None)
    model.load_state_dict(params)
    acc, lines = answer_accuracy(model, SyntheticData(data_cfg))
    print("held-out samples (prompt | model's answer):")
    for line in lines[:6]:
        print("  " + line)
    print(f"exact-match accuracy on 64 held-out prompts: {acc:.0%}")
    return acc


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist train`: train the tiny GPT and show it solving held-out prompts."""
    return run(train_arguments("python -m minidist train").parse_args(argv))


def params_digest(params: dict[str, np.ndarray]) -> str:
    """sha256 over the parameters in the given (model) order: each name, dtype, shape and
    bytes. Two runs with the same digest hold bitwise the same parameters."""
    h = hashlib.sha256()
    for name, value in params.items():
        value = np.ascontiguousarray(value)
        h.update(f"{name} {value.dtype.str} {value.shape}\n".encode())
        h.update(value.tobytes())
    return h.hexdigest()


def run(a: argparse.Namespace) -> int:
    """The main job for parsed train_arguments (train.py passes its own, with more fields).
    Returns the exit code: 2 (one `error:` line on stderr) if the options make no job.
    --steps 0 trains nothing: it says so and shows no samples (an untrained model's answers
    are noise, not a result)."""
    try:
        cfg, data_cfg = configs_from(a)
        backend.use_device(getattr(a, "device", "cpu"))     # one line if there is no GPU
    except ValueError as e:
        return cli_error(e)
    if a.batch % a.grad_accum:
        k = a.grad_accum
        fits = sorted({m for m in (a.batch - a.batch % k, a.batch - a.batch % k + k) if m})
        return cli_error(f"--batch {a.batch} does not split into --grad-accum {k} equal "
                         f"micro-batches; use a multiple of {k}, e.g. "
                         f"{' or '.join(map(str, fits))}, or change --grad-accum.")
    from minidist.observe.peak import peak_flops
    from minidist.observe.progress import Progress
    bar = Progress.for_model(cfg, a.batch, 1, a.steps, peak_flops=peak_flops(cfg.dtype).flops)
    t0 = last = time.perf_counter()

    def progress(step: int, loss: float, model: GPT) -> None:
        nonlocal last
        now = time.perf_counter()
        if step % a.every == 0 or step == a.steps - 1:     # no communication; memory: not
            print(bar.line(step, loss, now - t0, [[now - last, 0.0, 0.0]]),  # measured here
                  flush=True)              # a reader of a pipe (| head) sees each step now
        last = now

    print(f"task {a.task} · GPT {cfg.n_layer} layers, C={cfg.n_embd}, {cfg.dtype} · "
          f"batch {a.batch} · {a.optimizer} lr {a.lr}", flush=True)
    if a.steps == 0:
        print(NOTHING_TRAINED)
        return 0
    result = train_single_process(cfg, data_cfg, steps=a.steps, global_batch=a.batch, lr=a.lr,
                                  seed=a.seed, grad_accum=a.grad_accum, optimizer=a.optimizer,
                                  on_step=progress, deterministic=a.deterministic,
                                  grain=a.grain, token_tiles=a.token_tiles)
    print(bar.summary(time.perf_counter() - t0))
    show_samples(cfg, data_cfg, result.params)
    print(f"params sha256: {params_digest(result.params)}")
    return 0


NOTHING_TRAINED = "--steps 0: nothing to train, so no held-out samples to show."
