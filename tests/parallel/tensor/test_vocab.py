"""Vocabulary parallelism: the padded embedding and the loss computed from vocabulary shards
equal the unsharded ones, and logits that are not a shard are refused. The default run
takes tp = 2 (11 rows are padded over every tp > 1); `-m slow` adds tp = 3, 4."""

import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.autograd import functional as F
from minidist.nn import Embedding
from minidist.parallel import placement as pl
from minidist.parallel.tensor.tensor_parallel import TensorParallel
from minidist.parallel.tensor.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy
from minidist.parallel.tensor.vocab import vocab_range
from minidist.runtime.errors import RankFailure
from minidist.runtime.launch import spawn
from minidist.seed import init_parameters
from tests.helpers import assert_close, dist_gradcheck

V, C = 11, 4                                     # 11 rows: padded over every tp > 1
IDS = np.array([[0, 5, 10, 3], [7, 7, 1, 9]])   # (B, T)
TARGETS = np.array([[3, -100, 10, 0], [6, 2, -100, 8]])


def _tp(ctx):
    pl.set_checking(True)
    return TensorParallel(ctx.world, algo="direct")


def _embedding(ctx):
    tp = _tp(ctx)
    full = Embedding(V, C)
    init_parameters(full, 4, "wte.")
    part = VocabParallelEmbedding(full, tp)
    y_full = full(IDS)
    (y_full ** 2).sum().backward()
    y = part(IDS)
    (y ** 2).sum().backward()
    lo, hi = vocab_range(V, tp)
    padded = np.zeros((ctx.world_size * (hi - lo), C))
    padded[:V] = full.weight.grad
    assert_close(y.data, y_full.data, atol=1e-12, what="lookup")
    assert_close(part.weight.grad, padded[lo:hi], atol=1e-12, what="dW rows (padding: 0)")
    assert pl.placement_tag(y, "tp") == pl.Replicate()
    padding = part.weight.data[max(0, V - lo):].tolist()

    def lookup(w):                                   # the layer with w as its table shard
        part.weight = w
        return part(IDS)
    dist_gradcheck(lookup, part.weight.data, ctx.world, x_placement="shard",
                   loss_placement="replicate", what="VocabParallelEmbedding dW")
    return lo, hi, padding


@pytest.mark.multiproc
@pytest.mark.parametrize("W", [2] + [pytest.param(W, marks=pytest.mark.slow) for W in (3, 4)])
def test_padded_vocab_parallel_embedding_equals_the_full_table(W):
    ranges = spawn(W, _embedding)
    per = -(-V // W)
    assert [(lo, hi) for lo, hi, _ in ranges] == [(r * per, (r + 1) * per) for r in range(W)]
    assert all(np.all(np.array(pad) == 0) for _, _, pad in ranges)   # padding rows are zeros


def _loss(ctx):
    tp = _tp(ctx)
    z_full = np.random.default_rng(5).standard_normal((2, 4, V))
    ref = F.cross_entropy(Tensor(z_full), TARGETS, reduction="sum").item()
    lo, hi = vocab_range(V, tp)
    z = np.zeros((2, 4, hi - lo))
    z[..., :max(0, min(hi, V) - lo)] = z_full[..., lo:min(hi, V)]
    z[..., max(0, V - lo):] = 1e3                 # junk in padded columns must not count
    got = vocab_parallel_cross_entropy(pl.tag(Tensor(z), "tp", pl.Shard(2)), TARGETS, tp, V)
    dist_gradcheck(lambda t: vocab_parallel_cross_entropy(pl.tag(t, "tp", pl.Shard(2)),
                                                          TARGETS, tp, V),
                   np.where(np.arange(hi - lo) + lo < V, z, 0.0), ctx.world,
                   x_placement="shard", loss_placement="replicate", what="vocab-parallel CE")
    return got.item(), ref


@pytest.mark.multiproc
@pytest.mark.parametrize("W", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_vocab_parallel_cross_entropy_equals_the_full_loss(W):
    for got, ref in spawn(W, _loss):
        assert abs(got - ref) < 1e-12


def _gathered_logits(ctx, tagged_right_shape):
    tp = _tp(ctx)
    lo, hi = vocab_range(V, tp)
    z = np.zeros((2, 4, hi - lo if tagged_right_shape else V))
    logits = pl.tag(Tensor(z), "tp", pl.Replicate())     # e.g. all-gathered, then cut
    vocab_parallel_cross_entropy(logits, TARGETS, tp, V)


@pytest.mark.multiproc
def test_gathered_logits_are_refused_by_name():
    # Megatron-LM #7452: gathered logits silently gave a loss off by log(tp)
    with pytest.raises(RankFailure, match=r"logits have 11 vocabulary columns, but this tp "
                                          r"rank's shard of V=11 over tp=2 has 6"):
        spawn(2, _gathered_logits, False)
    with pytest.raises(RankFailure, match=r"input 'logits' must be Shard\(2\) over tp, but it "
                                          r"is Replicate\(\)"):
        spawn(2, _gathered_logits, True)
