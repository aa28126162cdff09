"""Pipeline parallelism: cut the layer stack into P stages, one stage per rank, and run a schedule.

A rank of the pp group owns some consecutive layers (its stage) and talks only to the
stages next to it: activations arrive from the previous stage and leave for the next one
on the way forward, their gradients travel the other way on the way back. The global
batch of a dp rank is cut into M micro-batches, so that different stages can work on
different micro-batches at the same time.

This module is the mechanics: `split_layers` and `PipelineCut` decide who owns which
layers (the embedding on the first stage; final LayerNorm, head and loss on the last),
and `PipelineStage.run(action)` executes one forward (F), backward (B) or weight-gradient
(W) action and moves tensors to the neighbours. WHEN each action runs is a schedule,
plain data (family.py names them all: GPipe to DualPipe), proven complete
and deadlock-free by schedule_validate.py before anything runs, so schedule and mechanics
can be read and tested apart. With V chunks per rank the layers are cut into V P pieces
and chunk c of stage s is the virtual stage the schedule's placement says: c P + s
(interleaved 1F1B), s and 2P-1-s (the V of ZBV and DualPipeV: the turn at stage P-1 is a
hand-over in memory, Links), or, for DualPipe, s and P-1-s of only P pieces: stage s and
its mirror P-1-s hold the same two pieces, one direction's micro-batches each, and
`sync_mirror` sums the two copies' gradients before the update.

Tied embeddings. With tie_weights the head's weight is the token embedding: wte lives on
the first AND the last stage. Their gradients (embedding part on the first, head part on
the last) are summed between those two ranks after every step's schedule (Megatron's
embedding group, `sync_tied`), so both copies take the same update and stay bitwise
equal; the first stage owns wte for the norm and the gathered parameters.

One rank's view (stage s of P, one step, M micro-batches):
    1. for each action of schedules[s], in order (inside no_sync(), but for each chunk's
       last backward under an overlapping engine: see PipelineStage.step):
       F(m, c): x = recv activation of micro-batch m (or embed it on virtual stage 0);
                run chunk c's layers; send the output on (or compute micro-batch m's loss
                on the last virtual stage, after checking that the input is micro-batch m)
       B(m, c): dy = recv its gradient (or 1 for the loss); backward through the chunk;
                send dx back (split schedules: dx only, weight gradients deferred to W)
       W(m, c): the deferred weight gradients of (m, c) (autograd/split.py)
       (a MoE block's auxiliary losses are a term of the loss on its own stage: its B
       backpropagates sum(y * dy) + aux, whose gradient into y is exactly dy)
    2. wait for this stage's sends; sum the tied embedding's gradient over the embedding
       group; the engine's step() then finishes the reduction over dp (dp x cp), which
       each chunk's last backward started (DDP), and updates.
Every receive blocks until its message is there; every send is asynchronous, so a stage
never waits for a neighbour to take a message: copied into the link's mailbox at once when
it fits (the eager send, collectives/api.py), else by the link's worker thread.

Links. Each direction of each boundary is a 2-rank group of its own, one for activations
and one for gradients ("pp<line>.act0>1", "pp<line>.grad1>0"): its FIFO order is the
order both ends reach in the schedule (the validator proves they agree), and every
message is a numbered send/recv (collectives.send/recv) tagged with its micro-batch, so a
hung stage is a CollectiveTimeout naming the pending receive, and a message of the wrong
micro-batch is a CollectiveMismatch naming both.

Shapes: the tensor crossing a boundary is one micro-batch of hidden states
h (B/(dp M), T, C), T/cp under context parallelism and T/(cp tp) under sequence
parallelism (its tp placement: Shard(1) with SP, else Replicate).
Communication per step, per boundary and direction: M micro-batches of that shape (V M
for interleaved 1F1B, whose chunks also cross from the last stage back to the first);
plus one all-reduce of wte's gradient over the embedding group.

References: Huang et al. 2019, "GPipe", arXiv:1811.06965; Narayanan et al. 2021,
    "PipeDream-Flush" (1F1B), arXiv:2006.09503, and "Efficient Large-Scale Language Model
    Training on GPU Clusters Using Megatron-LM", arXiv:2104.04473, Sec. 2.2 (interleaved
    schedule, embedding group); Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
    arXiv:2401.10241.
Read next: schedules.py (the schedules as data), schedule_validate.py,
parallel/pipeline/schedule_sim.py.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np

from minidist import backend
from minidist import collectives as C
from minidist.autograd import Tensor
from minidist.autograd.saved import ctx_arrays, distinct_bytes, graph_nodes
from minidist.autograd.split import backward_input
from minidist.nn.module import ModuleSubset
from minidist.parallel import placement as pl
from minidist.parallel.pipeline.schedules import FB, Action, PipelineSchedule, vstage_of


class PipelineError(RuntimeError):
    """A pipeline stage met a tensor it must not use (e.g. of another micro-batch)."""


def split_layers(n_layer: int, pieces: int, layers_per_stage=None) -> list[range]:
    """The layers of each of `pieces` virtual stages: consecutive ranges covering 0..L-1.

    Default: as even as possible, the first pieces one layer longer (5 layers on 2: 3, 2),
    since the last stage also runs the head and the loss. layers_per_stage: explicit
    counts, one per piece, each >= 1, summing to n_layer.
    """
    if pieces > n_layer:
        raise ValueError(f"pipeline: {pieces} pieces (pp x virtual stages) need at least "
                         f"{pieces} layers, but the model has n_layer={n_layer}; use more "
                         "layers, fewer stages or fewer virtual stages.")
    if layers_per_stage is None:
        base, extra = divmod(n_layer, pieces)
        counts = [base + (i < extra) for i in range(pieces)]
    else:
        counts = [int(c) for c in layers_per_stage]
        if len(counts) != pieces or sum(counts) != n_layer or min(counts) < 1:
            raise ValueError(f"pipeline: layers_per_stage={tuple(layers_per_stage)} must give "
                             f"{pieces} counts (one per pp stage and virtual stage), each >= "
                             f"1, summing to n_layer={n_layer}.")
    starts = np.cumsum([0] + counts)
    return [range(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


@dataclass(frozen=True)
class PipelineCut:
    """Which layers stage `stage` of P holds: pieces[k] = the layers of virtual stage k;
    placement: which of its chunks is which virtual stage (schedules.PLACEMENTS)."""

    stage: int
    stages: int
    pieces: tuple[range, ...]
    placement: str = "loop"

    @property
    def chunks(self) -> int:
        return 2 if self.placement == "dual" else len(self.pieces) // self.stages

    def vstage(self, chunk: int) -> int:
        return vstage_of(self.placement, self.stages, self.stage, chunk)

    def layers(self, chunk: int) -> range:
        return self.pieces[self.vstage(chunk)]

    @property
    def first(self) -> bool:
        """Holds virtual stage 0 (the embedding)? Stage 0 (and, "dual", stage P-1)."""
        return any(self.vstage(c) == 0 for c in range(self.chunks))

    @property
    def last(self) -> bool:
        """Holds the last virtual stage (final LayerNorm, head, loss)? Stage P-1; stage 0
        under the V placement, where the model comes back up to where it started; both
        under "dual", whose two directions end at opposite ends."""
        return any(self.vstage(c) == len(self.pieces) - 1 for c in range(self.chunks))

    def holds(self, name: str, tied: bool) -> bool:
        """Does this stage keep the parameter called `name`?"""
        head = {"ln_f", "lm_head"} | ({"wte"} if tied else set())
        top = name.split(".")[0]
        if top == "blocks":
            return any(int(name.split(".")[1]) in self.layers(c) for c in range(self.chunks))
        return (self.first and top in ("wte", "wpe")) or (self.last and top in head)

    def cut(self, model) -> None:
        """Keep only this stage's parts of `model` (a GPT, tp-sharded already)."""
        kept = {i: model.blocks[i] for c in range(self.chunks) for i in self.layers(c)}
        model.blocks = ModuleSubset(kept)                   # names stay "blocks.i"
        tied = model.cfg.tie_weights
        for part in ("wte", "wpe", "ln_f", "lm_head"):
            if hasattr(model, part) and not self.holds(part + ".", tied):
                delattr(model, part)


class Links:
    """This rank's pipeline links: {(kind, peer stage): 2-rank group}, kind "act" / "grad"
    for what it sends ("out") and receives ("in"). Built by `make_links` on every rank.
    stage: this rank's stage; a message to itself (the turn of the V placement, from chunk
    0 to chunk 1 of stage P-1 and back) is handed over in memory, in the same FIFO order."""

    def __init__(self, out: dict, inc: dict, stage: int = -1) -> None:
        self.out, self.inc, self.stage = out, inc, stage
        self.works: list = []
        self.local: dict[str, list[tuple[int, np.ndarray]]] = {"act": [], "grad": []}

    def send(self, kind: str, dst: int, x: np.ndarray, micro_batch: int) -> None:
        """Asynchronous (eager when the mailbox has room, else on this link's worker
        thread); wait_all() before the step ends."""
        x = np.ascontiguousarray(backend.to_numpy(x))
        if dst == self.stage:
            self.local[kind].append((micro_batch, x.copy()))
            return
        self.works.append(C.send(x, 1, group=self.out[kind, dst], tag=micro_batch,
                                 async_op=True))

    def recv(self, kind: str, src: int, out: np.ndarray, micro_batch: int) -> np.ndarray:
        if src == self.stage:
            if not self.local[kind] or self.local[kind][0][0] != micro_batch:
                head = self.local[kind][0][0] if self.local[kind] else None
                raise PipelineError(f"pipeline: stage {src} expects its own {kind} of micro-"
                                    f"batch {micro_batch}, but the hand-over holds "
                                    f"{'nothing' if head is None else f'micro-batch {head}'}.")
            out[...] = self.local[kind].pop(0)[1]
            return out
        return C.recv(out, 0, group=self.inc[kind, src], tag=micro_batch)

    def wait_all(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []

    @property
    def stats(self) -> dict[str, int]:
        """Bytes sent and received over every link (and sent to other emulated nodes), and
        seconds in synchronous calls on them (what train.py counts as "pp")."""
        groups = list(self.out.values()) + list(self.inc.values())
        return {k: sum(g.stats.get(k, 0) for g in groups)
                for k in ("bytes_sent", "bytes_recv", "bytes_sent_inter", "seconds")}


def make_links(job, grid: np.ndarray, stages: int, chunks: int, placement: str = "loop"
               ) -> Links:
    """COLLECTIVE over the world: the 2-rank link groups of every pp line.

    grid (P, L): global rank of stage s on pp line l. Activations flow s -> s+1 (and, with
    chunks > 1, P-1 -> 0 into the next chunk; under the V placement back up, s+1 -> s, and
    under "dual" both ways, one direction's micro-batches each); gradients the other way.
    """
    edges = [(s, s + 1) for s in range(stages - 1)]
    if placement in ("v", "dual"):                # both ways between neighbours
        edges += [(s + 1, s) for s in range(stages - 1)]
    elif chunks > 1 and stages > 1:
        edges.append((stages - 1, 0))
    out, inc = {}, {}
    for line in range(grid.shape[1]):
        for a, b in edges:
            for kind, (src, dst) in (("act", (a, b)), ("grad", (b, a))):
                ranks = (int(grid[src, line]), int(grid[dst, line]))
                g = job.new_group(ranks, name=f"pp{line}.{kind}{src}>{dst}")
                if g is not None and job.rank == ranks[0]:
                    out[kind, dst] = g
                elif g is not None:
                    inc[kind, src] = g
    mine = np.nonzero(grid == job.rank)[0]
    return Links(out, inc, int(mine[0]) if mine.size else -1)


class PipelineStage:
    """This rank's stage: its model chunks and how to run one action of a schedule.

    model: the GPT cut to this stage (PipelineCut.cut); links: make_links'; sequence:
    True under sequence parallelism (the boundary tensor is Shard(1) over tp, whose size
    is sequence_shards); embed_group: the first and last stage, for the tied wte (None on
    other stages or without tying). `step` runs one training step's schedule.
    """

    def __init__(self, model, cut: PipelineCut, links: Links, schedule: PipelineSchedule,
                 sequence_shards: int = 1, sequence: bool = False, embed_group=None,
                 mirror_group=None) -> None:
        if schedule.stages != cut.stages or schedule.chunks != cut.chunks:
            raise ValueError(f"pipeline: the schedule is for P={schedule.stages} stages x "
                             f"V={schedule.chunks} chunks, the model is cut into "
                             f"{cut.stages} x {cut.chunks}.")
        self.model, self.cut, self.links, self.schedule = model, cut, links, schedule
        self.embed_group, self.mirror_group = embed_group, mirror_group
        self.shards, self.sequence = sequence_shards, sequence
        self.last_vstage = schedule.n_virtual - 1
        self.record: list[tuple[Action, float, float]] = []
        self.measure_memory = False             # True: also count the bytes they keep
        self.held_peak, self.held_bytes_peak = 0, 0

    def _held(self) -> None:
        """Peaks of the (micro-batch, chunk) activations held, after a forward: their
        number and (measure_memory) the bytes their graphs keep for the backward."""
        self.held_peak = max(self.held_peak, len(self.live))
        if self.measure_memory:
            roots = [st["y"] for st in self.live.values() if "w" not in st]
            roots += [st["h0"] for st in self.live.values() if st["h0"] is not None]
            arrays = [a for _, ctx in graph_nodes(roots) for a in ctx_arrays(ctx)]
            for st in self.live.values():               # B done, W not: what W keeps
                arrays += st["w"].kept_arrays() + [st["dx"]] if "w" in st else []
            held = distinct_bytes(arrays, exclude=self.model.parameters())
            self.held_bytes_peak = max(self.held_bytes_peak, held)

    # --- one step ---
    def step(self, engine, batches, n_tokens: int) -> float:
        """Run my actions of the schedule on the micro-batches, then sum the tied wte's
        gradient over the embedding group; return the sum of my micro-batch losses (0 off
        the last stage). Gradients accumulate locally (engine.no_sync()), except in each
        chunk's last backward (its last B, or W when split) when the engine overlaps
        (DDP): there its hooks start the dp reduction of what that backward finished,
        bucket by bucket, while the schedule goes on; the tied wte is held until its two
        shares are summed. The engine's step() then reduces the rest and updates.
        Under "dual" every parameter has a copy on the mirror stage P-1-s: the two copies'
        gradients are summed (sync_mirror) before any dp reduction, so nothing overlaps."""
        engine.begin_step()                             # mixed precision: autocast on
        self.begin(batches, n_tokens, engine.loss_seed())
        overlap = engine.overlaps_backward and self.mirror_group is None
        last = self.last_backwards() if overlap else set()
        # the tied wte takes two shares, the embedding's and the head's: on two stages
        # (summed by sync_tied), or on stage 0 in two chunks (the V placement)
        tied = overlap and (self.embed_group is not None or (
            self.model.cfg.tie_weights and self.cut.first and self.cut.last))
        if tied:
            engine.hold(self.model.wte.weight)
        for i, a in enumerate(self.schedule.actions[self.cut.stage]):
            with contextlib.nullcontext() if i in last else engine.no_sync():
                self.run(a)
        loss = self.finish()
        if self.embed_group is not None:
            sync_tied(engine, self.model, self.embed_group)
        if self.mirror_group is not None:
            sync_mirror(engine, self.model, self.mirror_group)
        if tied:
            engine.release(self.model.wte.weight)
        return loss

    def last_backwards(self) -> set[int]:
        """Indices in my actions of each chunk's last backward that adds to its weights'
        gradients: its last W, or its last B whose W is not run (a whole backward)."""
        s, last = self.cut.stage, {}
        for i, a in enumerate(self.schedule.actions[s]):
            for p in a.parts():
                if p.kind == "W" or (p.kind == "B" and not self.schedule.is_split(
                        s, p.micro_batch, p.chunk)):
                    last[p.chunk] = i
        return set(last.values())

    def begin(self, batches, n_tokens: int, seed: float = 1.0) -> None:
        """seed: d loss / d loss (S under fp16 loss scaling: engine.loss_seed())."""
        self.batches, self.n_tokens, self.seed = batches, n_tokens, seed
        self.live: dict[tuple[int, int], dict] = {}     # (m, c) -> what B and W need
        self.loss, self.record = 0.0, []
        self.aux_values: dict[tuple[int, int], object] = {}   # (m, layer) -> MoE aux term

    def run(self, a: Action) -> None:
        """Run one action; its (start, end) is recorded after its receive has arrived, so
        time spent waiting for a neighbour shows as idle (bubble). An overlapped FB runs
        its F, then its B (one thread: nothing to overlap them on), recorded as one slot
        from the F's start to the B's end."""
        if a.kind == FB:
            f, b = a.parts()
            self._forward(f)
            self._backward(b)
            (_, t0, _), (_, _, t1) = self.record[-2:]
            self.record[-2:] = [(a, t0, t1)]
            return
        {"F": self._forward, "B": self._backward, "W": self._weights}[a.kind](a)

    def finish(self) -> float:
        """Wait for this step's sends; return the sum of the losses computed here."""
        self.links.wait_all()
        if self.live:
            raise PipelineError(f"pipeline: the schedule left {sorted(self.live)} (micro-"
                                "batch, chunk) without their backward; it is incomplete.")
        return self.loss

    # --- the three actions ---
    def _forward(self, a: Action) -> None:
        k, mb, h0 = self.cut.vstage(a.chunk), self.batches[a.micro_batch], None
        if k == 0:
            t0 = time.perf_counter()
            h0 = self.model.embed(mb.x, mb.dropout_key)                   # (B, T, C)
            x = pl.carry(h0, Tensor(h0.data, requires_grad=True))       # B stops here
        else:                          # the message's tag is its micro-batch: recv checks it
            buf = np.empty(self._boundary_shape(mb), self.model.cfg.dtype)
            buf = self.links.recv("act", self.schedule.place(k - 1, a.micro_batch)[0], buf,
                                  a.micro_batch)
            t0 = time.perf_counter()
            x = Tensor(backend.xp.asarray(buf), requires_grad=True)
            pl.tag(x, "tp", pl.Shard(1) if self.sequence else pl.Replicate())
        y, aux_terms, aux, ce = x, [], None, None
        for i in self.cut.layers(a.chunk):
            y, term = self.model.blocks[i](y, mb.dropout_key)            # (B, T, C)
            if term is not None:                                     # a MoE block's
                aux_terms.append(term)
                self.aux_values[a.micro_batch, i] = term.data        # kept for the caller
        if k == self.last_vstage:      # outputs and labels of the same micro-batch, a.m
            y = ce = self.model.loss(self.model.head(y), mb.y, self.n_tokens)
            for term in aux_terms:     # GPT.loss's sum of its aux terms, in order
                y = y + term * mb.aux_weight
            self.loss += float(y.item())
        else:
            self.links.send("act", self.schedule.place(k + 1, a.micro_batch)[0], y.data,
                            a.micro_batch)
            if aux_terms:              # this chunk's MoE losses: a term of the loss here
                aux = sum(aux_terms[1:], aux_terms[0]) * mb.aux_weight
                self.loss += float(aux.item())
        self.live[a.micro_batch, a.chunk] = {"x": x, "y": y, "h0": h0, "aux": aux, "ce": ce}
        self._held()
        self.record.append((a, t0, time.perf_counter()))

    def _backward(self, a: Action) -> None:
        k, key = self.cut.vstage(a.chunk), (a.micro_batch, a.chunk)
        state = self.live[key]
        y = state["y"]
        if k == self.last_vstage:                                   # d loss / d loss
            dy = backend.xp.ones_like(y.data) if self.seed == 1.0 else \
                backend.xp.full_like(y.data, self.seed)
        else:
            buf = np.empty(y.shape, y.dtype)
            dy = backend.xp.asarray(self.links.recv(
                "grad", self.schedule.place(k + 1, a.micro_batch)[0], buf, a.micro_batch))
        t0 = time.perf_counter()
        if state["aux"] is not None:   # one root: sum(y * dy) has gradient dy exactly
            aux = state["aux"] if self.seed == 1.0 else state["aux"] * self.seed
            y, dy = (y * Tensor(dy)).sum() + aux, None
        split = self.schedule.is_split(self.cut.stage, a.micro_batch, a.chunk)
        if split:                                                   # B: input gradient only
            (dx,), state["w"] = backward_input(y, dy, [state["x"]])
        else:                                                       # B: the whole backward
            y.backward(dy)
            dx = state["x"].grad
            if state["h0"] is not None:
                state["h0"].backward(dx)                            # into wte, wpe
        if k > 0:
            self.links.send("grad", self.schedule.place(k - 1, a.micro_batch)[0], dx,
                            a.micro_batch)
        if split:                               # W keeps only what it needs of the graph
            state.update(dx=dx, x=None, y=None, aux=None)
        else:
            del self.live[key]
        self.record.append((a, t0, time.perf_counter()))

    def _weights(self, a: Action) -> None:
        t0 = time.perf_counter()
        state = self.live.pop((a.micro_batch, a.chunk))
        state["w"].run()                                            # weight gradients
        if state["h0"] is not None:
            state["h0"].backward(state["dx"])                       # into wte, wpe
        self.record.append((a, t0, time.perf_counter()))

    def _boundary_shape(self, mb) -> tuple[int, int, int]:
        rows, T = mb.x.shape
        return rows, T // (self.shards if self.sequence else 1), self.model.cfg.n_embd


def sync_mirror(engine, model, group) -> None:
    """COLLECTIVE over the mirror pair (stages s and P-1-s of one pp line, "dual"): sum the
    local gradient of every parameter over the two copies, in place, before the dp sync;
    one all-reduce of all of them, in rank order, so both copies get the same bits."""
    grads = [engine.local_grad(p) for p in model.parameters()]
    flat = C.all_reduce(np.concatenate([g.reshape(-1) for g in grads]), group=group,
                        algo="direct" if getattr(group, "supports_shared", False) else "auto")
    at = 0
    for g in grads:
        g[...] = flat[at:at + g.size].reshape(g.shape)
        at += g.size


def sync_tied(engine, model, group) -> None:
    """COLLECTIVE over the embedding group (first and last stage of one pp line): sum the
    local gradient of the tied wte over the two stages, in place, before the dp sync."""
    g = engine.local_grad(model.wte.weight)
    g[...] = C.all_reduce(np.ascontiguousarray(g), group=group,
                          algo="direct" if getattr(group, "supports_shared", False) else "auto")
