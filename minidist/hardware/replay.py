"""Paper replay: the step-time model (hardware/predict.py) against published training runs.

A prediction is worth what it gets right on runs nobody tuned it for. This module holds
published rows, fits the model's global parameters (predict.Efficiency: eta_max, the GEMM
intensity knee I_0, the HBM fraction rho) on at most a third of them, and reports the error
on every other row.

The rows (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", arXiv:2104.04473; A100 80GB, 8 per node, 200 Gb/s HDR
InfiniBand per GPU, vocabulary 51,200, sequence 2,048, mixed precision, activation
recomputation; FLOP/s by the paper's Eq. 3):
    TABLE_1   weak scaling, 1.7B on 32 GPUs to 1T on 3,072: heads, hidden, layers, t, p,
              GPUs, batch, achieved teraFLOP/s per GPU (Table 1, rows 1-10)
    TABLE_2   PTD-P against ZeRO-3 without model parallelism, 175B and 530B (Table 2):
              the PTD-P rows (t = 8, micro-batch 1) and the ZeRO-3 rows (micro-batch 4,
              2, 1; "model-parallel size 2" taken as tp = 2)
Assumptions the paper does not state per row, the same for every row: micro-batches of
one sequence in Table 1 (M = B / d), the 1F1B schedule (Table 1's runs may have used the
interleaved one), the data-parallel all-reduce after the pipeline (not overlapped).

`fit(rows)` searches a grid of the three parameters for the least mean |relative error|
on `rows`; `replay()` fits on FIT_ROWS (3 of the 10 Table 1 rows: the smallest, a middle
and a large one) and predicts all 22 rows.
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
    """One published run: the model, the layout, what the paper measured."""

    source: str                  # "Table 1, row 3"
    params_b: float              # billions, as the paper names the model
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float                # achieved teraFLOP/s per GPU (Eq. 3)
    micro_batch: int = 1
    zero: int = 0

    def config(self) -> GPTConfig:
        return GPTConfig(vocab_size=51200, block_size=2048, n_layer=self.layers,
                         n_head=self.heads, n_embd=self.hidden, dtype="float32",
                         recompute="full")

    def plan(self) -> Plan:
        dp = self.gpus // (self.tp * self.pp)
        return Plan(tp=self.tp, pp=self.pp, dp=dp, zero=self.zero,
                    micro_batches=self.batch // (dp * self.micro_batch),
                    check_placements=False)


TABLE_1 = [Row(f"Table 1, row {i + 1}", *r) for i, r in enumerate([
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)])]
GPT3_175B, MT_530B = (96, 12288, 96), (128, 20480, 105)
TABLE_2 = [Row(f"Table 2, {what} row {i + 1}", p, *shape, tp, pp, gpus, batch, tf, mb, zero)
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
FIT_ROWS = (0, 3, 6)             # Table 1 rows 1, 4 and 7: 1.7B, 18.4B and 145.6B
GRID = {"eta_max": np.linspace(0.5, 1.0, 11), "intensity_knee": np.logspace(0, 3, 13),
        "rho": (0.5, 0.7, 0.9)}


def predicted_tflops(row: Row, eff: Efficiency = Efficiency()) -> float:
    """The row's teraFLOP/s per GPU as the paper counts it (Eq. 3 / predicted step / GPUs)."""
    cfg, hw = row.config(), profiles.load("a100-80g")
    p = predict(cfg, row.plan(), row.batch, hw, eff=eff, check=False, memory=False)
    return megatron_flops(cfg, row.batch, cfg.block_size) / p.step_s / row.gpus / 1e12


def error(row: Row, eff: Efficiency = Efficiency()) -> float:
    """Relative error of the prediction: predicted / published - 1."""
    return predicted_tflops(row, eff) / row.tflops - 1


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
    """(the fitted parameters, [(row, predicted TF/s, relative error, used in the fit)])
    for every row of TABLE_1 and TABLE_2."""
    eff, _ = fit([TABLE_1[i] for i in FIT_ROWS])
    out = []
    for i, row in enumerate(TABLE_1 + TABLE_2):
        tf = predicted_tflops(row, eff)
        out.append((row, tf, tf / row.tflops - 1, row in TABLE_1 and i in FIT_ROWS))
    return eff, out
