"""Elastic training: lose a rank, go on with fewer; get it back, grow again.

    python -m minidist train --dp 4 --batch 12 --checkpoint-dir D --checkpoint-every 2 \
        --max-restarts 2 --elastic --rejoin-after 3 --inject sigkill:rank=3:step=4

A restart (reliability/recovery.py) assumes the failed rank's machine comes back. When it
does not, waiting for it wastes the whole job; an elastic job continues on the ranks it
still has. Here the unit that shrinks is the data-parallel axis: a job of dp replicas
(each tp x cp x pp ranks) goes on with dp - 1 of them, from the latest checkpoint.

Why this is exact. A checkpoint holds the global state, not one layout's shards
(reliability/checkpoint.py), and every layout loads it (engine.load_full_state). The
global batch B stays B: with dp - 1 replicas each takes B / (dp - 1) rows of it instead of
B / dp (the same micro-batch count, bigger micro-batches), and since the loss is divided
by the token count of the whole global batch (train.py), the gradient is the same sum of
the same per-token terms. What changes is only the grouping of that sum (other partial
sums per rank), so the run equals the reference within rounding: ~1e-16 per step in
float64, tested within 1e-12 after a shrink and a grow. (Bitwise only if the reduction
order were independent of the layout, as issue 14's deterministic mode will make it.)

One launcher's view (`Elastic`, driven by recovery.supervise):
    1. a rank fails: `shrink` picks Plan(dp - 1) if it is a valid layout for this model
       and batch (B divisible by (dp - 1) x micro-batches, ep dividing dp - 1, ...) and
       dp - 1 >= 1, else keeps the layout (a plain restart);
    2. the shrunk job runs from the latest checkpoint to step resume + rejoin_after (the
       capacity returns then), saves a checkpoint there and stops (`stop`);
    3. `grow`: the next attempt runs the original Plan from that checkpoint to the end.
Without --rejoin-after the shrunk job runs to the end.

Reference: TorchElastic (torchrun --nnodes MIN:MAX), whose rendezvous restarts the job on
the nodes that are left; ElasWave / Oobleck-style resharding is beyond this.
Read next: reliability/recovery.py
"""

from __future__ import annotations

from dataclasses import replace


class Elastic:
    """The launcher's elastic state: the `plan` the next attempt runs and the step it
    stops at (`stop`), the original plan, and how many steps a lost replica stays lost."""

    def __init__(self, plan, cfg, global_batch: int, seq_len: int, steps: int,
                 rejoin_after: int | None):
        if rejoin_after is not None and rejoin_after < 1:
            raise ValueError(f"--rejoin-after {rejoin_after}: must be >= 1 (steps)")
        self.full, self.plan, self.stop = plan, plan, steps
        self.cfg, self.batch, self.seq_len, self.steps = cfg, global_batch, seq_len, steps
        self.rejoin_after = rejoin_after

    def shrink(self, resume_step: int) -> str:
        """A rank failed and the job resumes at `resume_step`: go on with one replica less
        if that layout is valid (see the module docstring); returns the log line."""
        dp = self.plan.dp - 1
        if dp < 1:
            return f"elastic: dp={self.plan.dp} cannot shrink; restarting at the same size"
        smaller = replace(self.plan, dp=dp)
        try:
            smaller.validate(self.cfg, self.batch, self.seq_len)
        except ValueError as e:
            return (f"elastic: cannot continue on dp={dp} ({str(e).splitlines()[0]}); "
                    "restarting at the same size")
        old, self.plan = self.plan, smaller
        self.stop = self.steps if self.rejoin_after is None else \
            min(self.steps, resume_step + self.rejoin_after)
        back = "" if self.stop == self.steps else f", until step {self.stop} (capacity returns)"
        return (f"elastic: a replica is lost: continuing on dp={dp} ({smaller.world_size} ranks, "
                f"was {old.world_size}) from step {resume_step}{back}; global batch {self.batch} "
                f"kept: {self.batch // dp} rows per replica instead of {self.batch // old.dp}")

    def grow(self) -> str:
        """The shrunk job reached `stop`: the next attempt runs the original layout."""
        line = (f"elastic: capacity is back at step {self.stop}: growing from dp={self.plan.dp} "
                f"to dp={self.full.dp} ({self.full.world_size} ranks)")
        self.plan, self.stop = self.full, self.steps
        return line
