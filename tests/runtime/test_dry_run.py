"""The dry run against real runs: on every rank of every layout here, the bytes it counts per
axis and step (sent and received) equal the real run's counters exactly, and its memory
ledger's peak equals the real run's; at W = 4096 every call sends what the formulas say
(collectives/cost.py, parallel/tensor/memory.py); the command refuses, in one line, what
it cannot honour.

The default run compares a composed layout (dp x tp with SP x pp, 1F1B), tp x cp (ring
attention) and dp with ZeRO-3: every axis once. `-m slow` adds the sweep: dp over 3 ranks,
ZeRO 1 and 2 (also over dp x cp), tp with and without SP, pp with 1F1B, GPipe, interleaved
and ZBV, cp alone with ring and Ulysses, the textbook algorithms and bf16."""

from __future__ import annotations

import re

import numpy as np
import pytest

from minidist import train_cli
from minidist.collectives import cost
from minidist.data import DataConfig, model_config_for
from minidist.parallel import placement
from minidist.parallel.tensor import memory as tm
from minidist.runtime.dry_run import DryContext
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank
from minidist.train_dry_run import dry_run
from tests.helpers import assert_lines_fit

DATA = DataConfig(task="sort", length=4, seed=1)            # T = 8 positions
OPT = OptimizerConfig(lr=1e-2)
STEPS = 2

# name: (Plan fields, global batch, layers, dtype)
LAYOUTS = {
    "dp2-tp2-sp-pp2": (dict(dp=2, tp=2, pp=2, micro_batches=2, sequence_parallel=True), 8, 2,
                       "float64"),
    "dp2-cp2-zero2": (dict(dp=2, cp=2, zero=2), 4, 2, "float64"),
    "dp2-zero3": (dict(dp=2, zero=3), 4, 2, "float64"),
    "dp3": (dict(dp=3), 6, 2, "float64"),
    "dp2-zero1": (dict(dp=2, zero=1), 4, 2, "float64"),
    "dp2-zero2": (dict(dp=2, zero=2), 4, 2, "float64"),
    "tp2": (dict(tp=2), 4, 2, "float64"),
    "tp4-sp": (dict(tp=4, sequence_parallel=True), 4, 2, "float64"),
    "pp2-1f1b": (dict(pp=2, micro_batches=2), 4, 2, "float64"),
    "pp2-gpipe": (dict(pp=2, micro_batches=2, schedule="gpipe"), 4, 2, "float64"),
    "pp2-interleaved": (dict(pp=2, micro_batches=2, schedule="interleaved"), 4, 4, "float64"),
    "pp2-zbv": (dict(pp=2, micro_batches=2, schedule="zbv"), 4, 4, "float64"),
    "cp2-ring": (dict(cp=2), 4, 2, "float64"),
    "cp2-ulysses": (dict(cp=2, cp_algo="ulysses"), 4, 2, "float64"),
    "tp2-cp2": (dict(tp=2, cp=2), 4, 2, "float64"),
    "dp2-textbook": (dict(dp=2, algo="ring", buckets=False), 4, 2, "float64"),
    "dp2-zero1-bf16": (dict(dp=2, zero=1, precision="bf16"), 4, 2, "float32"),
    "dp4-zero3-zeropp": (dict(dp=4, zero=3, zeropp=2), 8, 2, "float64"),
    "dp4-zero2-hsdp": (dict(dp=4, zero=2, hsdp=2), 8, 2, "float64"),
}
DEFAULT = ("dp2-tp2-sp-pp2", "tp2-cp2", "dp2-zero3")
CASES = [name if name in DEFAULT else pytest.param(name, marks=pytest.mark.slow)
         for name in LAYOUTS]


def _job(name: str):
    fields, batch, layers, dtype = LAYOUTS[name]
    cfg = model_config_for(DATA, n_layer=layers, n_head=4, n_embd=16, dtype=dtype)
    plan = Plan(**fields, check_placements=False)      # check mode's digests are traffic too
    return cfg, plan, RunConfig(steps=STEPS, global_batch=batch, memory_ledger=True)


@pytest.fixture(scope="module")
def runs():
    """runs(name) -> (real results per rank, dry runs per rank), each made once."""
    made = {}

    def get(name: str):
        if name not in made:
            cfg, plan, run = _job(name)
            W = plan.world_size
            real = spawn(W, train_on_rank, cfg, DATA, plan, run, OPT)
            made[name] = real, [dry_run(r, W, cfg, DATA, plan, run, OPT) for r in range(W)]
        return made[name]
    return get


@pytest.mark.multiproc
@pytest.mark.parametrize("name", CASES)
def test_bytes_per_axis_equal_the_real_run_on_every_rank(name, runs):
    real, dry = runs(name)
    for rank, (want, got) in enumerate(zip(real, dry)):
        where = f"{name}, rank {rank}"
        assert got.result.bytes_by_axis == want.bytes_by_axis, f"{where}: sent per axis"
        assert got.result.recv_by_axis == want.recv_by_axis, f"{where}: received per axis"
        assert got.result.bytes_per_step == want.bytes_per_step, f"{where}: all groups"
    assert any(sum(step.values()) for step in real[0].bytes_by_axis), f"{name}: no traffic"


@pytest.mark.multiproc
@pytest.mark.parametrize("name", CASES)
def test_memory_peak_equals_the_real_run_ledger_on_every_rank(name, runs):
    real, dry = runs(name)
    for rank, (want, got) in enumerate(zip(real, dry)):
        want, got = want.memory["ledger"], got.result.memory["ledger"]
        assert got["peak"] == want["peak"], f"{name}, rank {rank}: ledger peak"
        assert got["step_peaks"] == want["step_peaks"], f"{name}, rank {rank}: step peaks"
        assert got["peak_by_category"] == want["peak_by_category"], f"{name}, rank {rank}"


@pytest.mark.multiproc
def test_every_byte_counted_belongs_to_a_recorded_call(runs):
    _, dry = runs(DEFAULT[0])
    for d in dry:
        for key, field in (("bytes_sent", "sent"), ("bytes_recv", "recv")):
            counted = sum(g.stats[key] for g in d.ctx.groups)
            assert sum(getattr(c, field) for c in d.ctx.calls) == counted, (d.ctx.rank, key)
        steps = {c.step for c in d.ctx.calls}
        assert steps == {None, *range(STEPS)}, steps        # labelled by StepLabels


# --- W = 4096: the formulas -----------------------------------------------------------------

def _step_calls(d, step: int):
    return [c for c in d.ctx.calls if c.step == step]


@pytest.mark.parametrize("rank", [0, 4095])
def test_at_4096_ranks_every_call_sends_what_the_formulas_say(rank):
    """dp = 2048 x tp = 2, ZeRO-1, float32: tp's step is parallel/tensor/memory.py's
    step_bytes; every gradient-sync call on dp sends cost.py's bytes (all-gathers: (W-1) n)
    or, for direct.py's reduce-scatter, the N - n_r elements its peers read."""
    data = DataConfig(task="sort", length=6, seed=0)        # T = 12
    cfg = model_config_for(data, n_layer=2, n_head=4, n_embd=32)
    plan = Plan(dp=2048, tp=2, zero=1)
    d = dry_run(rank, 4096, cfg, data, plan, RunConfig(steps=1, global_batch=2048), OPT)
    tp_rank, dp_rank, isz = rank % 2, rank // 2, np.dtype(cfg.dtype).itemsize
    by_axis = d.result.bytes_by_axis[0]
    assert by_axis["tp"] == tm.step_bytes(cfg, 1, data.block_size, 2, rank=tp_rank)
    dp_calls = [c for c in _step_calls(d, 0) if c.group.startswith("dp")]
    seen = set()
    for c in dp_calls:
        if c.op == "all_gather":
            want = cost.terms("all_gather", c.algo, 2048, c.nbytes)[2]
        else:
            n = c.nbytes // isz
            want = tm.sent_bytes(c.op, n, 2048, dp_rank, isz, c.algo)
        assert c.sent == want, c
        seen.add((c.op, c.algo))
    assert {"reduce_scatter", "all_gather"} <= {op for op, _ in seen}, seen
    assert by_axis["dp"] == sum(c.sent for c in dp_calls)


@pytest.mark.parametrize("rank", [0, 1025, 4095])
def test_at_4096_ranks_a_pipeline_stage_sends_its_micro_batches(rank):
    """dp = 512 x tp = 2 x pp = 4, M = 8: a stage sends one micro-batch of hidden states
    (rows, T, C) per micro-batch and direction; the first stage only forward, the last
    only backward, the others both."""
    data = DataConfig(task="sort", length=6, seed=0)
    cfg = model_config_for(data, n_layer=4, n_head=4, n_embd=32)
    plan = Plan(dp=512, tp=2, pp=4, micro_batches=8)
    d = dry_run(rank, 4096, cfg, data, plan, RunConfig(steps=1, global_batch=4096), OPT)
    stage, rows = rank // 1024, 4096 // (512 * 8)
    per_micro_batch = rows * data.block_size * cfg.n_embd * np.dtype(cfg.dtype).itemsize
    directions = 1 if stage in (0, 3) else 2
    assert d.result.bytes_by_axis[0]["pp"] == 8 * per_micro_batch * directions
    assert d.result.recv_by_axis[0]["pp"] == 8 * per_micro_batch * directions
    assert len({g.name for g in d.ctx.groups}) == len(d.ctx.groups) <= 16   # mine only


# --- the transport itself -----------------------------------------------------------------

def test_a_dry_group_counts_like_the_mailboxes_and_moves_nothing():
    ctx = DryContext(1, 4)
    g = ctx.new_group((0, 1, 2), name="g")
    assert ctx.new_group((0, 2), name="h") is None and g.rank == 1 and g.size == 3
    x, out = np.arange(6.0), np.full(6, 7.0)
    g.send(x, 2)
    assert np.array_equal(g.recv(0, out), np.zeros(6))          # nothing arrived: zeros
    kept = np.full(6, 7.0)
    g.recv(0, kept, combine=np.add)                              # the reduction not applied
    assert np.array_equal(kept, np.full(6, 7.0))
    assert np.array_equal(g.sendrecv(x, 2, 0), x)                # every peer holds mine
    assert g.stats == {"bytes_sent": 96, "bytes_recv": 144, "messages_sent": 2,
                       "seconds": 0.0}
    region = g.shared("t", 16)
    region.local(np.int64, 2)[...] = (3, 4)
    assert np.array_equal(region.peer(0, np.int64, 2), [3, 4])
    with pytest.raises(ValueError, match="dst=1 is not another rank of group 'g'"):
        g.send(x, 1)
    with pytest.raises(ValueError, match="rank=4 is not a rank of a job of 4"):
        DryContext(4, 4)


def test_a_dry_run_leaves_the_process_check_mode_as_it_was():
    data = DataConfig(task="sort", length=4, seed=1)
    cfg = model_config_for(data, n_layer=1, n_head=2, n_embd=8)
    before = placement.checking()
    dry_run(0, 2, cfg, data, Plan(dp=2, check_placements=True), RunConfig(steps=1,
            global_batch=2), OPT)
    assert placement.checking() == before


# --- the command ------------------------------------------------------------------------------

def test_the_command_runs_rank_0_of_4096_and_prints_short_lines(capsys):
    argv = ["--dry-run", "--world", "4096", "--tp", "2", "--pp", "4", "--batch", "4096"]
    assert train_cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert_lines_fit(lines, "train " + " ".join(argv))
    text = "\n".join(lines)
    assert "dry run: rank 0 of 4096 · pp=4 (1f1b) x dp=512 x tp=2" in text
    assert re.search(r"^  dp +512 ranks: 0, 2, 4, \.\.\., 1022 \(stride 2\)$", text, re.M)
    assert re.search(r"^  pp +12,288 +12,288$", text, re.M)      # 8 x (1, 12, 32) float32
    assert re.search(r"^memory peak \(memory/ledger\.py\): .* \([\d,]+ B\)", text, re.M)


def test_the_world_fills_dp_in(capsys):
    assert train_cli.main(["--dry-run", "--world", "8", "--tp", "2", "--rank", "5",
                           "--steps", "1", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "dry run: rank 5 of 8 · dp=4 x tp=2" in out
    assert "rank 5 at dp 2 · tp 1" in out


REFUSED = [
    (["--check"], r"^error: --check compares .* drop --check$"),
    (["--check-placements"], r"drop --check-placements$"),
    (["--spike", "skip"], r"--spike skip decides each update from the global loss"),
    (["--straggler", "rebalance"], r"drop --straggler$"),
    (["--deterministic"], r"drop --deterministic$"),
    (["--inject", "crash:rank=0:step=1"], r"drop --inject$"),
    (["--steps", "0"], r"use --steps 1 or more$"),
    (["--dp", "2", "--moe-every", "1", "--ep", "2"], r"--ep 2 sends each token .* use --ep 1"),
    (["--dp", "2", "--precision", "fp16"], r"use --precision bf16"),
    (["--world", "10", "--tp", "4"], r"--world 10 is not a multiple of --tp 4 .* \(e\.g\. 8\)"),
    (["--world", "8", "--dp", "3", "--tp", "2"], r"make them agree, or drop --dp \(dp is then "
                                                 r"8 / 2 = 4\)"),
    (["--world", "8", "--rank", "8"], r"--rank 8 is not a rank of the 8-rank job"),
    (["--world", "6", "--tp", "3"], r"--tp 3 splits attention by heads"),   # the real rules
]


@pytest.mark.parametrize("args, message", REFUSED)
def test_the_command_refuses_in_one_line_naming_the_flag(args, message, capsys):
    assert train_cli.main(["--dry-run", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert re.search(message, err.strip()), err


def test_dry_run_options_need_dry_run(capsys):
    assert train_cli.main(["--world", "8"]) == 2
    assert "add --dry-run" in capsys.readouterr().err


def test_a_rank_past_its_device_memory_is_exit_code_1_with_the_ledgers_line(capsys):
    assert train_cli.main(["--dry-run", "--world", "8", "--tp", "2", "--steps", "1",
                           "--device-memory", "100kB"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("dry run: [rank 0/8] out of device memory"), err


def test_the_mpi_transport_runs_what_runs_without_shared_memory(capsys):
    assert train_cli.main(["--dry-run", "--world", "64", "--steps", "1", "--batch", "64",
                           "--transport", "mpi"]) == 0
    out = capsys.readouterr().out
    assert "gradient sync: DDP, one all-reduce per parameter (parallel/data/ddp.py)" in out
    assert re.search(r"^  dp0 \(64 ranks\): all_reduce/(ring|tree|halving) x\d+", out, re.M)
