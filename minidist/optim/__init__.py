"""Optimizers and their helpers: SGD, AdamW, global-norm clipping, the lr schedule.

Each optimizer updates parameters in place and has a pure array function
(`sgd_step`, `adamw_step`) that its class loops over and the GPU kernel is
checked against. DDP and every ZeRO stage run the same classes: ZeRO over
flat shards (parallel/zero/flat.py's FlatShard) instead of whole parameters.
Reading order: optimizer.py, sgd.py, adamw.py, clip.py, schedule.py, config.py (a run's
OptimizerConfig); `make_optimizer` (below) picks one by name.
"""

from minidist.optim.adamw import AdamW, adamw_step
from minidist.optim.clip import clip_grad_norm, clip_to, global_grad_norm
from minidist.optim.config import OptimizerConfig
from minidist.optim.optimizer import Optimizer
from minidist.optim.schedule import lr_at
from minidist.optim.sgd import SGD, sgd_step

__all__ = ["SGD", "AdamW", "sgd_step", "adamw_step", "global_grad_norm", "clip_grad_norm",
           "clip_to", "lr_at", "Optimizer", "OptimizerConfig", "make_optimizer"]


def make_optimizer(name: str, params: list, lr: float, weight_decay: float,
                   betas: tuple[float, float], momentum: float) -> Optimizer:
    """The optimizer called `name` ("adamw" or "sgd") over `params`: what the single
    process, DDP, every ZeRO stage and the fp32 master weights step alike."""
    if name == "adamw":
        return AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "sgd":
        return SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    raise ValueError(f"optimizer={name!r} is unknown; choose 'adamw' or 'sgd'.")
