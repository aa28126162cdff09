"""Paper replay: the step-time model (hardware/predict.py) against published training runs.

A prediction is worth what it gets right on runs nobody tuned it for. This module holds
published rows, fits the model's global parameters (predict.Efficiency: eta_max, the GEMM
intensity knee I_0, the HBM fraction rho) on at most a third of them, and reports the error
on every other row.

The rows (A100 80GB, 8 per node, 200 Gb/s HDR InfiniBand per GPU, vocabulary 51,200,
sequence 2,048, mixed precision):
    TABLE_1   Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
              Clusters Using Megatron-LM", arXiv:2104.04473, Table 1 rows 1-10: weak
              scaling, 1.7B on 32 GPUs to 1T on 3,072: heads, hidden, layers, t, p, GPUs,
              batch, achieved teraFLOP/s per GPU by the paper's Eq. 3; full recomputation
    TABLE_2   the same paper's Table 2, PTD-P against ZeRO-3 without model parallelism, 175B
              and 530B: the PTD-P rows (t = 8, micro-batch 1) and the ZeRO-3 rows
              (micro-batch 4, 2, 1; "model-parallel size 2" taken as tp = 2)
    TABLE_5   Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
              Models", arXiv:2205.05198, Table 5 with Table 3's layouts: 22B, 175B, 530B and
              1T on one pipeline of 8 to 512 GPUs (no data parallelism), the iteration time
              with full recomputation and with sequence parallelism + selective
              recomputation ("present work", whose MFU and HFU the table prints: MFU =
              Eq. 7's FLOPs / (time GPUs 312 TF/s), HFU the same with Eq. 8)
Every row's truth is a step time (Table 1, 2: Eq. 3's FLOPs / the rate / GPUs), and its
error is published step / predicted step - 1, the error of the predicted rate.
Assumptions the papers do not state per row, the same for every row: micro-batches of one
sequence in Tables 1 and 2 (M = B / d), the 1F1B schedule there (Table 1's runs may have used
the interleaved one), the data-parallel all-reduce after the pipeline (not overlapped); in
Table 5 the full-recomputation baseline runs tp without sequence parallelism.

`fit(rows)` searches a grid of the three parameters for the least mean |relative error|
on `rows`; `replay()` fits on FIT_ROWS (3 of the 30 rows: Table 1's smallest, a middle and
a large one) and predicts every row; `summary` gives each table's error on the rows not
fitted.
Read next: hardware/predict.py.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from minidist.hardware import profiles
from minidist.hardware.predict import Efficiency, megatron_flops, predict
from minidist.nn import GPTConfig
from minidist.parallel.compose import Plan


@dataclass(frozen=True)
class Row:
    """One published run: the model, the layout, what the paper measured (a rate or a time)."""

    source: str                  # "Table 1, row 3"
    params_b: float              # billions, as the paper names the model
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float = 0.0          # achieved teraFLOP/s per GPU (Narayanan et al., Eq. 3), or
    seconds: float = 0.0         # the iteration time (Korthikanti et al., Table 5)
    micro_batch: int = 1
    zero: int = 0
    sp: bool = False             # sequence parallelism
    recompute: str = "full"
    chunks: int = 1              # model chunks per pipeline rank (> 1: interleaved 1F1B)
    mfu: float = 0.0             # the paper's MFU and HFU, where it prints them
    hfu: float = 0.0

    def config(self) -> GPTConfig:
        return GPTConfig(vocab_size=51200, block_size=2048, n_layer=self.layers,
                         n_head=self.heads, n_embd=self.hidden, dtype="float32",
                         recompute=self.recompute)

    def plan(self) -> Plan:
        dp = self.gpus // (self.tp * self.pp)
        return Plan(tp=self.tp, pp=self.pp, dp=dp, zero=self.zero, sequence_parallel=self.sp,
                    micro_batches=self.batch // (dp * self.micro_batch),
                    schedule="interleaved" if self.chunks > 1 else "1f1b",
                    virtual_stages=self.chunks if self.chunks > 1 else None,
                    check_placements=False)

    @property
    def unit(self) -> str:
        return "s" if self.seconds else "TF/s"

    def in_unit(self, seconds: float) -> float:
        """A step time in the paper's unit for this row: seconds, or teraFLOP/s per GPU."""
        return seconds if self.seconds else self.tflops * self.published_seconds() / seconds

    def published_seconds(self) -> float:
        """The measured step: the paper's time, or Eq. 3's FLOPs at its rate per GPU."""
        if self.seconds:
            return self.seconds
        flops = megatron_flops(self.config(), self.batch, 2048)
        return flops / (self.tflops * 1e12 * self.gpus)


TABLE_1 = [Row(f"Table 1, row {i + 1}", *r) for i, r in enumerate([
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)])]
GPT3_175B, MT_530B = (96, 12288, 96), (128, 20480, 105)
TABLE_2 = [Row(f"Table 2, {what} row {i + 1}", p, *shape, tp, pp, gpus, batch, tflops=tf,
               micro_batch=mb, zero=zero)
           for i, (what, p, shape, tp, pp, gpus, batch, tf, mb, zero) in enumerate([
               ("ZeRO-3", 174.6, GPT3_175B, 1, 1, 384, 1536, 144, 4, 3),
               ("ZeRO-3", 174.6, GPT3_175B, 2, 1, 768, 1536, 88, 2, 3),
               ("ZeRO-3", 174.6, GPT3_175B, 1, 1, 1536, 1536, 44, 1, 3),
               ("ZeRO-3", 529.6, MT_530B, 1, 1, 640, 2560, 138, 4, 3),
               ("ZeRO-3", 529.6, MT_530B, 2, 1, 1120, 2240, 98, 2, 3),
               ("ZeRO-3", 529.6, MT_530B, 1, 1, 2240, 2240, 48, 1, 3),
               ("PTD-P", 174.6, GPT3_175B, 8, 12, 384, 1536, 153, 1, 0),
               ("PTD-P", 174.6, GPT3_175B, 8, 12, 768, 1536, 149, 1, 0),
               ("PTD-P", 174.6, GPT3_175B, 8, 12, 1536, 1536, 141, 1, 0),
               ("PTD-P", 529.6, MT_530B, 8, 35, 560, 2240, 171, 1, 0),
               ("PTD-P", 529.6, MT_530B, 8, 35, 1120, 2240, 167, 1, 0),
               ("PTD-P", 529.6, MT_530B, 8, 35, 2240, 2240, 159, 1, 0)])]
# Korthikanti et al. 2022, Tables 3 and 5: one pipeline (no data parallelism), the
# iteration time with full recomputation (tp without sequence parallelism) and with "present
# work" (sequence parallelism and selective recomputation), its MFU and HFU; interleaved
# with 3 chunks for 175B and 530B; micro-batch 4 for 22B (its one micro-batch), else 1.
TABLE_5 = [Row(f"Table 5, {'1T' if p == 1000 else f'{p}B'} {what}", p, heads, hidden, layers, 8, pp, gpus, batch,
               seconds=t, micro_batch=mb, sp=what == "present work",
               recompute="selective" if what == "present work" else "full", chunks=chunks,
               mfu=mfu if what == "present work" else 0.0,
               hfu=hfu if what == "present work" else 0.0)
           for p, heads, hidden, layers, pp, gpus, batch, mb, chunks, full, present, mfu, hfu
           in [(22, 64, 6144, 48, 1, 8, 4, 4, 1, 1.42, 1.10, 0.415, 0.437),
               (175, 96, 12288, 96, 8, 64, 64, 1, 3, 18.13, 13.75, 0.514, 0.528),
               (530, 128, 20480, 105, 35, 280, 280, 1, 3, 49.05, 37.83, 0.560, 0.570),
               (1000, 160, 25600, 128, 64, 512, 512, 1, 1, 94.42, 71.49, 0.563, 0.570)]
           for what, t in (("full recompute", full), ("present work", present))]
ROWS = TABLE_1 + TABLE_2 + TABLE_5
FIT_ROWS = (0, 3, 6)             # Table 1 rows 1, 4 and 7: 1.7B, 18.4B and 145.6B
GRID = {"eta_max": np.linspace(0.5, 1.0, 11), "knee": np.logspace(-1, 2, 13),
        "rho": (0.5, 0.7, 0.9)}


def predicted_seconds(row: Row, eff: Efficiency = Efficiency()) -> float:
    """The step time predict() gives the row's model and layout on A100 80GB GPUs."""
    p = predict(row.config(), row.plan(), row.batch, profiles.load("a100-80g"), eff=eff,
                check=False, memory=False)
    return p.step_s


def korthikanti_flops(cfg: GPTConfig, batch: int, seq: int, selective: bool = False) -> float:
    """Korthikanti et al. 2022, Eq. 7 (model FLOPs of a step), 72 B s l h^2 (1 + s / (6 h) +
    V / (12 l h)), and with `selective` Eq. 8 (hardware FLOPs): s / (3 h) in place of
    s / (6 h), the paper's count of the attention recomputed."""
    l, h, V = cfg.n_layer, cfg.n_embd, cfg.vocab_size
    return 72 * batch * seq * l * h * h * (1 + seq / ((3 if selective else 6) * h)
                                            + V / (12 * l * h))


def error(row: Row, eff: Efficiency = Efficiency()) -> float:
    """Relative error of the predicted throughput: published step / predicted step - 1 (for
    a Table 1 row, predicted teraFLOP/s / published - 1)."""
    return row.published_seconds() / predicted_seconds(row, eff) - 1


def fit(rows: list[Row]) -> tuple[Efficiency, float]:
    """The grid's parameters with the least mean |relative error| on `rows`, and that mean."""
    best = None
    for eta, knee, rho in itertools.product(*GRID.values()):
        eff = Efficiency(float(eta), float(knee), float(rho))
        mae = float(np.mean([abs(error(r, eff)) for r in rows]))
        if best is None or mae < best[1]:
            best = (eff, mae)
    return best


def replay() -> tuple[Efficiency, list[tuple[Row, float, float, bool]]]:
    """(the fitted parameters, [(row, predicted step in seconds, relative error, used in the
    fit)]) for every row of ROWS."""
    eff, _ = fit([TABLE_1[i] for i in FIT_ROWS])
    out = []
    for row in ROWS:
        t = predicted_seconds(row, eff)
        fitted = any(row is TABLE_1[i] for i in FIT_ROWS)
        out.append((row, t, row.published_seconds() / t - 1, fitted))
    return eff, out


def summary(rows: list[tuple[Row, float, float, bool]]) -> dict[str, tuple[float, float]]:
    """{group: (mean |error|, worst |error|)} of replay()'s rows not used in the fit."""
    groups = {"Table 1, held out": lambda r: r in TABLE_1,
              "Table 2, PTD-P": lambda r: r in TABLE_2 and r.zero == 0,
              "Table 2, ZeRO-3": lambda r: r in TABLE_2 and r.zero == 3,
              "Table 5 (MFU, HFU)": lambda r: r in TABLE_5}
    out = {}
    for name, member in groups.items():
        errs = [abs(e) for row, _, e, fitted in rows if member(row) and not fitted]
        out[name] = (sum(errs) / len(errs), max(errs))
    return out
