"""OptimizerConfig: how a run updates its parameters, in one place.

The single process, DDP, every ZeRO stage and the fp32 master weights build the same
optimizer from it (`make_optimizer`), and the training loop asks it for the learning rate
of each step (`lr_at`: constant, or schedule.py's warm-up and cosine decay).
Read next: optim/schedule.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.optim.schedule import lr_at

SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer ("adamw" or "sgd") and its hyper-parameters; clip_grad: the global
    gradient norm's limit (None: no clipping); lr_schedule "constant" keeps lr, "cosine"
    warms up over warmup_steps and decays to min_lr at the run's last step."""

    lr: float
    name: str = "adamw"
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.0
    clip_grad: float | None = None
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"optimizer={self.name!r} is unknown; choose 'adamw' or 'sgd'.")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} is unknown; use one of "
                             f"{SCHEDULES}.")

    def engine_arguments(self) -> dict:
        """What an engine (parallel/) takes to build its optimizer."""
        return dict(optimizer=self.name, lr=self.lr, weight_decay=self.weight_decay,
                    betas=self.betas, momentum=self.momentum)

    def lr_at(self, step: int, total_steps: int) -> float:
        """The learning rate of global step `step` of a run of total_steps steps."""
        if self.lr_schedule == "constant":
            return self.lr
        return lr_at(step, lr=self.lr, warmup_steps=self.warmup_steps,
                     total_steps=total_steps, min_lr=self.min_lr)
