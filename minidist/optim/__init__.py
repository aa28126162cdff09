"""Optimizers and their helpers: SGD, AdamW, global-norm clipping, the lr schedule.

Each optimizer updates parameters in place and has a pure array function
(`sgd_step`, `adamw_step`) that its class loops over and the GPU kernel is
checked against. DDP and every ZeRO stage run the same classes: ZeRO over
flat shards (parallel/flat.py's FlatShard) instead of whole parameters.
Reading order: optimizer.py, sgd.py, adamw.py, clip.py, schedule.py.
"""

from minidist.optim.adamw import AdamW, adamw_step
from minidist.optim.clip import clip_grad_norm, clip_to, global_grad_norm
from minidist.optim.optimizer import Optimizer
from minidist.optim.schedule import lr_at
from minidist.optim.sgd import SGD, sgd_step

__all__ = ["SGD", "AdamW", "sgd_step", "adamw_step", "global_grad_norm", "clip_grad_norm",
           "clip_to", "lr_at", "Optimizer"]
