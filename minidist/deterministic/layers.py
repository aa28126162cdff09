"""Deterministic twins of the dense layers: the same parameters, every sum in a fixed tree.

The mode leaves nn/ as it is. It REPLACES each layer whose bits depend on a shape or on a
grouping by a twin: an instance of a subclass that holds the same Parameter objects and
settings (`twin`) and computes the same function, adding in the trees of matmul.py:

    Linear            -> TiledLinear      y = x @ W over fixed tiles of W (TiledMatMul);
                                          db = the sum over tokens in the tree (BiasAdd)
    LayerNorm         -> TreeLayerNorm    dg, db = sums over tokens in the tree
    Embedding         -> TreeEmbedding    (token tiles) each run of positions adds its
                                          gradient into a table of its own; the tables are
                                          summed in the tree over the runs' global index
    the GPT's layout  -> TiledLayout      the LM head over single vocabulary columns; the
                                          loss's softmax sum over V and sum over tokens in
                                          trees (TreeCrossEntropy)

The autograd Functions behind them subclass the plain ones and change only the sums:
TreeLayerNormFunction takes LayerNorm's forward and its gradient formulas
(fused.layer_norm_grads) with the tree as the sum over tokens; TreeCrossEntropy takes
fused.softmax_losses with the tree as the sum over V; TreeEmbeddingFunction keeps
Embedding's forward and adds its backward's rows per run.

and, with token tiles, every attention's core -> CanonicalAttention (attention.py).

`determinize(model)` makes the replacements, asking a `SingleProcess` what each twin is
given: the tiles of a weight (gpt_tiles, all of them here), the Tokens of its sums (every
position, nothing to exchange) and the runs of rows. deterministic/layout.py answers the
same questions for one rank of a layout, whose Tokens exchange their nodes with the ranks
that hold the other positions, so each rank combines the whole sum.
Shapes: those of the layers they replace. Cost: matmul.py's.
Read next: deterministic/tensor.py (the tensor-parallel twins).
"""

from __future__ import annotations

from minidist import backend
from minidist.autograd import Tensor
from minidist.autograd import functional as F
from minidist.autograd import fused
from minidist.autograd.tensor import Context
from minidist.deterministic.attention import CanonicalAttention
from minidist.deterministic.matmul import Tiles, Tokens, add_bias, gpt_tiles, tiled_matmul, \
    tree_over_tiles
from minidist.nn.attention import CausalSelfAttention
from minidist.nn.gpt import GPTLayout
from minidist.nn.layers import Embedding, LayerNorm, Linear
from minidist.nn.module import Module


def twin(cls: type, module, **changes):
    """An instance of `cls` (a subclass of module's class) holding module's attributes,
    the same Parameter objects included, with `changes` set on it."""
    new = cls.__new__(cls)
    vars(new).update(vars(module))
    vars(new).update(changes)
    return new


# --- the Functions -----------------------------------------------------------------------

class TreeLayerNormFunction(fused.LayerNorm):
    """fused.LayerNorm with dw and db summed over the tokens by tokens.sum (the tree)."""

    @staticmethod
    def forward(ctx: Context, x, w, b, *, eps: float, tokens: Tokens):
        ctx.tokens = tokens
        return fused.LayerNorm.forward(ctx, x, w, b, eps=eps)

    @staticmethod
    def backward(ctx: Context, g) -> tuple:
        return fused.layer_norm_grads(ctx, g, ctx.tokens.sum)


class TreeCrossEntropy(fused.CrossEntropy):
    """The sum over counted tokens of CE (fused.CrossEntropy, reduction "sum"), the
    softmax's sum over V in the aligned tree over the classes and the sum over tokens by
    tokens.sum (None: NumPy's sum, enough when a grain's tokens are all here and no
    position runs are asked for); `shape` is the targets' (B, T_r)."""

    @staticmethod
    def forward(ctx: Context, z, *, t, tokens: Tokens | None, shape: tuple):
        losses = fused.softmax_losses(ctx, z, t, -100, "sum", sum_over_classes_in_tree)
        return losses.sum() if tokens is None else tokens.sum(losses.reshape(shape))


def sum_over_classes_in_tree(p):
    """p (N, V) -> (N, 1): each row's sum in the aligned tree over its V classes."""
    V = p.shape[1]
    return tree_over_tiles(p.T, tuple(range(V)), V, None)[:, None]


class TreeEmbeddingFunction(F.Embedding):
    """F.Embedding whose backward adds each leaf's rows (a run of positions of tokens)
    into a table of its own, and sums the tables in the aligned tree over the leaves'
    global index (exchanged when other ranks hold other positions)."""

    @staticmethod
    def forward(ctx: Context, w, ids, *, tokens: Tokens):
        ctx.tokens = tokens
        return F.Embedding.forward(ctx, w, ids)

    @staticmethod
    def backward(ctx: Context, g) -> tuple:
        xp = backend.xp
        (ids,) = ctx.saved_tensors
        rows = ids.reshape(-1, ids.shape[-1])                          # (B, T_r)
        index, count = ctx.tokens.leaves(rows.shape)
        tokens = ctx.tokens.split(rows)                                # (leaves, L)
        leaf = xp.repeat(xp.arange(len(index)), tokens.shape[1])
        parts = xp.zeros((len(index),) + tuple(ctx.shape), dtype=g.dtype)
        grads = ctx.tokens.split(g.reshape(rows.shape + (ctx.shape[1],)))   # (leaves, L, C)
        xp.add.at(parts, (leaf, tokens.reshape(-1)), grads.reshape(-1, ctx.shape[1]))
        return tree_over_tiles(parts, index, count, ctx.tokens.exchange), None


def tree_embedding(weight: Tensor, ids, tokens: Tokens) -> Tensor:
    """F.embedding with TreeEmbeddingFunction's backward."""
    return TreeEmbeddingFunction.apply(weight, F.embedding_ids(weight, ids), tokens=tokens)


def tree_layer_norm(x: Tensor, weight, bias, eps: float, tokens: Tokens) -> Tensor:
    """F.layer_norm with TreeLayerNormFunction's sums over tokens."""
    x, weight, bias = (F.fp32_input(v) for v in (x, weight, bias))   # mixed precision
    return TreeLayerNormFunction.apply(x, weight, bias, eps=eps, tokens=tokens)


def tree_cross_entropy(logits: Tensor, targets, tokens: Tokens | None) -> Tensor:
    """F.cross_entropy(reduction="sum") with TreeCrossEntropy's sums (ignore_index -100)."""
    t = F.cross_entropy_targets(logits, targets)
    logits = F.fp32_input(logits)                                   # mixed precision
    z = logits if logits.ndim == 2 else logits.reshape(-1, logits.shape[-1])
    return TreeCrossEntropy.apply(z, t=t.reshape(-1), tokens=tokens, shape=tuple(t.shape))


# --- the layers ------------------------------------------------------------------------

class TiledLinear(Linear):
    """Linear over `tiles` (and runs of `rows`), its bias gradient summed over `tokens`."""

    tiles: Tiles
    tokens: Tokens
    rows: Tokens | None

    def forward(self, x: Tensor) -> Tensor:
        y = tiled_matmul(x, self.weight, self.tiles, self.rows)          # (..., C) @ (C, F)
        return y if self.bias is None else add_bias(y, self.bias, self.tokens)


class TreeLayerNorm(LayerNorm):
    """LayerNorm whose gain and shift gradients are summed over `tokens` in the tree."""

    tokens: Tokens

    def forward(self, x: Tensor) -> Tensor:
        return tree_layer_norm(x, self.weight, self.bias, self.eps, self.tokens)


class TreeEmbedding(Embedding):
    """Embedding whose gradient is summed over the runs of `tokens` in the tree."""

    tokens: Tokens

    def forward(self, ids) -> Tensor:
        return tree_embedding(self.weight, ids, self.tokens)


class TiledLayout(GPTLayout):
    """The GPT's layout with the LM head over `head_tiles` (one vocabulary column each; runs
    of `rows` under token tiles) and the loss in trees (TreeCrossEntropy, its sum over
    tokens by `loss_tokens`); positions and dropout shards are those of `inner`, the
    layout it replaces (the single process's, or context parallelism's)."""

    def __init__(self, inner: GPTLayout, head_tiles: Tiles, rows: Tokens | None,
                 loss_tokens: Tokens | None) -> None:
        self.inner, self.head_tiles, self.rows = inner, head_tiles, rows
        self.loss_tokens = loss_tokens

    def positions(self, T: int):
        return self.inner.positions(T)

    def sequence_shards(self, rows: int) -> dict:
        return self.inner.sequence_shards(rows)

    def logits(self, x: Tensor, w: Tensor) -> Tensor:
        return tiled_matmul(x, w, self.head_tiles, self.rows)           # (B, T, C) @ (C, V)

    def loss_sum(self, logits: Tensor, targets) -> Tensor:
        return tree_cross_entropy(logits, backend.xp.asarray(targets), self.loss_tokens)


# --- replacing them --------------------------------------------------------------------

class SingleProcess:
    """What each twin is given in the single process: whole weights, every position here,
    token tiles as runs of T / token_tiles (nothing to exchange)."""

    def __init__(self, cfg, token_tiles: int | None = None) -> None:
        self.cfg, self.token_tiles = cfg, token_tiles
        self.rows = None if token_tiles is None else Tokens(per_sequence=token_tiles)

    def tiles(self, p, k: int, n: int, transposed: bool = False,
              valid: int | None = None) -> Tiles:
        """The Tiles of weight p (K, N), or of p^T when transposed: all of them."""
        K, N = p.shape[::-1] if transposed else p.shape
        return Tiles.whole(K, N, k, n)

    def tokens(self, module) -> Tokens:
        """The Tokens of a LayerNorm's or tiled Linear's sums over tokens: all here."""
        return Tokens()

    def twin(self, name: str, m: Module) -> Module | None:
        """The twin of module m, at dotted `name` in the model (None: m stays)."""
        kind = type(m)
        if kind is LayerNorm:
            return twin(TreeLayerNorm, m, tokens=self.tokens(m))
        k_n = self.tile_shape(name)
        if kind is Linear and k_n is not None:
            return twin(TiledLinear, m, tiles=self.tiles(m.weight, *k_n), tokens=self.tokens(m),
                        rows=self.rows)
        if kind is Embedding and self.rows is not None:
            return twin(TreeEmbedding, m, tokens=self.rows)
        return None

    def tile_shape(self, name: str) -> tuple[int, int] | None:
        """(k, n) of the tiles of the matmul at `name` (gpt_tiles), or None: not tiled."""
        return next((k_n for suffix, k_n in gpt_tiles(self.cfg).items()
                     if name.endswith(suffix)), None)

    def layout(self, layout: GPTLayout, head_tiles: Tiles, loss_tokens: Tokens | None):
        """The layout that replaces `layout`: the head over head_tiles, the loss in trees."""
        return TiledLayout(layout, head_tiles, self.rows, loss_tokens)


def determinize(model, token_tiles: int | None = None, given: SingleProcess | None = None):
    """Replace model's layers by their twins (module docstring), in place; returns the
    model. given: what the twins are given (default: the single process's, with
    token_tiles runs per sequence; deterministic/layout.py passes a rank's)."""
    given = SingleProcess(model.cfg, token_tiles) if given is None else given
    for name, parent in reversed(list(model.named_modules())):   # children first: a twin
        for attr, child in list(vars(parent).items()):           # copies its children
            if isinstance(child, Module):
                new = given.twin(f"{name}.{attr}" if name else attr, child)
                if new is not None:
                    setattr(parent, attr, new)
    if given.rows is not None:
        for _, m in model.named_modules():
            if isinstance(m, CausalSelfAttention):
                m.core = CanonicalAttention(given.rows)
    cfg = model.cfg
    head = getattr(model, "wte" if cfg.tie_weights else "lm_head", None)
    if head is not None:                       # (a middle pipeline stage has no head)
        head_tiles = given.tiles(head.weight, cfg.n_embd, 1, cfg.tie_weights, cfg.vocab_size)
        rows = given.rows
        loss_tokens = None if rows is None else Tokens(rows.positions, rows.exchange)
        model.layout = given.layout(model.layout, head_tiles, loss_tokens)
    return model
