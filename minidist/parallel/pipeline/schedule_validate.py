"""Schedule validation: prove a pipeline schedule complete and deadlock-free before it runs.

A pipeline schedule (parallel/pipeline/schedules.py) is plain data: for each stage, the order of
its actions F, B, W. A wrong one does not fail politely at runtime. A missing backward
leaves a gradient short; two stages that each wait for the other hang until a timeout
fires, minutes later, far from the line that caused it. Every such mistake can be found
by reading the data, so `validate` reads it first and names the first one it finds.

The runtime's model, which the checks prove against:
    - every (sending stage, receiving stage, message kind) is one FIFO channel;
    - a send never blocks (it is buffered); a receive takes the next message of its
      channel, and that message must be the one the receiver expects: a different
      micro-batch at the head of the channel is an error, not a reason to look further.

Algorithm (each check assumes the ones before it passed):
    a. shape         P lines of actions; kinds in F, B, W, FB; 0 <= m < M; 0 <= c < V;
                     under the dual placement each micro-batch on its direction's chunk
    b. completeness  each stage runs F(m, c) and B(m, c) exactly once for every m, c
                     (an FB counts as its F and its B), and W(m, c) at most once: where
                     it runs, B(m, c) is split (the input gradient only)
    c. local order   B(m, c) after F(m, c), W(m, c) after B(m, c), on the same stage
    d. channel order on every channel the sender's messages, in its action order, are
                     exactly the messages the receiver expects, in its action order
    e. deadlock      run all stages with a program counter each: an action may run once
                     its local need has run and each of its incoming messages has been
                     sent. If every stage is stuck before all are done, that is a
                     deadlock; the error names the first stuck action and what it waits for.
Cost: O(P V M) actions, each visited a constant number of times (e: O(P) per sweep).

Shapes: none; schedules are data. Action #i of stage s is `schedule.actions[s][i]`.

References:
    Narayanan et al. 2021, arXiv:2104.04473, Sec. 2.2 (1F1B and interleaved schedules);
    Qi et al. 2023, arXiv:2401.10241, Sec. 2 (zero bubble: B split into B and W).
Read next: parallel/pipeline/schedules.py (the generators), then the pipeline runtime.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from minidist.parallel.pipeline.schedules import FB, KINDS, Action, Message, PipelineSchedule

_WHAT = {"act": "activation", "grad": "gradient"}


class ScheduleError(ValueError):
    """A pipeline schedule that cannot run: incomplete, out of order, or deadlocked."""


def _msg(m: Message) -> str:
    """'the activation of micro-batch 3 (virtual stage 5) from stage 0'."""
    return f"the {_WHAT[m.kind]} of micro-batch {m.micro_batch} (virtual stage {m.vstage}) " \
        f"from stage {m.src}"


def validate(schedule: PipelineSchedule) -> None:
    """Return None if `schedule` runs to completion in the runtime's model, else raise
    ScheduleError naming the first problem, where it is and how to fix it."""
    _check_shape(schedule)
    _check_complete(schedule)
    _check_local_order(schedule)
    _check_channels(schedule)
    _check_deadlock(schedule)


def _check_shape(s: PipelineSchedule) -> None:
    """a. P stage lines; every action of a known kind and within M micro-batches, V chunks."""
    if len(s.actions) != s.stages:
        raise ScheduleError(f"{s.name}: {len(s.actions)} lines of actions for P = {s.stages} "
                            f"stages; give exactly one line per stage.")
    for stage, actions in enumerate(s.actions):
        for i, action in enumerate(actions):
            where = f"{s.name}: stage {stage}, action #{i} {action}"
            if action.kind not in KINDS + (FB,):
                raise ScheduleError(f"{where}: unknown kind {action.kind!r}; use one of "
                                    f"{KINDS + (FB,)}.")
            for a in action.parts():
                if not 0 <= a.micro_batch < s.micro_batches:
                    raise ScheduleError(f"{where}: micro-batch {a.micro_batch} is outside "
                                        f"0..{s.micro_batches - 1}; raise M or fix the index.")
                if not 0 <= a.chunk < s.chunks:
                    raise ScheduleError(f"{where}: chunk {a.chunk} is outside "
                                        f"0..{s.chunks - 1}; raise V (chunks) or fix the index.")
                if s.placement == "dual" and a.chunk != s.direction(a.micro_batch):
                    raise ScheduleError(
                        f"{where}: micro-batch {a.micro_batch} flows "
                        f"{'up from stage 0' if s.direction(a.micro_batch) == 0 else 'down from stage P-1'}"
                        f" in the dual placement, through chunk {s.direction(a.micro_batch)} "
                        f"of every stage, not chunk {a.chunk}.")


def _check_complete(s: PipelineSchedule) -> None:
    """b. Each stage runs every F(m, c) and B(m, c) it owes exactly once (an FB counts as
    its F and its B), and at most one W(m, c): the W of a split B."""
    for stage, actions in enumerate(s.actions):
        owed = [Action(k, m, c) for k in ("F", "B") for m in range(s.micro_batches)
                for c in _chunks_of(s, m)]
        count = Counter(part for a in actions for part in a.parts())
        missing = [str(a) for a in owed if count[a] == 0]
        twice = [str(a) for a in owed + [a for a in count if a.kind == "W"] if count[a] > 1]
        if missing:
            raise ScheduleError(f"{s.name}: stage {stage} never runs {', '.join(missing)}; "
                                f"add each exactly once to stage {stage}'s actions.")
        if twice:
            raise ScheduleError(f"{s.name}: stage {stage} runs {', '.join(twice)} more than "
                                "once; keep one of each (a second F or B would add its "
                                "gradient twice).")


def _chunks_of(s: PipelineSchedule, m: int) -> range:
    """The chunks micro-batch m passes through on every stage: all V, or its direction's
    one ("dual")."""
    return range(s.direction(m), s.direction(m) + 1) if s.placement == "dual" \
        else range(s.chunks)


def _check_local_order(s: PipelineSchedule) -> None:
    """c. B after its F, W after its B: each needs what the earlier one saved."""
    for stage, actions in enumerate(s.actions):
        position = {part: i for i, a in enumerate(actions) for part in a.parts()}
        for i, a in enumerate(actions):
            need = s.local_needs(a)
            if need is not None and position[need] >= i:
                raise ScheduleError(
                    f"{s.name}: stage {stage} runs {a} (#{i}) "
                    f"{'with' if position[need] == i else 'before'} {need} "
                    f"(#{position[need]}), but {a.kind} needs what {need.kind} saved; "
                    f"move {a} after {need}.")


def _check_channels(s: PipelineSchedule) -> None:
    """d. Every FIFO channel carries its messages in the order the receiver takes them."""
    sent, expected = defaultdict(list), defaultdict(list)   # channel -> [(message, action)]
    for stage, actions in enumerate(s.actions):
        for a in actions:
            for m in s.messages_out(stage, a):
                sent[m.src, m.dst, m.kind].append((m, a))
            for m in s.messages_in(stage, a):
                expected[m.src, m.dst, m.kind].append((m, a))
    for channel in sorted(expected):
        for (got, sender), (want, receiver) in zip(sent[channel], expected[channel]):
            if got != want:
                src, dst, kind = channel
                raise ScheduleError(
                    f"{s.name}: stage {dst}'s {receiver} expects {_msg(want)}, but stage "
                    f"{src} sends micro-batch {got.micro_batch} (virtual stage {got.vstage}, "
                    f"by {sender}) there first; order stage {src}'s and stage {dst}'s "
                    f"{_WHAT[kind]}s the same way.")


def _check_deadlock(s: PipelineSchedule) -> None:
    """e. Run the stages as the runtime would; every stage must reach its end."""
    pc = [0] * s.stages                                    # next action of each stage
    done: set[tuple[int, Action]] = set()
    sent: set[Message] = set()

    def waits_for(stage: int) -> list[str]:
        a = s.actions[stage][pc[stage]]
        need = s.local_needs(a)
        out = [f"its own {need}"] if need is not None and (stage, need) not in done else []
        return out + [_msg(m) for m in s.messages_in(stage, a) if m not in sent]

    progress = True
    while progress:
        progress = False
        for stage in range(s.stages):                      # each stage runs while it can
            while pc[stage] < len(s.actions[stage]) and not waits_for(stage):
                a = s.actions[stage][pc[stage]]
                done.update((stage, part) for part in a.parts())
                sent.update(s.messages_out(stage, a))
                pc[stage] += 1
                progress = True
    stuck = [st for st in range(s.stages) if pc[st] < len(s.actions[st])]
    if stuck:
        at = [f"#{pc[st]} {s.actions[st][pc[st]]} (waits for {' and '.join(waits_for(st))})"
              for st in stuck]
        others = "".join(f", stage {st} at {where}" for st, where in zip(stuck[1:], at[1:]))
        raise ScheduleError(
            f"{s.name}: deadlock: stage {stuck[0]} is stuck at action {at[0]}{others}. Each "
            "waits for a message that a stuck stage sends only later; move that send earlier "
            "or the waiting action later.")
