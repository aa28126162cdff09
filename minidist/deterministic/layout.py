"""determinize_layout(model): the deterministic mode on one rank of a layout, applied the way a
parallelism applies itself: by replacing modules with their deterministic twins.

The model may be the single process's GPT or this rank's piece of any layout (tp with or
without SP, cp, ep, a pipeline stage, ZeRO's engine around it): it runs after the layout is
built and reads it from the model (model.layout.tp, .context). layers.determinize walks the
model; `OnThisRank` tells it what each twin is given on this rank, where
layers.SingleProcess tells it for the single process. Each twin holds the replaced
module's Parameter objects (layers.twin), so names, shards, ZeRO's flat buffers and the
optimizer's state are untouched; only how the sums are grouped changes.

What is replaced (gpt_tiles: the tiles by module name suffix, matmul.py):
    attn.qkv, attn.proj, mlp.fc, mlp.proj    Linear, Column/RowParallelLinear -> Tiled*
                                             with this rank's Tiles, Tokens of the bias
                                             gradient and, with token tiles, runs of rows
    every LayerNorm (SP ones too)            -> TreeLayerNorm / TreeSequenceParallelLayerNorm
    the layout (LM head and loss)            -> TiledLayout / TiledTensorParallelLayout,
                                             the head over single vocabulary columns
    every ExpertParallelMoE                  -> GrainExpertMoE (expert.py)
    with token_tiles N (what cp needs):
        every embedding                      -> its Tree twin over runs of T / N positions
        every attention's core               -> CanonicalAttention (attention.py)
The Tokens each twin gets hold this rank's positions and exchange over the ranks that hold
the others: tp under SP (tensor.tokens_on_rank), cp (context.context_tokens), both (then).

One rank's view: build the layout -> determinize_layout(model, token_tiles) -> train with
deterministic/step.py's step. No communication here; the twins' exchanges run in the
forward and backward (their costs: matmul.py, tensor.py, context.py).
Read next: deterministic/step.py.
"""

from __future__ import annotations

from minidist.deterministic.context import context_tokens
from minidist.deterministic.expert import GrainExpertMoE
from minidist.deterministic.layers import SingleProcess, determinize, twin
from minidist.deterministic.matmul import Tiles, Tokens
from minidist.deterministic.tensor import TiledColumnParallelLinear, TiledRowParallelLinear, \
    TiledTensorParallelLayout, TreeSequenceParallelLayerNorm, TreeSequenceParallelPositions, \
    TreeVocabParallelEmbedding, exchange_over, then, tiles_on_rank, tokens_on_rank
from minidist.nn.module import Module
from minidist.parallel.expert.expert_parallel import ExpertParallelMoE
from minidist.parallel.tensor.sequence import SequenceParallelLayerNorm, SequenceParallelPositions
from minidist.parallel.tensor.tensor_parallel import ColumnParallelLinear, RowParallelLinear, \
    TensorParallelLayout
from minidist.parallel.tensor.vocab import VocabParallelEmbedding

TILED = {ColumnParallelLinear: TiledColumnParallelLinear,
         RowParallelLinear: TiledRowParallelLinear}


def determinize_layout(model, token_tiles: int | None = None):
    """Replace this rank's modules by their deterministic twins (module docstring), in
    place; returns the model. token_tiles: runs of T / token_tiles positions for the
    matmuls' rows, the attention's queries and the sums over positions (context
    parallelism needs them; a ValueError names the fix when they are missing or the
    layout cuts a run)."""
    return determinize(model, given=OnThisRank(model, token_tiles))


class OnThisRank(SingleProcess):
    """What each twin is given on this rank: this tp rank's tiles, the Tokens of this
    rank's positions (exchanged over tp under SP, over cp, or both), cp's runs of rows."""

    def __init__(self, model, token_tiles: int | None = None) -> None:
        super().__init__(model.cfg, token_tiles)
        self.tp = tp = getattr(model.layout, "tp", None)
        context = getattr(model.layout, "context", None) if tp is None else tp.context
        if context is not None and context.group.size > 1:
            self.mine, self.rows = context_tokens(context, token_tiles)   # my cp positions
            self.exchange = None if tp is None else then(exchange_over(tp), self.rows.exchange)
        else:
            self.exchange = None if tp is None else exchange_over(tp)
            self.mine = Tokens()

    def tiles(self, p, k: int, n: int, transposed: bool = False,
              valid: int | None = None) -> Tiles:
        return tiles_on_rank(p, k, n, transposed, valid, tp=self.tp)

    def tokens(self, module) -> Tokens:
        return tokens_on_rank(module, self.tp, self.mine, self.exchange)

    def twin(self, name: str, m: Module) -> Module | None:
        kind = type(m)
        if kind is SequenceParallelLayerNorm:
            return twin(TreeSequenceParallelLayerNorm, m, tokens=self.tokens(m))
        k_n = self.tile_shape(name)
        if kind in TILED and k_n is not None:
            return twin(TILED[kind], m, tiles=self.tiles(m.weight, *k_n), tokens=self.tokens(m),
                        rows=self.rows)
        if kind is VocabParallelEmbedding and self.rows is not None:
            return twin(TreeVocabParallelEmbedding, m, tokens=self.rows)
        if kind is SequenceParallelPositions and self.rows is not None:
            return twin(TreeSequenceParallelPositions, m,   # my SP positions, over tp
                        tokens=Tokens(self.tp.positions, self.exchange, self.token_tiles))
        if kind is ExpertParallelMoE:
            return twin(GrainExpertMoE, m, grain_aliases={}, micro_batch=0)
        return super().twin(name, m)

    def layout(self, layout, head_tiles: Tiles, loss_tokens: Tokens | None):
        if isinstance(layout, TensorParallelLayout):
            return twin(TiledTensorParallelLayout, layout, head_tiles=head_tiles,
                        rows=self.rows, loss_tokens=loss_tokens)
        return super().layout(layout, head_tiles, loss_tokens)
