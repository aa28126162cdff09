"""The deterministic step: each grain's gradient on its own, the grains added in one fixed
tree over their global index, whichever rank computed them.

A dp rank normally sums its micro-batches' gradients, then the ranks sum their partial sums
(all-reduce, reduce-scatter): how the samples are grouped shows in the last bits. Here the
grain is one sample (tree_sum.py): every layout computes each sample's gradient with the
same operations on the same shapes, and the samples' gradients are added in one fixed tree
over their global row indices 0..B-1, as train_single_process(deterministic=True) does.

One rank's view of a step (dp rank d of the dp group, holding rows [a_d, b_d) of the
global batch, any number of micro-batches asked for: the grain decides, not M; written
here for a grain of one sample):
    1. for each of my rows i, in order: forward and backward of that one sample inside
       engine.no_sync(); push (i, my local gradient) into a TreeSum and zero the local
       gradient; push (i, its loss) into a second TreeSum
    2. all_gather the nodes of both trees over dp (the node count and ranges first)
    3. root = tree_sum.combine(every node, B): the same bits on every rank; the norm of
       the root in parameter order and its clipping, exactly as the single process
    4. hand the root to the engine through its own reduction: rank 0's local gradient
       becomes the root, every other rank's becomes zeros, and engine.step() reduces as
       always (DDP all-reduce, ZeRO reduce-scatter, any algorithm): root + 0 + ... + 0 is
       the root exactly, whatever the order of the additions, so each rank ends with the
       root (or its shard of it) and the optimizer runs on it unchanged
    5. the step's loss: combine of the loss nodes, kept by rank 0 only (the others add 0)
Pipeline stages (`pipeline_step`, every schedule): each stage runs its schedule on the
one-grain micro-batches; the gradient each backward action (B, and W when zero bubble
splits the backward) adds to the stage's parameters is taken after it and added to its
sample's share. Each parameter gets a sample's gradient from one action only (a chunk's
W, or its B when full recomputation runs the block's whole backward there), so adding the
actions' parts is exact (x + 0 = x), interleaved chunks' included. The
tied wte has two shares, the embedding's on the first stage and the head's on the last:
the two exchange them per grain over the embedding group and add them (a + b = b + a
exactly, as the single process's leaf adds them), so both stages push the same wte
gradient. The norm adds each parameter's sum of squares in the single process's parameter
order, gathered over pp.
The grain: `grain` rows per leaf (default 1, --grain). Any grain gives a bitwise
reproducible run; layouts agree with each other and with the single process at the same
grain, and each dp rank must hold whole grains. A larger grain runs larger matmuls (closer
to the plain mode's speed) and fewer leaves; grain = B / dp is the plain mode's own
micro-batch.
Communication: the nodes (at most about 2 log2(B) gradients per rank, all-gathered) plus
the engine's usual reduction of one gradient; the reference pays it for exactness.
Read next: train.py (--deterministic), which calls check, determinize and step.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from minidist import collectives as C
from minidist.deterministic.matmul import Tokens
from minidist.deterministic.tensor import square_sums
from minidist.deterministic.tree_sum import TreeSum, combine, gather_nodes
from minidist.nn import GPT
from minidist.optim.clip import clip_to
from minidist.parallel.context.ring_attention import sequence_layout


def check(plan, cfg, spike: bool = False, rebalance: bool = False, grain: int = 1,
          global_batch: int | None = None, token_tiles: int | None = None,
          seq_len: int | None = None) -> None:
    """ValueError unless the deterministic mode covers this layout (module docstring) with
    micro-batches of `grain` rows on every dp rank, and (with seq_len = T) runs of T /
    token_tiles positions that every rank holds whole. spike: the spike guard is on;
    rebalance: the straggler handler moves rows between ranks."""
    if not isinstance(grain, int) or isinstance(grain, bool) or grain < 1:
        raise ValueError(f"--grain {grain!r}: the deterministic grain must be an int >= 1 "
                         f"(rows per leaf of the sum's tree).")
    if global_batch is not None and (global_batch // plan.dp) % grain:
        rows = global_batch // plan.dp
        fits = [g for g in range(grain, 0, -1) if rows % g == 0][0]
        raise ValueError(f"--grain {grain}: each of the dp={plan.dp} ranks holds "
                         f"{rows} rows, not a whole number of grains; use --grain {fits} "
                         f"(a divisor of {rows}).")
    if token_tiles is not None and (isinstance(token_tiles, bool) or not
                                    isinstance(token_tiles, int) or token_tiles < 1):
        raise ValueError(f"--token-tiles {token_tiles!r}: an int >= 1 (runs per sequence).")
    if plan.cp > 1 and token_tiles is None:
        chunks = 2 * plan.cp if plan.cp_layout == "zigzag" else plan.cp
        raise ValueError(f"--deterministic with cp={plan.cp} needs --token-tiles N: every "
                         f"sum over positions then runs over N runs of T / N positions, "
                         f"and each cp rank must hold whole runs (N a multiple of {chunks} "
                         f"for the {plan.cp_layout} layout that divides T).")
    if plan.cp > 1 and seq_len is not None:
        problem = whole_token_runs(plan, seq_len, token_tiles)
        if problem is not None:
            raise ValueError(f"--token-tiles {token_tiles}: {problem}.")
    if plan.cp > 1 and cfg.moe_every:
        raise ValueError(f"--deterministic covers dp, ZeRO 0-3, pp (every schedule), tp "
                         f"(+SP), ep, cp and any micro-batch count; not yet cp={plan.cp} "
                         f"with MoE blocks (moe_every={cfg.moe_every}), whose token sums "
                         f"across ranks run over other grains. Drop one of the two, or "
                         f"run without --deterministic (equal within ~1e-12 in float64).")
    if plan.expert_tp > 1:
        raise ValueError(f"--deterministic with expert_tp={plan.expert_tp}: not built yet "
                         "(each expert's partial outputs are summed over the etp ranks, "
                         "another order than the single process's matmul); drop one of "
                         "the two (without --deterministic the layout equals the single "
                         "process within ~1e-12 in float64).")
    if plan.async_tp:
        raise ValueError("--deterministic with --async-tp: the mode's tiled tp layers replace "
                         "the ones async TP overlaps; drop one of the two.")

    if plan.precision == "fp8" and plan.fp8_recipe in ("delayed", "tensorwise"):
        raise ValueError(f"--deterministic --precision fp8 --fp8-recipe {plan.fp8_recipe}: a "
                         "per-tensor scale comes from the amax of the rows and columns a "
                         "rank holds, which the layouts cut differently; use --fp8-recipe "
                         "rowwise, blockwise or mxfp8 (the tiled layers then scale per "
                         "tile, which no layout cuts).")
    if spike:
        raise ValueError("--deterministic with --spike: not supported together yet; the "
                         "spike guard steps the engine itself.")
    if rebalance:
        raise ValueError("--deterministic with --straggler rebalance: not supported yet "
                         "(uneven rows are, through train_on_rank's rows; use detect).")
    if cfg.moe_every and cfg.routing_group > grain * cfg.block_size:
        raise ValueError(f"--deterministic: a MoE routing group of {cfg.routing_group} "
                         f"tokens spans several grains of {grain} sample(s); use "
                         f"--moe-group-size <= {grain * cfg.block_size} or a larger --grain.")


def whole_token_runs(plan, T: int, token_tiles: int) -> str | None:
    """None if every rank's positions of a sequence of T (its cp rank's, and under sequence
    parallelism its tp slice of those) are whole runs of T / token_tiles, the leaves of the
    sums over positions (matmul.Tokens.leaves, which the backward asks); else what is cut."""
    if T % token_tiles:
        return f"T={T} positions do not cut into {token_tiles} equal runs"
    for who, pos in _position_pieces(plan, T):
        if not _whole_runs(pos, T, token_tiles):
            fewest = fewest_token_tiles(plan, T)
            return (f"{who} holds positions {pos[0]}..{pos[-1]} of T={T}, not whole runs "
                    f"of T / {token_tiles} = {T // token_tiles}"
                    + (f"; use --token-tiles {fewest} (the fewest runs every rank holds "
                       "whole)" if fewest is not None else ""))
    return None


def fewest_token_tiles(plan, T: int) -> int | None:
    """The smallest token_tiles whose runs every rank holds whole, None if the layout
    cannot cut T at all. Every rank's share of a sequence starts and ends on multiples of
    T / cut (its cp chunks: cut = 2 cp zig-zag, cp contiguous) and, under sequence
    parallelism, of T / (cp tp) (its tp slice of them), so the longest run that fits all
    shares is their gcd: token_tiles = T / gcd = lcm(cut, cp tp). A formula, not a search,
    so a typed --length costs nothing here (whole_token_runs checks it on small T)."""
    cut = 2 * plan.cp if plan.cp_layout == "zigzag" else plan.cp
    n = math.lcm(cut, plan.cp * plan.tp) if plan.sequence_parallel else cut
    return n if T % n == 0 else None


def _position_pieces(plan, T: int):
    """(who, global positions) of each rank's share of a sequence: its cp rank's positions,
    cut over tp under sequence parallelism."""
    pieces = plan.tp if plan.sequence_parallel else 1
    for c, mine in enumerate(sequence_layout(T, plan.cp, plan.cp_layout)):
        for t, pos in enumerate(np.split(mine, pieces)):
            yield f"cp rank {c}" + (f", tp rank {t}" if pieces > 1 else ""), pos


def _whole_runs(pos: np.ndarray, T: int, token_tiles: int) -> bool:
    """Are positions `pos` of T whole runs of T / token_tiles? (Tokens.leaves decides.)"""
    tokens = Tokens(positions=lambda rows: (pos, T), per_sequence=token_tiles)
    try:
        tokens.leaves((1, len(pos)))
    except ValueError:
        return False
    return True


def _over(group):
    """all_gather over group, for tree_sum.gather_nodes."""
    return functools.partial(C.all_gather, group=group, algo="ring")


def my_rows(rows, global_batch: int, dp: int, d: int) -> tuple[int, int]:
    """(first global row, number of rows) of dp rank d: rows[d] after those of ranks < d,
    or an even split when rows is None."""
    if rows is None:
        return d * (global_batch // dp), global_batch // dp
    return sum(rows[:d]), rows[d]


@functools.lru_cache(maxsize=8)
def param_order(cfg) -> list[str]:
    """The single process's parameter names in model.parameters() order (the norm's)."""
    return [name for name, _ in GPT(cfg, seed=None).named_parameters()]


def local_views(engine, params: list) -> list[np.ndarray]:
    """Writable views of this rank's not-yet-reduced gradient of each parameter (after
    backwards inside no_sync()): ZeRO's flat unit buffers (any stage), DDP's .grad."""
    if hasattr(engine, "_unit_of"):                       # ZeroEngine: flat unit buffers
        out = []
        for p in params:
            i, k = engine._unit_of[id(p)]
            s = engine.units[i].slots[k]
            out.append(engine._grad_buffer(i)[s.offset:s.offset + s.numel].reshape(s.shape))
        return out
    for p in params:                                      # DataParallel: .grad itself
        if p.grad is None:
            p.grad = np.zeros_like(p.data)
    return [engine.local_grad(p) for p in params]


def step(engine, named: list, batches: list, first: int, leaves: int, n_tokens: int,
         group, lr: float, clip_grad: float | None, tp_group=None, experts=None,
         order: list[str] | None = None, owners=None) -> tuple[float, float]:
    """Steps 1-5 of the module docstring for this rank's one-grain micro-batches (the first
    of them is leaf `first` of the `leaves` of the global batch); returns (global loss or
    0.0, gradient norm). named: the model's (name, parameter) pairs; tp_group: the tensor-
    parallel group when the parameters are tp shards (their norm is over whole ones);
    experts: deterministic/expert.ExpertGrains under expert parallelism (the experts'
    gradients come from it); order: the single process's parameter names (default: named's);
    owners: the engine's gradient group when it is more than `group` (dp x cp: its rank 0
    hands the root over, since every cp rank holds the whole root)."""
    owners = group if owners is None else owners
    params = [p for _, p in named]
    grads, losses = TreeSum(), TreeSum()
    S = engine.loss_seed()                 # the gradients carry S under fp16 loss scaling
    if experts is not None:
        experts.begin(first)
    for j, mb in enumerate(batches):
        if experts is not None:
            experts.at(j)
        with engine.no_sync():
            _, loss = engine.forward(mb.x, mb.y, n_tokens=n_tokens, aux_weight=mb.aux_weight,
                                     dropout_key=mb.dropout_key)
            loss.backward()
        if experts is not None:
            experts.take(j)
        views = local_views(engine, params)
        grads.push(first + j, np.concatenate([v.reshape(-1) for v in views]))
        losses.push(first + j, np.asarray(loss.data, np.float64).reshape(1))
        for v in views:
            v[...] = 0
    dtype = params[0].data.dtype
    size = sum(p.data.size for p in params)
    bound = len(batches)                              # every dp rank holds as many grains
    root = combine(gather_nodes(grads.nodes(), (size,), dtype, _over(group), bound), leaves)
    total = combine(gather_nodes(losses.nodes(), (1,), np.float64, _over(group), bound),
                    leaves)
    pieces, at = [], 0
    for p in params:                                  # the root, cut into parameters
        pieces.append(root[at:at + p.data.size].reshape(p.data.shape).copy())
        at += p.data.size
    owner = [owners.rank == 0] * len(named)           # who hands each root to the engine
    if experts is not None:                           # my experts: their own tree, over edp
        mine = experts.roots(leaves)
        for i, (name, _) in enumerate(named):
            if name in mine:
                pieces[i], owner[i] = mine[name], experts.edp.rank == 0
    norm = _global_norm([(n, g, p) for (n, p), g in zip(named, pieces)],  # as the single
                        order or [n for n, _ in named],                   # process adds
                        [None if experts is None else experts.ep], tp_group)
    if clip_grad is not None:
        clip_to(pieces, norm, clip_grad * S)          # S: fp16's loss scale, else 1
    for v, g, own in zip(local_views(engine, params), pieces, owner):
        v[...] = g if own else 0
    engine.step(lr, None)                             # root + zeros: the root, exactly
    return (float(total[0]) if owners.rank == 0 else 0.0), norm / S


def _global_norm(named: list, order: list[str], groups: list, tp_group=None) -> float:
    """sqrt of the sum of each parameter's sum of squares, added in `order` (the single
    process's parameter order) whichever rank holds it (a pipeline stage, an expert's ep
    rank: the table is all-gathered over each of `groups`), as optim.global_grad_norm adds.
    named: (name, gradient, parameter); a tp shard's square sum is the whole gradient's."""
    index = {n: i for i, n in enumerate(order)}
    mine = np.full(len(order), np.nan)
    for (name, _, _), sq in zip(named, square_sums(named, tp_group)):
        mine[index[name]] = sq
    for grp in groups:
        if grp is not None:                   # the first rank that holds each parameter
            table = C.all_gather(mine, group=grp)
            held = ~np.isnan(table)
            first = np.where(held.any(axis=0), held.argmax(axis=0), 0)
            mine = table[first, np.arange(len(order))]
    total = 0.0
    for value in mine:
        total += float(value)
    return math.sqrt(total)


def _with_aux_terms(ce: dict, stage, batches: list, pp_group) -> dict:
    """{m: the grain's loss (float64, (1,))} on the last stage: its cross-entropy part plus
    every MoE layer's aux term, whichever stage computed it, added in layer order in the
    model's dtype, as GPT.loss adds them. COLLECTIVE over pp for a MoE model: each stage's
    terms (float64 holds them exactly) are summed with the others' zeros, which is exact."""
    cfg = stage.model.cfg
    moe = [i for i in range(cfg.n_layer) if cfg.is_moe(i)]
    terms = np.zeros((len(batches), cfg.n_layer))
    for (m, i), v in stage.aux_values.items():
        terms[m, i] = float(v)
    if moe and pp_group is not None:
        terms = C.all_gather(terms, group=pp_group).sum(axis=0)
    out = {}
    for m, total in ce.items():
        for i in moe:
            total = total + np.asarray(terms[m, i], total.dtype) * batches[m].aux_weight
        out[m] = np.asarray(total, np.float64).reshape(1)
    return out


def _over_mirror(per_sample: dict, mirror) -> dict:
    """DualPipe's copies: every parameter is on stage s and P-1-s, and each sample's
    gradient of it is on one of them (the other's share is 0: x + 0 = x), except the tied
    wte of the end stages, whose embedding and head shares are a + b = b + a exactly.
    COLLECTIVE over the mirror pair."""
    keys = sorted(per_sample)
    both = C.all_gather(np.stack([per_sample[m] for m in keys]), group=mirror)
    return {m: both[0, j] + both[1, j] for j, m in enumerate(keys)}


def _losses_over_mirror(losses: dict, n: int, mirror) -> dict:
    """{m: loss} of both directions: the first half's from stage P-1, the rest from stage
    0. COLLECTIVE over the mirror pair of stages 0 and P-1."""
    mine = np.full(n, np.nan)
    for m, v in losses.items():
        mine[m] = float(np.asarray(v).reshape(-1)[0])
    both = C.all_gather(mine, group=mirror)
    dtype = next(iter(losses.values())).dtype if losses else np.float64
    return {m: np.asarray(both[1 - int(np.isnan(both[1, m])), m], dtype)
            for m in range(n)}


def pipeline_step(engine, stage, batches: list, first: int, leaves: int,
                  n_tokens: int, group, pp_group, order: list[str], lr: float,
                  clip_grad: float | None, tp_group=None, owners=None, experts=None
                  ) -> tuple[float, float]:
    """step() for a pipeline stage (module docstring); returns (loss or 0.0, norm).
    experts: as step()'s, its aliases kept per micro-batch until the schedule ends."""
    owners = group if owners is None else owners
    S = engine.loss_seed()                 # the gradients carry S under fp16 loss scaling
    if experts is not None:
        experts.begin(first)
    named = list(stage.model.named_parameters())
    params = [p for _, p in named]
    last = stage.cut.last
    per_sample, losses = {}, {}
    engine.begin_step()                               # mixed precision: autocast on
    stage.begin(batches, n_tokens, engine.loss_seed())
    with engine.no_sync():
        for a in stage.schedule.actions[stage.cut.stage]:
            if experts is not None:           # (a recomputing B makes new aliases: kept)
                experts.at(a.micro_batch)
            stage.run(a)
            for p in a.parts():               # (an FB: its F, then its B)
                if p.kind == "F" and stage.cut.vstage(p.chunk) == stage.last_vstage:
                    # the sample's loss without the MoE terms, before B drops the graph
                    losses[p.micro_batch] = stage.live[p.micro_batch, p.chunk]["ce"].data
            back = [p for p in a.parts() if p.kind in ("B", "W")]
            if back:                          # this action's share of the sample's gradient
                views = local_views(engine, params)
                part = np.concatenate([v.reshape(-1) for v in views])
                m = back[0].micro_batch       # each parameter's from one action: x + 0 = x
                per_sample[m] = part if m not in per_sample else per_sample[m] + part
                for v in views:
                    v[...] = 0
    stage.finish()
    mirror = stage.mirror_group
    for m in range(len(batches) if experts is not None else 0):
        experts.take(m, mirrored=mirror is not None)
    if experts is not None and mirror is not None:
        experts.over_mirror(mirror)
    if mirror is not None:                    # "dual": each sample's share on its copy
        per_sample = _over_mirror(per_sample, mirror)
        if last:                              # stages 0 and P-1: each direction's losses
            losses = _losses_over_mirror(losses, len(batches), mirror)
            last = mirror.rank == 1           # one of the two reports them
    losses = _with_aux_terms(losses, stage, batches, pp_group)
    if stage.embed_group is not None:         # the tied wte: embedding share + head share
        at = 0
        for name, p in named:
            if name == "wte.weight":
                break
            at += p.data.size
        n = stage.model.wte.weight.data.size
        both = C.all_gather(np.stack([per_sample[m][at:at + n] for m in sorted(per_sample)]),
                            group=stage.embed_group)                      # (2, M, n)
        for j, m in enumerate(sorted(per_sample)):
            per_sample[m][at:at + n] = both[0, j] + both[1, j]
    grads = TreeSum()
    for m in sorted(per_sample):
        grads.push(first + m, per_sample[m])
    size = sum(p.data.size for p in params)
    root = combine(gather_nodes(grads.nodes(), (size,), params[0].data.dtype, _over(group),
                                len(batches)),
                   leaves)
    total = 0.0
    if last:
        tree = TreeSum()
        for m in sorted(losses):
            tree.push(first + m, losses[m])
        total = float(combine(gather_nodes(tree.nodes(), (1,), np.float64, _over(group),
                                           len(batches)), leaves)[0])
    pieces, at = [], 0
    for p in params:
        pieces.append(root[at:at + p.data.size].reshape(p.data.shape).copy())
        at += p.data.size
    owner = [owners.rank == 0] * len(named)
    if experts is not None:                           # my experts: their own tree, over edp
        roots = experts.roots(leaves)
        for i, (name, _) in enumerate(named):
            if name in roots:
                pieces[i], owner[i] = roots[name], experts.edp.rank == 0
    norm = _global_norm([(name, g, p) for (name, p), g in zip(named, pieces)], order,
                        [None if experts is None else experts.ep, pp_group], tp_group)
    if clip_grad is not None:
        clip_to(pieces, norm, clip_grad * S)          # S: fp16's loss scale, else 1
    for v, g, own in zip(local_views(engine, params), pieces, owner):
        v[...] = g if own else 0
    engine.step(lr, None)
    return (total if owners.rank == 0 and last else 0.0), norm / S
