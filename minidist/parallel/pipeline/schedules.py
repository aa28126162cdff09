"""Pipeline schedules as data: which stage runs the forward and backward of which
micro-batch, and in what order.

A pipeline schedule says, for each of the P stages (pp ranks), the order in which that
stage runs its actions: a plain list per stage. Each rank holds V model chunks, and the
model's layers flow through VIRTUAL stages 0, 1, ..., V P - 1. Which chunk of which stage
is virtual stage k is the schedule's placement:
    "loop"  chunk c of stage s is k = c P + s: stage 0, 1, ..., P-1, then stage 0 again
            (V = 1: plain pipelines; V >= 2: interleaved 1F1B)
    "v"     V = 2, chunk 0 of stage s is k = s and chunk 1 is k = 2P-1-s: down the stages
            and back up, so stage 0 holds the first AND the last piece of the model and
            the turn at stage P-1 is a hand-over inside one rank (ZBV, V-Half, V-Min,
            DualPipeV; Qi et al. 2024, arXiv:2405.15362, Sec. 3)
    "dual"  V = 2 of only P pieces: chunk 0 of stage s is piece s, chunk 1 is piece P-1-s,
            so stage s and its mirror P-1-s hold the same pieces; the first M/2
            micro-batches flow up through chunk 0, the rest down through chunk 1
            (DualPipe; `direction(m)`, and `place` takes the micro-batch)
The actions of a stage:
    F(m, c)   forward of micro-batch m through chunk c
    B(m, c)   its backward: the whole backward, or, where the stage also runs W(m, c),
              only the gradient of the chunk's input (what the previous stage waits for;
              zero bubble: `is_split`)
    W(m, c)   the gradient of the chunk's weights, of a split B
    FB        F(m, c) overlapped with B(m', c') of another micro-batch (DualPipe's F&B):
              what each part needs and sends, as one action (`parts`)
The messages an action implies are not written in the schedule; `messages_in` and
`messages_out` derive them, so a schedule cannot name a send that does not exist.

Generators (the handcrafted ones): gpipe, one_f_one_b, interleaved_1f1b, zero_bubble_h1,
zero_bubble_h2; schedule_auto.py finds ZB-1p, ZB-2p and ZBV under a memory limit,
controllable_memory.py builds V-Half and V-Min from their building blocks, dualpipe.py
DualPipe and DualPipeV, and family.py names them all (make_schedule).
schedule_csv.py reads and writes them as text, schedule_validate.py proves one complete
and deadlock-free, schedule_sim.py gives its timeline, bubble and peak activations, and
stage.py runs it on the ranks. The micro-batches themselves, and the trivial schedule
without a pipeline (gradient accumulation), are parallel/micro_batching.py's.
Read next: schedule_validate.py, schedule_sim.py, stage.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction


KINDS = ("F", "B", "W")
PLACEMENTS = ("loop", "v", "dual")


def vstage_of(placement: str, P: int, stage: int, chunk: int) -> int:
    """The virtual stage that chunk `chunk` of stage `stage` is, under `placement`."""
    if placement == "v" and chunk == 1:
        return 2 * P - 1 - stage
    if placement == "dual":
        return stage if chunk == 0 else P - 1 - stage
    return chunk * P + stage


def place_of(placement: str, P: int, vstage: int, direction: int = 0) -> tuple[int, int]:
    """(stage, chunk) that holds virtual stage `vstage` under `placement` (for "dual", on
    the way of `direction`: 0 from stage 0 up, 1 from stage P-1 down)."""
    if placement == "v" and vstage >= P:
        return 2 * P - 1 - vstage, 1
    if placement == "dual":
        return (vstage, 0) if direction == 0 else (P - 1 - vstage, 1)
    return vstage % P, vstage // P


def pieces_of(placement: str, P: int, chunks: int) -> int:
    """How many pieces the model is cut into: V P, or P for "dual" (each stage holds two
    of them, its own and its mirror's)."""
    return P if placement == "dual" else P * chunks


@dataclass(frozen=True, order=True)
class Action:
    """One cell of a schedule: kind F, B or W of micro-batch `micro_batch`, chunk `chunk`;
    or kind "FB", the forward F(micro_batch, chunk) overlapped with the backward
    B(back_micro_batch, back_chunk) of another micro-batch (DualPipe's F&B)."""

    kind: str
    micro_batch: int
    chunk: int = 0
    back_micro_batch: int = -1
    back_chunk: int = -1

    def __str__(self) -> str:
        if self.kind == FB:
            f, b = self.parts()
            return f"{f}&{b}"
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")

    def parts(self) -> tuple["Action", ...]:
        """(F, B) of an overlapped FB; (self,) for every other kind."""
        if self.kind == FB:
            return (Action("F", self.micro_batch, self.chunk),
                    Action("B", self.back_micro_batch, self.back_chunk))
        return (self,)


FB = "FB"


def overlapped(f: Action, b: Action) -> Action:
    """The FB action that runs forward f and backward b as one overlapped chunk."""
    if f.kind != "F" or b.kind != "B":
        raise ValueError(f"overlapped: needs a forward and a backward, got {f} and {b}.")
    return Action(FB, f.micro_batch, f.chunk, b.micro_batch, b.chunk)


@dataclass(frozen=True)
class Message:
    """One point-to-point message a schedule implies: `kind` "act" (a forward activation)
    or "grad" (the gradient of one), of micro-batch `micro_batch`, from stage src to dst,
    for virtual stage `vstage` of the receiver."""

    src: int
    dst: int
    kind: str
    micro_batch: int
    vstage: int


@dataclass(frozen=True)
class PipelineSchedule:
    """actions[s]: stage s's actions in the order it runs them. P stages, M micro-batches,
    V chunks per stage; placement: "loop", "v" or "dual" (module docstring), which chunk
    is which virtual stage. A backward B(m, c) is the whole backward, or, where the stage
    also runs W(m, c), the input gradient only (a split backward: zero bubble)."""

    name: str
    stages: int
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]
    chunks: int = 1
    placement: str = "loop"

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"PipelineSchedule {self.name!r}: placement {self.placement!r} "
                             f"is unknown; use one of {PLACEMENTS}.")
        if self.placement in ("v", "dual") and self.chunks != 2:
            raise ValueError(f"PipelineSchedule {self.name!r}: the {self.placement} placement "
                             f"has exactly 2 chunks per stage, not {self.chunks}.")
        if self.placement == "dual" and (self.stages % 2 or self.micro_batches % 2):
            raise ValueError(f"PipelineSchedule {self.name!r}: the dual placement feeds half "
                             "the micro-batches from each end and pairs stage s with P-1-s: "
                             f"P and M must be even, not P={self.stages}, "
                             f"M={self.micro_batches}.")

    @property
    def n_virtual(self) -> int:
        """The number of model pieces the layers are cut into: V P (P for "dual")."""
        return pieces_of(self.placement, self.stages, self.chunks)

    @property
    def chunk_share(self) -> Fraction:
        """The share of one stage's layers (1/P of the model) a chunk holds: 1/V, or 1
        under "dual" (each chunk is a whole piece). Costs and memory scale by it."""
        return Fraction(1) if self.placement == "dual" else Fraction(1, self.chunks)

    @functools.cached_property
    def _splits(self) -> tuple[frozenset, ...]:
        return tuple(frozenset((a.micro_batch, a.chunk) for a in row if a.kind == "W")
                     for row in self.actions)

    @property
    def split_backward(self) -> bool:
        """Does any backward run split (some stage runs a W)?"""
        return any(self._splits)

    def is_split(self, stage: int, micro_batch: int, chunk: int) -> bool:
        """Is B(micro_batch, chunk) on `stage` the input gradient only (its W comes later)?"""
        return (micro_batch, chunk) in self._splits[stage]

    def direction(self, micro_batch: int) -> int:
        """"dual": 0 for the first M/2 micro-batches (fed to stage 0, flowing up), 1 for the
        rest (fed to stage P-1, flowing down); 0 for every other placement."""
        if self.placement != "dual":
            return 0
        return int(micro_batch >= self.micro_batches // 2)

    def vstage(self, stage: int, chunk: int) -> int:
        """Virtual stage of chunk `chunk` of stage `stage`: c P + s ("loop"); s for chunk
        0 and 2P-1-s for chunk 1 ("v"); s for chunk 0 and P-1-s for chunk 1 ("dual")."""
        return vstage_of(self.placement, self.stages, stage, chunk)

    def place(self, vstage: int, micro_batch: int = 0) -> tuple[int, int]:
        """(stage, chunk) holding virtual stage k (for micro-batch `micro_batch`): (k mod
        P, k div P) ("loop"); (k, 0) for k < P and (2P-1-k, 1) after the turn ("v");
        (k, 0) on the way up and (P-1-k, 1) on the way down ("dual")."""
        return place_of(self.placement, self.stages, vstage, self.direction(micro_batch))

    def messages_in(self, stage: int, a: Action) -> list[Message]:
        """What action `a` of `stage` must receive before it runs: F the activation from
        virtual stage k-1 (k > 0), B the gradient from k+1 (k < V P - 1); W nothing; FB
        what its F and its B receive."""
        if a.kind == FB:
            return [m for part in a.parts() for m in self.messages_in(stage, part)]
        k, m = self.vstage(stage, a.chunk), a.micro_batch
        if a.kind == "F" and k > 0:
            return [Message(self.place(k - 1, m)[0], stage, "act", m, k)]
        if a.kind == "B" and k < self.n_virtual - 1:
            return [Message(self.place(k + 1, m)[0], stage, "grad", m, k)]
        return []

    def messages_out(self, stage: int, a: Action) -> list[Message]:
        """What action `a` of `stage` sends when done: F its output to k+1, B the input
        gradient to k-1; the last virtual stage's F ends in the loss and sends nothing; FB
        what its F and its B send."""
        if a.kind == FB:
            return [m for part in a.parts() for m in self.messages_out(stage, part)]
        k, m = self.vstage(stage, a.chunk), a.micro_batch
        if a.kind == "F" and k < self.n_virtual - 1:
            return [Message(stage, self.place(k + 1, m)[0], "act", m, k + 1)]
        if a.kind == "B" and k > 0:
            return [Message(stage, self.place(k - 1, m)[0], "grad", m, k - 1)]
        return []

    def local_needs(self, a: Action) -> Action | None:
        """The action of the same stage that must run before `a`: B needs F (its saved
        activations; on the last virtual stage also its loss), W needs B; F nothing; FB
        what its B needs (its F is of another micro-batch)."""
        if a.kind == FB:
            return self.local_needs(a.parts()[1])
        if a.kind == "B":
            return Action("F", a.micro_batch, a.chunk)
        if a.kind == "W":
            return Action("B", a.micro_batch, a.chunk)
        return None


# --- the schedule generators -------------------------------------------------------------
#
# Each returns a PipelineSchedule; `schedule_validate.validate` proves any of them (or one
# read from a CSV file) complete and free of deadlock before a single process starts.
# Backwards (and Ws) run in ascending micro-batch order on every stage, so each gradient
# accumulates in the order the single process adds it.

def check_sizes(name: str, P: int, M: int, V: int = 1) -> None:
    """ValueError unless P, M and V are integers >= 1 (every generator checks its sizes)."""
    for what, value in (("P (stages)", P), ("M (micro-batches)", M), ("V (chunks)", V)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {what} = {value!r}, but it must be an integer >= 1; "
                             "use 1 for a single stage (P), micro-batch (M) or chunk (V).")


def gpipe(P: int, M: int) -> PipelineSchedule:
    """GPipe: every stage runs F0 .. F(M-1), then B0 .. B(M-1).

    All M micro-batches' activations are held at once; bubble (P-1)/(M+P-1) with F, B of
    equal cost. Reference: Huang et al. 2019, arXiv:1811.06965, Sec. 2.
    """
    check_sizes("gpipe", P, M)
    one = tuple(Action("F", m) for m in range(M)) + tuple(Action("B", m) for m in range(M))
    return PipelineSchedule("gpipe", P, M, (one,) * P)


def _one_f_one_b(forwards: list[Action], backwards: list[Action], warmup: int
                 ) -> tuple[Action, ...]:
    """warmup forwards; then (next F, oldest B) pairs; then the remaining Bs (cooldown)."""
    steady = [a for pair in zip(forwards[warmup:], backwards) for a in pair]
    return tuple(forwards[:warmup] + steady + backwards[len(forwards) - warmup:])


def one_f_one_b(P: int, M: int) -> PipelineSchedule:
    """1F1B (PipeDream-Flush): stage s warms up with min(P-1-s, M) forwards, then F, B, ...

    Same bubble as GPipe, (P-1)/(M+P-1), but stage s holds at most min(P-s, M) micro-batches
    of activations instead of M. Reference: Narayanan et al. 2021, arXiv:2006.09503
    (PipeDream-Flush); arXiv:2104.04473, Sec. 2.2.1.
    """
    check_sizes("1f1b", P, M)
    fwd, bwd = [Action("F", m) for m in range(M)], [Action("B", m) for m in range(M)]
    return PipelineSchedule("1f1b", P, M, tuple(
        _one_f_one_b(fwd, bwd, min(P - 1 - s, M)) for s in range(P)))


def interleaved_1f1b(P: int, M: int, V: int = 2) -> PipelineSchedule:
    """Interleaved 1F1B: V chunks per stage, so a micro-batch crosses every stage V times.

    Megatron's order: micro-batches go in groups of P; on each stage the forwards run, group
    by group, chunk 0 on the group's micro-batches, then chunk 1, ..., chunk V-1; the
    backwards in the same order with the chunks reversed (V-1 .. 0). Stage s runs
        warmup = min(M V, 2 (P-1-s) + (V-1) G)
    forwards, then alternates F and B, then finishes the backwards. Each virtual stage is
    1/V of a stage, so the bubble shrinks V times: (P-1)/(V M + P-1) with F, B of equal cost.

    M not a multiple of P. With Megatron's rule (G = P, a last group of the M mod P left
    over) some cases deadlock, e.g. P = 4, M = 5, V = 3: in a group smaller than P, stage
    0's F(m, c+1) comes fewer than P forwards after F(m, c), before its input can have gone
    round all P stages; stage P-1 meanwhile waits, in its 1F1B pairing, for a gradient that
    stage 0 sends only after that forward. The rule here: the LAST group also takes the
    M mod P left over (size P .. 2P-1), and G = the size of the largest group (P when M < P
    or M mod P = 0, which is Megatron's schedule exactly). It costs (V-1)(M mod P) more
    held forwards, keeps the bubble at (P-1)/(V M + P-1) for every M >= P, and is valid
    for every M >= 1 (tests/parallel/pipeline/test_pipeline_schedules.py: all P <= 4, M <= 12,
    V <= 3, and Megatron's rule deadlocking). Reference: Narayanan et al. 2021,
    arXiv:2104.04473, Sec. 2.2.2.
    """
    check_sizes("interleaved", P, M, V)
    if V < 2:
        raise ValueError(f"interleaved: V = {V} chunk per stage is plain 1F1B; use "
                         "one_f_one_b(P, M), or V >= 2 for the interleaved schedule.")
    bounds = (list(range(0, M - P + 1, P)) if M >= P else [0]) + [M]    # group edges
    G = max(P, bounds[-1] - bounds[-2])
    table = [(m, c) for lo, hi in zip(bounds, bounds[1:]) for c in range(V)
             for m in range(lo, hi)]
    fwd = [Action("F", m, c) for m, c in table]
    bwd = [Action("B", m, V - 1 - c) for m, c in table]
    return PipelineSchedule("interleaved", P, M, tuple(
        _one_f_one_b(fwd, bwd, min(M * V, 2 * (P - 1 - s) + (V - 1) * G)) for s in range(P)),
        chunks=V)


def zero_bubble_h1(P: int, M: int) -> PipelineSchedule:
    """ZB-H1: split each backward into B (input gradient) and W (weight gradient), and let
    the Ws fill the bubbles, at 1F1B's activation memory.

    Only B is on the critical path: the previous stage waits for its gradient, nobody waits
    for W. Built as a list schedule in unit time (F = B = W = 1, messages free): at every
    step each stage runs the first of these that can run now,
        F  its input has arrived, fewer than P-s forwards lack their B (1F1B's warm-up),
           and fewer than P micro-batches are held (F done, W not): 1F1B's peak memory
        B  its F is done and its gradient has arrived (the last stage needs none)
        W  the oldest whose B is done
    and the order of its picks is the schedule. F goes first because the next stage waits
    for it; with B first, for example P = 2, M = 3 ends one step later. For M >= P the
    makespan is 3M + P-1, bubble (P-1)/(3M+P-1), a third of 1F1B's (P-1)/(M+P-1) when
    B+W = 2. Reference: Qi et al. 2023, arXiv:2401.10241, Sec. 2.1 (ZB-H1).
    """
    check_sizes("zb-h1", P, M)
    return _zero_bubble("zb-h1", P, M, [P - s for s in range(P)], P)


def zero_bubble_h2(P: int, M: int) -> PipelineSchedule:
    """ZB-H2: ZB-H1's rules with the warm-up doubled, 2(P-1-s) + 1 forwards on stage s
    (every forward that can arrive before the stage's first gradient) and up to 2P-1
    micro-batches held: no stage waits for its first B, and the Ws left at the end fill
    its tail, so every stage is busy from its first action to its last.

    The stages start one step apart and end one step apart (a parallelogram, not 1F1B's
    trapezoid): the makespan of one step is still 3M + P-1, but the idle time inside
    each stage's own span is 0 for M >= 2P-1, so when iterations overlap (Qi et al.'s
    optimizer post-validation) the bubble is gone: Timeline.steady_bubble = 0. Peak
    memory 2P-1 micro-batches. Reference: Qi et al. 2023, arXiv:2401.10241, Sec. 2.2.
    """
    check_sizes("zb-h2", P, M)
    return _zero_bubble("zb-h2", P, M, [2 * (P - 1 - s) + 1 for s in range(P)], 2 * P - 1)


def _zero_bubble(name: str, P: int, M: int, warmup: list[int], held: int
                 ) -> PipelineSchedule:
    """The handcrafted zero-bubble list schedule: stage s may run a forward while fewer
    than warmup[s] forwards lack their B and fewer than `held` micro-batches are held."""
    done_at: dict[tuple[int, str, int], int] = {}     # (stage, kind, m) -> step it ends
    nxt = [dict.fromkeys(KINDS, 0) for _ in range(P)]   # stage s's next m of each kind
    order: list[list[Action]] = [[] for _ in range(P)]
    t = 0
    while any(n["W"] < M for n in nxt):
        for s in range(P):
            kind = _zb_pick(s, P, M, t, nxt[s], done_at, warmup[s], held)
            if kind is not None:
                done_at[s, kind, nxt[s][kind]] = t + 1
                order[s].append(Action(kind, nxt[s][kind]))
                nxt[s][kind] += 1
        t += 1
        if t > 3 * M * P + P:                            # never seen; a bug, not bad input
            raise RuntimeError(f"{name}: no progress after {t} steps (P={P}, M={M})")
    return PipelineSchedule(name, P, M, tuple(map(tuple, order)))


def _zb_pick(s: int, P: int, M: int, t: int, n: dict[str, int],
             done_at: dict[tuple[int, str, int], int], warmup: int, held: int) -> str | None:
    """What stage s runs at step t (F, B, W or None); n: its next micro-batch per kind."""
    def ended(key):
        return done_at.get(key, t + 1) <= t
    f, b, w = n["F"], n["B"], n["W"]
    if f < M and (s == 0 or ended((s - 1, "F", f))) and f - b < warmup and f - w < held:
        return "F"
    if b < f and ended((s, "F", b)) and (s == P - 1 or ended((s + 1, "B", b))):
        return "B"
    if w < b and ended((s, "B", w)):
        return "W"
    return None
