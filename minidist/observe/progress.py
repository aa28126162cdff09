"""The main job's progress: one line every few steps, a bar, and a summary table at the end.

`python -m minidist train` prints, every `--every` steps (and at the last one), one line:

    step   40 | loss 1.2345 |   3.1 s | 35.2k tok/s | MFU  2.1% | comm 12% | mem 1.20 MB max | ETA 12 s [####------] 41%

    loss         the global loss of that step (every rank's share added)
    s            wall seconds since the job started
    tok/s        tokens trained per second over the steps since the previous line (the window)
    MFU          model FLOPs utilisation over the window: model FLOPs of the steps (6N + 12LHQT
                 per token, N every parameter: observe/throughput.model_flops_per_token, the
                 convention of every MFU printed) / (window seconds x peak FLOP/s x ranks)
    comm         the share of the printed step's time that the ranks spent communicating
                 (their mean of comm_wait / step, RankResult.timing): the seconds each rank
                 spent inside calls on every group of its layout (dp, tp, cp, ep, the
                 experts' dp, pp's links, the tied embedding's and the gradient norm's
                 groups), each call counted once on its own group (runtime/group.py: a
                 synchronous call, or waiting in Work.wait() or for the group's queue; an
                 async call running behind compute is not counted). Under pp a stage
                 waiting for its neighbour, the bubble, counts too
    mem          the largest memory over the ranks, as each rank measured it: with
                 --device-memory the ledger's peak of that step (memory/ledger.py: every
                 array, activations included), else the engine's model state (parameters,
                 gradients, optimizer state, ZeRO's gathered and unsharded buffers' peaks);
                 left out when nothing was measured
    ETA          steps left x the window's seconds per step; then a 10-character bar

The first three fields are those of the single-process baseline's line, so anything that
reads `step N | loss X | T s` reads this one too. At the end, `summary` gives a table:
steps, wall time, tokens/s and MFU over the whole run (the first step, which pays for
warm-up, left out when there are more), the mean communication share, and each rank's peak
memory.

One rank's view: rank 0 keeps the Progress; train_cli.py gathers the per-rank numbers of a
printed step ([step seconds, comm wait, peak bytes] per rank, one all_gather on the world
group only at printed steps) and hands them to `line`. Nothing here communicates.

References: Chowdhery et al. 2022, "PaLM", arXiv:2204.02311, App. B (MFU).
Read next: observe/throughput.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minidist.observe.throughput import mfu as utilisation, model_flops_per_token

BAR = 10                                       # characters of the progress bar


def human(n: float, unit: str = "") -> str:
    """1234 -> '1.23k', 1.5e6 -> '1.50M': three significant digits and an SI prefix."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{prefix}{unit}"
    return f"{n:.3g}{unit}"


def megabytes(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def seconds(s: float) -> str:
    """A duration for the ETA: '42 s', '3.5 min', '2.1 h'."""
    if not np.isfinite(s):
        return "?"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


@dataclass
class Progress:
    """Rank 0's account of the run: `line` at printed steps, `summary` at the end.

    total_steps: the run's last step + 1; start_step: the first step this process runs (a
    resumed run starts later); tokens_per_step: global batch x sequence length;
    flops_per_step: model FLOPs of one step (0: no MFU column); peak_flops: one rank's peak
    FLOP/s (0: no MFU column); ranks: how many ranks share the work."""

    total_steps: int
    tokens_per_step: int
    ranks: int
    flops_per_step: float = 0.0
    peak_flops: float = 0.0
    start_step: int = 0
    samples: list = field(default_factory=list)       # (step, elapsed, comm share, peaks)
    _last: tuple[int, float] | None = None            # (step, elapsed) of the previous line

    @classmethod
    def for_model(cls, cfg, batch: int, ranks: int, total_steps: int, start_step: int = 0,
                  peak_flops: float = 0.0) -> "Progress":
        """The Progress of training GPTConfig `cfg` on `batch` sequences of cfg.block_size
        tokens a step: model FLOPs per step = tokens x (6N + 12LHQT), N every parameter
        (observe/throughput.model_flops_per_token, the one MFU convention; none for a MoE
        model)."""
        tokens = batch * cfg.block_size
        flops = 0.0 if cfg.moe_every else float(tokens * model_flops_per_token(cfg))
        return cls(total_steps, tokens, ranks, flops, peak_flops, start_step)

    def __post_init__(self) -> None:
        if self.total_steps < 0 or self.tokens_per_step < 1 or self.ranks < 1:
            raise ValueError(f"Progress: total_steps={self.total_steps} must be >= 0, "
                             f"tokens_per_step={self.tokens_per_step} and ranks={self.ranks} "
                             f">= 1")

    def line(self, step: int, loss: float, elapsed: float, per_rank: np.ndarray) -> str:
        """The line of step `step` (0-based), `elapsed` wall seconds into the job, and
        per_rank (W, 3): each rank's [step seconds, comm wait seconds, peak bytes]."""
        per_rank = np.asarray(per_rank, dtype=np.float64).reshape(-1, 3)
        share = float(np.mean(per_rank[:, 1] / np.maximum(per_rank[:, 0], 1e-12)))
        prev_step, prev_t = self._last or (self.start_step - 1, 0.0)
        done, window = step - prev_step, elapsed - prev_t
        self._last = (step, elapsed)
        self.samples.append((step, elapsed, share, per_rank[:, 2].copy()))
        rate = done / window if window > 0 else float("nan")           # steps per second
        fields = [f"step {step:4d}", f"loss {loss:.4f}", f"{elapsed:5.1f} s",
                  f"{human(rate * self.tokens_per_step)} tok/s"]
        mfu = self.mfu(rate)
        if mfu is not None:
            fields.append(f"MFU {100 * mfu:4.1f}%")
        fields.append(f"comm {100 * share:.0f}%")
        if per_rank[:, 2].max() > 0:                  # 0: this run does not measure memory
            fields.append(f"mem {megabytes(per_rank[:, 2].max())} max")
        left = self.total_steps - step - 1
        frac = (step + 1) / self.total_steps if self.total_steps else 1.0
        bar = "#" * round(BAR * frac) + "-" * (BAR - round(BAR * frac))
        fields.append(f"ETA {seconds(left / rate) if left else '0 s'} [{bar}] {100 * frac:.0f}%")
        return " | ".join(fields)

    def mfu(self, steps_per_second: float) -> float | None:
        """Model FLOPs utilisation at this rate, or None without flops or a peak."""
        if not (self.flops_per_step > 0 and self.peak_flops > 0):
            return None
        return utilisation(self.flops_per_step * steps_per_second, 1.0, self.peak_flops,
                           self.ranks)

    def summary(self, elapsed: float) -> str:
        """The table printed after the last step: whole-run rates and per-rank peaks."""
        if not self.samples:
            return "summary: no step was run"
        first_step, first_t = self.samples[0][0], self.samples[0][1]
        last_step = self.samples[-1][0]
        if last_step > first_step:          # from the end of the first printed step on
            rate = (last_step - first_step) / max(elapsed - first_t, 1e-12)
        else:
            rate = (last_step - self.start_step + 1) / max(elapsed, 1e-12)
        peaks = np.max([s[3] for s in self.samples], axis=0)
        rows = [("steps", f"{self.start_step}..{last_step} ({last_step - self.start_step + 1})"),
                ("wall time", f"{elapsed:.1f} s"),
                ("tokens/s", f"{human(rate * self.tokens_per_step)} (after step {first_step})")]
        mfu = self.mfu(rate)
        if mfu is not None:
            rows.append(("MFU", f"{100 * mfu:.2f}% of {human(self.peak_flops, 'FLOP/s')} "
                                f"x {self.ranks} ranks"))
        rows.append(("comm wait", f"{100 * np.mean([s[2] for s in self.samples]):.1f}% of "
                                  f"step time (mean of the printed steps)"))
        rows += [(f"peak mem rank {r}", megabytes(b)) for r, b in enumerate(peaks) if b > 0]
        width = max(len(k) for k, _ in rows)
        return "\n".join(["summary:"] + [f"  {k:<{width}}  {v}" for k, v in rows])
