"""Low-precision communication under ZeRO-3: with the bf16 model copy stored in bf16
(grad_reduce "low") every parameter all-gather and gradient reduce-scatter moves 2 bytes a
number; with param_gather "fp8" the weight gathers move E4M3 codes, one byte a number, plus
a float32 scale per block of 256 -- each exactly the formula's bytes, per rank and step."""

import pytest

from minidist.collectives import quantized as Q
from minidist.data import DataConfig, model_config_for
from minidist.nn import GPT
from minidist.parallel.zero.flat import split_units
from minidist.parallel.zero.memory import comm_elements
from minidist.parallel.zero.zeropp import unit_cuts
from minidist.runtime.launch import spawn
from minidist.train import Plan, train_on_rank
from tests.helpers import configs

pytestmark = pytest.mark.multiproc
DATA = DataConfig(task="sort", length=4, seed=1)
CFG = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16, dtype="float32")
W, STEPS = 2, 2


def _bytes_per_step(plan: Plan) -> list[int]:
    runs = spawn(W, train_on_rank, CFG, DATA, plan,
                 *configs(steps=STEPS, global_batch=8, lr=1e-2, seed=0))
    return [[t["sent"] for t in r.bytes_per_step] for r in runs]


def test_bf16_gathers_and_reduce_scatters_move_two_bytes_a_number():
    numels = [u.numel for u in split_units(GPT(CFG, 0), W)]
    # (W-1) (3 S) numbers of 2 bytes (two gathers and one reduce-scatter), and the norm's
    # (W-1) float64 partial sums
    S3 = comm_elements(3, numels, W) - (W - 1)
    want = 2 * S3 + 8 * (W - 1)
    got = _bytes_per_step(Plan(dp=W, zero=3, precision="bf16", grad_reduce="low",
                               algo="ring"))
    assert got == [[want] * STEPS] * W


def test_fp8_weight_gathers_move_one_byte_a_number_and_the_scales():
    units = split_units(GPT(CFG, 0), W)
    gathers = 0
    for u in units:        # each message holds the most scales any rank's piece needs
        pieces = [Q.piece_cuts(unit_cuts(u), [(r * u.shard, (r + 1) * u.shard)])
                  for r in range(W)]
        slots = max(len(Q.block_starts(u.shard, 256, c)) for c in pieces)
        gathers += (W - 1) * Q.packed_nbytes(u.shard, "e4m3", 256, scale_slots=slots)
    rs = 4 * (W - 1) * sum(u.shard for u in units)          # fp32 gradients
    want = 2 * gathers + rs + 8 * (W - 1)                  # forward and backward gathers
    got = _bytes_per_step(Plan(dp=W, zero=3, param_gather="fp8", algo="ring"))
    assert got == [[want] * STEPS] * W
    fp32_gathers = 2 * 4 * (W - 1) * sum(u.shard for u in units)
    assert 2 * gathers < 0.26 * fp32_gathers          # a quarter of fp32's, plus scales


def test_param_gather_fp8_needs_zero3():
    with pytest.raises(ValueError, match="param_gather='fp8' changes ZeRO-3's collectives"):
        Plan(dp=2, zero=2, param_gather="fp8")
