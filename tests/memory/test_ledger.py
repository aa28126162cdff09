"""The device-memory ledger counts every buffer once, by category, exactly: hand-counted bytes
of a small graph, autograd/saved.py's count, engine.memory() under DDP and ZeRO 1-3, and a
budget that fails with a message naming the category and the largest arrays.

The default run compares the ledger with engine.memory() under ZeRO-3 (it has every branch);
`-m slow` adds DDP, ZeRO-1, -2 and the `minidist train --device-memory` subprocess runs."""

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.autograd import functional as F
from minidist.autograd import tensor as _tensor
from minidist.autograd.saved import saved_bytes
from minidist.data import DataConfig, model_config_for
from minidist.optim import make_optimizer
from minidist.memory.ledger import (DeviceOutOfMemory, Ledger, format_bytes, optimizer_arrays,
                                    parse_bytes)
from minidist.nn import GPT
from minidist.nn.layers import Linear
from minidist.observe.flops import FlopLedger
from minidist.optim import AdamW
from minidist.parallel.data.buckets import BucketedDataParallel
from minidist.parallel.zero.engine import ZeroEngine
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank

DATA = DataConfig(task="sort", length=4, seed=1)                        # T = 8
TINY = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16)           # float64
B, C, H, V = 4, 3, 5, 7                                                  # the MLP below
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _MLP:
    """x -> Linear(C, H) -> ReLU -> Linear(H, V) -> cross-entropy, float64."""

    def __init__(self):
        self.l1, self.l2 = Linear(C, H), Linear(H, V)

    def named_parameters(self):
        yield from self.l1.named_parameters("l1.")
        yield from self.l2.named_parameters("l2.")

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def loss(self, x, y):
        return F.cross_entropy(self.l2(F.relu(self.l1(Tensor(x)))), y)


def _data():
    return np.random.default_rng(0).standard_normal((B, C)), np.array([0, 1, 2, 6])


def test_parse_bytes_decimal_and_binary_units():
    assert parse_bytes("64MB") == 64 * 10**6
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("1.5 kB") == 1500 and parse_bytes(".5KiB") == 512
    assert parse_bytes("4096") == parse_bytes(4096) == parse_bytes(np.int64(4096)) == 4096
    assert parse_bytes("1.1GB") == 1_100_000_000                  # exact, no float rounding
    for bad in ("64XB", "MB", "", "-1MB", True, "1e6"):
        with pytest.raises(ValueError, match="64MB or 141GB"):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="negative"):
        parse_bytes(-5)
    assert [format_bytes(n) for n in (812, 16_384, 1_020_000, 141 * 10**9)] == \
        ["812 B", "16.4 kB", "1.02 MB", "141 GB"]


def test_linear_relu_loss_bytes_by_category_exactly():
    """Every byte of a 2-layer MLP step, counted by hand (float64: 8 bytes a number)."""
    mlp, (x, y) = _MLP(), _data()
    opt = AdamW(mlp.parameters(), lr=1e-3)
    ledger = Ledger()
    ledger.track_model(mlp, opt)
    params = 8 * (C * H + H + H * V + V)
    with ledger:
        loss = mlp.loss(x, y)
        # saved: x (Linear 1), relu output (ReLU, and Linear 2's input: once), softmax p,
        # targets t_safe (int64) and weights w (CrossEntropy); W1 and W2 are parameters
        saved = 8 * (B * C + B * H + B * V + B + B)
        # not saved, alive as the graph's Tensors: x@W1+b1, h@W2+b2 (Linear adds the bias
        # in place, into the GEMM's output), and the loss
        temporaries = 8 * (B * H + B * V + 1)
        assert ledger.current == {"parameters": params, "gradients": 0, "optimizer": 2 * params,
                                  "communication": 0, "activations": saved,
                                  "temporaries": temporaries}
        assert saved == saved_bytes(loss, exclude=mlp.parameters())
        loss.backward()
    assert ledger.current["gradients"] == sum(p.grad.nbytes for p in mlp.parameters()) == params
    assert ledger.current["temporaries"] == temporaries       # the backward's are freed
    assert ledger.peak > ledger.total                        # the backward's high-water mark
    assert [p.label for p in ledger.timeline] == ["forward", "backward"]
    assert ledger.timeline[0].bytes == 3 * params + saved + temporaries
    assert ledger.timeline[1].peak == ledger.peak


def test_views_count_as_their_base_buffer_once():
    ledger = Ledger()
    a = np.zeros((4, 6))
    for v in (a[1:], a.reshape(24), a.T, a):                      # views first, then a
        ledger.register(v, "temporaries", "a")
    assert ledger.total == a.nbytes == 192 and len(ledger.snapshot("now")) == 1
    assert ledger.snapshot("now")[0].shape == (4, 6)              # the base's shape
    with ledger:                                                  # q, k, v views of one qkv
        qkv = Tensor(np.ones((2, 9)), requires_grad=True) + 1.0      # Add saves no array
        q, k, v = F.split(qkv, 3, axis=1)
        (q * k + v).sum().backward()                              # Mul saves q and k
    at_peak = [a for a in ledger.snapshot() if a.category == "activations"]
    assert [(a.name, a.shape) for a in at_peak] == [("Add", (2, 9))], \
        "qkv's buffer must appear once however many views of it are saved"
    assert ledger.peak_by_category["activations"] == 8 * 2 * 9


def test_buffers_leave_when_freed_and_the_peak_snapshot_keeps_them():
    ledger = Ledger()
    a, b = np.zeros(10), np.zeros(20, np.float32)                 # 80 B and 80 B
    ledger.register(a, "activations", "a")
    ledger.register(b, "gradients", "b")
    del a
    gc.collect()
    c = np.zeros(5)
    ledger.register(c, "temporaries", "c")
    assert ledger.total == 120 and ledger.peak == 160
    assert {x.name for x in ledger.snapshot()} == {"a", "b"}
    assert {x.name for x in ledger.snapshot("now")} == {"b", "c"}
    assert ledger.end_step() == 160
    del c
    gc.collect()
    assert {x.name for x in ledger.snapshot()} == {"a", "b"}      # kept across end_step
    d = np.zeros(30)                                              # 240 B: a new peak
    ledger.register(d, "communication", "d")
    assert ledger.peak == 320 and {x.name for x in ledger.snapshot()} == {"b", "d"}
    assert ledger.end_step() == 320 and ledger.step_peaks == [160, 320]
    ledger.close()
    del d
    gc.collect()
    assert ledger.total == 320, "a closed ledger keeps its numbers and watches nothing"


def test_a_category_that_comes_first_claims_the_buffer():
    ledger = Ledger()
    a = np.zeros(8)
    ledger.register(a, "temporaries", "op")
    ledger.register(a, "activations", "op")                       # saved by the next op
    ledger.register(a, "temporaries", "op")                       # stays an activation
    assert ledger.current["activations"] == 64 and ledger.current["temporaries"] == 0
    assert ledger.total == 64 and ledger.peak_by_category["temporaries"] == 64
    with pytest.raises(ValueError, match="'weights' is not one of"):
        ledger.register(a, "weights")


def test_budget_names_the_category_and_the_largest_arrays():
    ledger = Ledger(budget="1kB", prefix="[rank 1/2]")
    assert ledger.budget == 1000
    w, m, big = np.zeros(75), np.zeros(30), np.zeros(25)          # 600 B, 240 B, 200 B
    ledger.register(w, "parameters", "w")
    ledger.register(m, "optimizer", "m")
    with pytest.raises(DeviceOutOfMemory) as err:
        ledger.register(big, "activations", "MatMul")
    assert isinstance(err.value, MemoryError)
    text = str(err.value)
    assert text.startswith("[rank 1/2] out of device memory in step 0: activations 'MatMul'")
    for part in ("(25,) float64 (200 B)", "to 1.04 kB", "budget of 1 kB (1,000 B)",
                 "parameters 600 B", "optimizer 240 B", "'w' (75,) 600 B", "'m' (30,) 240 B",
                 "--recompute", "--zero", "micro-batch", "offload"):
        assert part in text, f"{part!r} missing from: {text}"
    assert ledger.total == 840, "the refused array must not be counted"


def test_budget_fails_inside_the_forward_and_the_hooks_come_off():
    mlp, (x, y) = _MLP(), _data()
    ledger = Ledger(budget=8 * (C * H + H + H * V + V) + 100)
    ledger.track_model(mlp)
    before = _tensor.observers                  # the placement check's, in check mode
    with pytest.raises(DeviceOutOfMemory, match="'Linear' \\(4, 5\\)"):
        with ledger:
            mlp.loss(x, y)
    assert _tensor.observers == before


def test_observers_off_count_nothing_and_sit_beside_others():
    base = _tensor.observers                  # the placement check's, in check mode
    mlp, (x, y) = _MLP(), _data()
    ledger = Ledger()
    mlp.loss(x, y).backward()                                     # not started: nothing
    assert ledger.total == 0
    with FlopLedger() as flops:                                   # another observer, first
        with ledger:
            assert _tensor.observers == base + (flops, ledger)
            mlp.loss(x, y).backward()
        assert _tensor.observers == base + (flops,), "the FLOP ledger must still observe"
        counted = ledger.peak
    assert flops.model_flops() > 0 and counted > 0
    assert _tensor.observers == base
    seen = []

    class Counter(_tensor.Observer):
        def backward(self, t, grads):
            seen.append(len(grads))
    other = _tensor.observe(Counter())
    try:
        with ledger:
            mlp.loss(x, y).backward()
        assert seen, "the other observer must still see the backward"
        assert _tensor.observers == base + (other,)
    finally:
        _tensor.unobserve(other)


def test_single_process_gpt_model_state_and_saved_activations():
    model = GPT(TINY, seed=0)
    opt = make_optimizer("adamw", model.parameters(), 1e-3, 0.0, (0.9, 0.999), 0.0)
    ledger = Ledger()
    ledger.track_model(model, opt)
    ledger.mark_modules({f"blocks.{i}": b for i, b in enumerate(model.blocks)})
    idx = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 8))
    with ledger:
        _, loss = model(idx, idx)
        assert ledger.current["activations"] == saved_bytes(loss, exclude=model.parameters())
        loss.backward()
    labels = [p.label for p in ledger.timeline]
    assert labels[:2] == ["forward blocks.0", "forward blocks.1"] and labels[-1] == "backward"
    params = model.parameters()
    state = opt.state_dict()
    assert ledger.model_state() == {
        "params": sum(p.data.nbytes for p in params),
        "grads": sum(p.grad.nbytes for p in params),
        "optimizer": sum(a.nbytes for a in state.values() if isinstance(a, np.ndarray))}
    assert len(optimizer_arrays(opt)) == 2 * len(params)
    ledger.close()
    assert "forward" not in vars(model.blocks[0]), "close() must unwrap the blocks"


def _engine_on_rank(ctx, stage):
    model = GPT(TINY, seed=0)
    engine = BucketedDataParallel(model, ctx.world) if stage == 0 else \
        ZeroEngine(model, ctx.world, stage)
    ledger = Ledger()
    ledger.track_engine(engine)
    idx = np.random.default_rng(ctx.rank).integers(0, TINY.vocab_size, (2, 8))
    seen = []
    for _ in range(2):
        with ledger:
            _, loss = engine.forward(idx, idx, n_tokens=32)
            loss.backward()
        del loss
        gc.collect()
        seen.append((ledger.model_state(), _state(engine.memory())))
        engine.step(1e-3)
        ledger.mark("optimizer")
        ledger.end_step()
        seen.append((ledger.model_state(), _state(engine.memory())))
    ledger.close()
    return seen, ledger.summary(), engine.memory()


def _state(memory):
    return {k: memory[k] for k in ("params", "grads", "optimizer")}


@pytest.mark.multiproc
@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow) for s in (0, 1, 2)]
                         + [3])
def test_model_state_equals_engine_memory_under_ddp_and_zero(stage):
    for rank, (seen, summary, memory) in enumerate(spawn(2, _engine_on_rank, stage)):
        for i, (mine, engine) in enumerate(seen):
            assert mine == engine, f"rank {rank}, stage {stage}, point {i}: {mine} != {engine}"
        assert len(summary["step_peaks"]) == 2 and summary["peak"] == max(summary["step_peaks"])
        peaks = summary["peak_by_category"]
        assert peaks["activations"] > 0
        if stage == 3:      # gathered units: at most what the engine had gathered or in flight
            assert 0 < peaks["communication"] <= memory["peak_gathered_params"]
        if stage >= 2:      # the unsharded flats were seen as they were made
            assert peaks["gradients"] >= memory["grads"] + memory["peak_unsharded_grads"]


@pytest.mark.multiproc
def test_train_on_rank_returns_the_ledgers_step_peaks():
    runs = spawn(2, train_on_rank, TINY, DATA, Plan(dp=2, zero=1),
                 RunConfig(steps=2, global_batch=4, memory_ledger=True), OptimizerConfig(lr=1e-2))
    for run in runs:
        led = run.memory["ledger"]
        assert led["budget"] is None and len(led["step_peaks"]) == 2
        assert {k: led["current"][c] for k, c in (("params", "parameters"),
                ("grads", "gradients"), ("optimizer", "optimizer"))} == _state(run.memory)
        assert led["peak"] == max(led["step_peaks"]) > sum(_state(run.memory).values())


@pytest.mark.slow       # two CLI subprocesses; the budget error itself: test_budget_fails_*
@pytest.mark.multiproc
def test_train_cli_fails_cleanly_past_the_device_memory():
    res = subprocess.run([sys.executable, "-m", "minidist", "train", "--device-memory", "1MB",
                          "--steps", "2"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "[rank 0/1] out of device memory in step 0" in res.stderr
    for part in ("budget of 1 MB", "Held now: parameters", "Largest live arrays", "--zero"):
        assert part in res.stderr
    bad = subprocess.run([sys.executable, "-m", "minidist", "train", "--device-memory", "64XB"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "cannot read '64XB'" in bad.stderr
