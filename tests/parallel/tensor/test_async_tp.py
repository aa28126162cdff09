"""Async TP (parallel/tensor/async_tp.py): the decomposed all-gather matmul and matmul
reduce-scatter compute what their decomposition says, bit for bit, and what the plain SP path
computes (bitwise where this BLAS computes a chunk's rows as it does inside the whole
product, which is probed first; else within rounding); they send the plain path's bytes,
and a chunk product runs while a transfer is in flight. (W = 3 and the ring sweep: -m slow.)"""

import time

import numpy as np
import pytest

from minidist import collectives as C
from minidist.autograd import Tensor
from minidist.autograd.tensor import mm
from minidist.nn import GPT
from minidist.nn.gpt import GPTConfig
from minidist.parallel import placement as pl
from minidist.parallel.tensor import async_tp
from minidist.parallel.tensor.tensor_parallel import TensorParallel, apply_tensor
from minidist.runtime import call
from minidist.runtime.launch import spawn
from tests.helpers import assert_close

B, T_TP, C_IN, F = 2, 4, 16, 32     # x[B, T, C] into a column layer, h[B, T, F] into a row
                                    # layer; T = W T_TP


def _x(W: int) -> np.ndarray:
    """The whole input x[B, T, C] of the column layer (rank r holds chunk r)."""
    return np.random.default_rng(7).standard_normal((B, W * T_TP, C_IN))


def _draw(q: int, W: int) -> dict:
    """Rank q's own inputs: its weights and the gradients of its outputs."""
    rng = np.random.default_rng(100 + q)
    return {"w": rng.standard_normal((C_IN, F)), "dy": rng.standard_normal((B, W * T_TP, F)),
            "h": rng.standard_normal((B, W * T_TP, F)), "v": rng.standard_normal((F, C_IN)),
            "g": rng.standard_normal((B, T_TP, C_IN))}


def _chunk(a: np.ndarray, c: int, W: int) -> np.ndarray:
    n = a.shape[1] // W
    return a[:, c * n:(c + 1) * n]


def decomposed(r: int, W: int) -> dict:
    """What rank r must get, from the decomposition itself, in one process: chunk products
    (mm of the same chunk shapes), rank-order folds, dw as one product."""
    d, X = [_draw(q, W) for q in range(W)], _x(W)
    mine = d[r]
    dx = mm(_chunk(d[0]["dy"], r, W), d[0]["w"].T)
    for q in range(1, W):
        dx = dx + mm(_chunk(d[q]["dy"], r, W), d[q]["w"].T)          # rank order
    y_row = mm(_chunk(d[0]["h"], r, W), d[0]["v"])
    for q in range(1, W):
        y_row = y_row + mm(_chunk(d[q]["h"], r, W), d[q]["v"])
    g_all = np.concatenate([d[c]["g"] for c in range(W)], axis=1)      # (B, T, C)
    return {"y": np.concatenate([mm(_chunk(X, c, W), mine["w"]) for c in range(W)], axis=1),
            "dx": dx, "dw": X.reshape(-1, C_IN).T @ mine["dy"].reshape(-1, F),
            "y_row": y_row, "dh": np.concatenate([mm(d[c]["g"], mine["v"].T)
                                                  for c in range(W)], axis=1),
            "dv": mine["h"].reshape(-1, F).T @ g_all.reshape(-1, C_IN)}


def _layers(tp, r: int, W: int) -> tuple[dict, int]:
    """Both layers forward and backward on rank r ({name: array}), and the bytes this rank
    sent on the tp group meanwhile: tp.matmul (column) and tp.matmul_exit (row)."""
    mine = _draw(r, W)
    before = tp.group.stats["bytes_sent"]
    x = pl.tag(Tensor(_chunk(_x(W), r, W).copy(), requires_grad=True), "tp", pl.Shard(1))
    w = Tensor(mine["w"].copy(), requires_grad=True)
    y = tp.matmul(x, w)
    assert pl.placement_tag(y, "tp") == pl.Shard(2)
    y.backward(mine["dy"])
    h = pl.tag(Tensor(mine["h"].copy(), requires_grad=True), "tp", pl.Shard(2))
    v = Tensor(mine["v"].copy(), requires_grad=True)
    y_row = tp.matmul_exit(h, v)
    assert pl.placement_tag(y_row, "tp") == pl.Shard(1)
    y_row.backward(mine["g"])
    got = {"y": y.data, "dx": x.grad, "dw": w.grad, "y_row": y_row.data, "dh": h.grad,
           "dv": v.grad}
    return got, tp.group.stats["bytes_sent"] - before


def rows_exact(products: set) -> bool:
    """Does this BLAS give every chunk product in `products` the bits of the same rows of
    the whole product, as the plain SP path computes it? Probed on random numbers of the same
    shapes and layouts (a BLAS picks its kernels by shape, not by value). A product is
    (B, T_tp, K, N, W, w stored transposed)."""
    rng = np.random.default_rng(0)
    for b, t, k, n, W, transposed in products:
        a = rng.standard_normal((b, W * t, k))
        w = rng.standard_normal((n, k)).T if transposed else rng.standard_normal((k, n))
        whole = mm(a, w)
        if not all(np.array_equal(mm(_chunk(a, c, W), w), _chunk(whole, c, W))
                   for c in range(W)):
            return False
    return True


def recording(products: set, W: int):
    """async_tp's mm, noting each chunk product's shape and layout for rows_exact."""
    def mm_noted(a, w):
        products.add(a.shape[:2] + w.shape + (W, not w.flags.c_contiguous))
        return mm(a, w)
    return mm_noted


def _against_plain(ctx, algo):
    pl.set_checking(True)
    r, W = ctx.rank, ctx.world_size
    products: set = set()
    async_tp.mm = recording(products, W)
    fast, sent = _layers(TensorParallel(ctx.world, True, algo=algo, async_tp=True), r, W)
    plain, plain_sent = _layers(TensorParallel(ctx.world, True, algo=algo), r, W)
    want = decomposed(r, W)
    for name in want:
        assert np.array_equal(fast[name], want[name]), f"{name}: not its decomposition"
    exact = algo == "direct" and rows_exact(products)
    for name in plain:
        if exact:
            assert np.array_equal(fast[name], plain[name]), f"{name} differs from plain SP"
        assert_close(fast[name], plain[name], atol=1e-12, what=f"{name} against plain SP")
    # bytes: the plain path's, and the closed form: each of the 5 collectives moves W-1
    # chunks of B T_tp C float64 (x, x again, dx, y_row, dy: all C_IN wide here)
    assert sent == plain_sent == 5 * (W - 1) * B * T_TP * C_IN * 8, (sent, plain_sent)
    return exact


@pytest.mark.multiproc
@pytest.mark.parametrize("W, algo", [(2, "direct"), (4, "direct"), (2, "ring"),
                                     pytest.param(4, "ring", marks=pytest.mark.slow),
                                     pytest.param(3, "direct", marks=pytest.mark.slow)])
def test_layers_compute_their_decomposition_and_the_plain_sp_numbers(W, algo):
    exact = spawn(W, _against_plain, algo)
    assert len(set(exact)) == 1            # every rank probed the same shapes


CFG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _gpt(ctx, async_on: bool, products: set):
    """Loss, every gradient and the bytes sent on tp, of one forward and backward."""
    pl.set_checking(True)
    async_tp.mm = recording(products, ctx.world_size)
    rng = np.random.default_rng(1)
    idx, targets = (rng.integers(0, CFG.vocab_size, (2, CFG.block_size)) for _ in range(2))
    tp = TensorParallel(ctx.world, True, algo="direct", async_tp=async_on)
    model = apply_tensor(GPT(CFG, 0), tp)
    before = ctx.world.stats["bytes_sent"]
    _, loss = model(idx, targets)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.data, grads, ctx.world.stats["bytes_sent"] - before


def _gpt_both(ctx):
    products: set = set()
    plain = _gpt(ctx, False, products)
    fast = _gpt(ctx, True, products)
    assert products, "async TP multiplied no chunk"
    exact = rows_exact(products)
    for name in ["loss"] + sorted(plain[1]):
        a, b = (fast[0], plain[0]) if name == "loss" else (fast[1][name], plain[1][name])
        if exact:
            assert np.array_equal(a, b), f"{name} differs from plain SP"
        assert_close(a, b, atol=1e-12, what=name)
    assert fast[2] == plain[2], (fast[2], plain[2])
    return exact, len(plain[1])


@pytest.mark.multiproc
def test_a_gpt_step_under_async_tp_equals_plain_sp():
    runs = spawn(2, _gpt_both)
    assert len({exact for exact, _ in runs}) == 1            # both ranks probed the same
    assert all(n == len(list(GPT(CFG, None).named_parameters())) for _, n in runs)


STEP_SEEN_WITHIN = 20.0          # seconds: a hang guard while the worker picks a step up


def _worker_in_a_step(group) -> str:
    """Wait until the tp group's call in progress is a started sendrecv (the worker's step);
    return its description. The peer is held back, so the step cannot finish meanwhile."""
    rec = group.records.current
    deadline = time.monotonic() + STEP_SEEN_WITHIN
    while not (rec[call.OP] == call.encode("sendrecv") and rec[call.STATE] == call.STARTED):
        assert time.monotonic() < deadline, "no step of the schedule started"
        time.sleep(1e-3)
    return call.describe(rec, group.group_names)


def _overlap(ctx):
    """Rank 1 enters each layer only when rank 0 lets it, from inside one of rank 0's chunk
    products: the column layer's first (its own chunk, while step 1 brings rank 1's) and
    the row layer's second (its own summand, while step 1 takes rank 1's away)."""
    tp_group = ctx.new_group([0, 1], name="tp")
    go = ctx.new_group([0, 1], name="go")
    tp = TensorParallel(tp_group, True, algo="direct", async_tp=True)
    x = pl.tag(Tensor(_chunk(_x(2), ctx.rank, 2).copy()), "tp", pl.Shard(1))
    h = pl.tag(Tensor(_draw(ctx.rank, 2)["h"]), "tp", pl.Shard(2))
    w, v = Tensor(_draw(ctx.rank, 2)["w"]), Tensor(_draw(ctx.rank, 2)["v"])
    seen, calls = [], [0]

    def mm_watched(a, b):
        calls[0] += 1
        if ctx.rank == 0 and calls[0] in (1, 4):     # column: products 1-2; row: 3-4
            seen.append(_worker_in_a_step(tp_group))
            C.send(np.zeros(1), 1, group=go)          # now rank 1 may take its part
        return mm(a, b)
    async_tp.mm = mm_watched
    if ctx.rank == 1:
        C.recv(np.empty(1), 0, group=go)
    y = tp.matmul(x, w)
    if ctx.rank == 1:
        C.recv(np.empty(1), 0, group=go)
    tp.matmul_exit(h, v)
    assert calls[0] == 4
    return seen, y.data


@pytest.mark.multiproc
def test_a_chunk_product_runs_while_its_step_is_in_flight():
    (seen, y), _ = spawn(2, _overlap, collective_timeout=20)   # a regression hangs: end it
    assert seen == [
        "sendrecv #1 on 'tp' (float64 (2, 4, 16), from group rank 1, to group rank 1, tag 1)",
        "sendrecv #2 on 'tp' (float64 (2, 4, 16), from group rank 1, to group rank 1, tag 1)"]
    assert_close(y, mm(_x(2), _draw(0, 2)["w"]), atol=1e-12, what="column y")


def test_async_tp_without_sequence_parallelism_is_refused():
    with pytest.raises(ValueError, match="Pass sequence_parallel=True too"):
        TensorParallel(object(), sequence_parallel=False, async_tp=True)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("axis", [["--pp", "2"], ["--cp", "2"], ["--dp", "2", "--zero", "3"]],
                         ids=lambda axis: " ".join(axis))
def test_async_tp_composes_with_the_other_axes(axis, capsys):
    from minidist import train_cli
    argv = ["--tp", "2", "--sp", "--async-tp", *axis, "--check", "--steps", "10",
            "--run-dir", "none"]
    assert train_cli.main(argv) == 0
    assert "\nOK: " in capsys.readouterr().out


@pytest.mark.multiproc
def test_the_main_job_with_async_tp_ends_ok_against_the_single_process(capsys):
    from minidist import train_cli
    argv = ["--tp", "2", "--sp", "--async-tp", "--check", "--steps", "20", "--run-dir", "none"]
    assert train_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "x tp=2 (SP, async)" in out and "\nOK: " in out, out
    assert train_cli.main(["--tp", "2", "--async-tp", "--steps", "1"]) == 2
    assert "give --sp" in capsys.readouterr().err
