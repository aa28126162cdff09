"""Pipeline schedules as data: every generator is proved complete and deadlock-free by the
validator, has the structure its paper describes, reaches its closed-form bubble under unit
costs (clocked by a small step simulation written here, and by schedule_sim), and survives
a CSV round trip; the validator names what is wrong in schedules broken on purpose.

`-m slow` adds P = 4 (validity, closed forms) and the cross-check against schedule_sim, which
test_schedule_sim.py's closed-form tests cover by default."""

from dataclasses import replace
from fractions import Fraction

import pytest

from minidist.parallel.pipeline.schedule_validate import ScheduleError, validate
from minidist.parallel.pipeline.family import SCHEDULES, chunks_of, make_schedule, runs_on
from minidist.parallel.pipeline.schedules import (
    Action, PipelineSchedule, gpipe, interleaved_1f1b, one_f_one_b,
                                                  zero_bubble_h1)
from minidist.parallel.pipeline.schedule_csv import from_csv, to_csv


def _ms(P):
    """Micro-batch counts: 1, M < P, M = P, M = 2P+1 (not a multiple of P), and a range."""
    return sorted(set(range(1, 13)) | {P, 2 * P + 1})


def _clock(schedule, cost):
    """Makespan when each stage runs its actions in order, each as early as its inputs allow
    (comm free); cost[kind] is the time of one action. Independent of schedule_sim."""
    end, free, pc = {}, [0] * schedule.stages, [0] * schedule.stages
    ended_by = {}                                    # message -> time it arrives
    moved = True
    while moved:
        moved = False
        for s, row in enumerate(schedule.actions):
            while pc[s] < len(row):
                a = row[pc[s]]
                need, ins = schedule.local_needs(a), schedule.messages_in(s, a)
                if (need is not None and (s, need) not in end) or \
                        any(m not in ended_by for m in ins):
                    break
                ready = [end[s, need]] if need is not None else []
                free[s] = max([free[s], *ready, *(ended_by[m] for m in ins)]) + cost[a.kind]
                end[s, a] = free[s]
                ended_by.update((m, free[s]) for m in schedule.messages_out(s, a))
                pc[s] += 1
                moved = True
    assert all(pc[s] == len(row) for s, row in enumerate(schedule.actions)), "deadlock"
    return max(free)


def _replace_stage(schedule, stage, actions):
    rows = list(schedule.actions)
    rows[stage] = tuple(actions)
    return replace(schedule, actions=tuple(rows))


# --- every generator is valid -------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("P", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_every_generator_is_valid(name, P):
    for M in [M for M in sorted(set(_ms(P)) | {2 * P, 2 * P + 2}) if runs_on(name, P, M)]:
        for V in (2, 3):
            s = make_schedule(name, P, M, V)
            validate(s)
            assert (s.stages, s.micro_batches) == (P, M)
            assert s.chunks == chunks_of(name, V)


@pytest.mark.parametrize("bad", [dict(P=0, M=2), dict(P=2, M=0), dict(P=2, M=-1)])
def test_bad_sizes_are_refused(bad):
    for name in SCHEDULES:
        with pytest.raises(ValueError, match="integer >= 1"):
            make_schedule(name, **bad)


def test_unknown_name_and_single_chunk_interleaved():
    with pytest.raises(ValueError, match="choose one of.*gpipe.*1f1b.*interleaved.*zb-h1"):
        make_schedule("pipedream", 2, 2)
    with pytest.raises(ValueError, match="one_f_one_b"):
        interleaved_1f1b(2, 4, V=1)


# --- structure ----------------------------------------------------------------------------

def test_gpipe_holds_all_forwards_before_the_first_backward():
    s = gpipe(3, 5)
    for row in s.actions:
        assert [a.kind for a in row] == ["F"] * 5 + ["B"] * 5
        assert [a.micro_batch for a in row[5:]] == list(range(5))      # ascending


@pytest.mark.parametrize("P, M", [(4, 8), (4, 2), (3, 3), (1, 3)])
def test_1f1b_warmup_and_alternation(P, M):
    s = one_f_one_b(P, M)
    for st, row in enumerate(s.actions):
        kinds = "".join(a.kind for a in row)
        warm = min(P - 1 - st, M)
        first_b = kinds.index("B")
        assert first_b == min(warm + 1, M), f"stage {st}: {kinds}"
        assert kinds[warm:warm + 2 * (M - warm)] == "FB" * (M - warm)     # steady pairs
        assert [a.micro_batch for a in row if a.kind == "B"] == list(range(M))


def test_interleaved_forward_order_is_megatrons():
    s = interleaved_1f1b(2, 4, V=2)
    fwd = [str(a) for a in s.actions[0] if a.kind == "F"]
    assert fwd == ["F0", "F1", "F0.1", "F1.1", "F2", "F3", "F2.1", "F3.1"]
    bwd = [str(a) for a in s.actions[0] if a.kind == "B"]
    assert bwd == ["B0.1", "B1.1", "B0", "B1", "B2.1", "B3.1", "B2", "B3"]
    # Megatron's warmup for M a multiple of P: 2 (P-1-s) + (V-1) P forwards, then F, B, ...
    for st, row in enumerate(s.actions):
        warm = 2 * (2 - 1 - st) + 2
        assert "".join(a.kind for a in row[:warm + 2]) == "F" * warm + "FB"


def test_interleaved_last_group_takes_the_leftover():
    fwd = [str(a) for a in interleaved_1f1b(2, 5, V=2).actions[1] if a.kind == "F"]
    assert fwd == ["F0", "F1", "F0.1", "F1.1", "F2", "F3", "F4", "F2.1", "F3.1", "F4.1"]


def _megatron_literal(P, M, V):
    """Megatron's rule applied literally: groups of P with a SMALLER last group, and
    warmup 2 (P-1-s) + (V-1) P."""
    table = [(m, c) for g in range(0, M, P) for c in range(V) for m in range(g, min(g + P, M))]
    fwd = [Action("F", m, c) for m, c in table]
    bwd = [Action("B", m, V - 1 - c) for m, c in table]
    rows = []
    for s in range(P):
        w = min(M * V, 2 * (P - 1 - s) + (V - 1) * P)
        rows.append(tuple(fwd[:w] + [a for p in zip(fwd[w:], bwd) for a in p]
                          + bwd[M * V - w:]))
    return PipelineSchedule("megatron", P, M, tuple(rows), chunks=V)


def test_megatrons_literal_rule_deadlocks_where_ours_does_not():
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 is stuck at action #14 F4\.2"):
        validate(_megatron_literal(4, 5, 3))
    validate(interleaved_1f1b(4, 5, 3))
    validate(_megatron_literal(4, 8, 3))           # M a multiple of P: the same schedule
    assert _megatron_literal(4, 8, 3).actions == interleaved_1f1b(4, 8, 3).actions


def test_zb_h1_splits_the_backward_at_1f1b_memory():
    P, M = 4, 8
    s = zero_bubble_h1(P, M)
    assert s.split_backward
    for st, row in enumerate(s.actions):
        assert [a.micro_batch for a in row if a.kind == "W"] == list(range(M))
        held = peak = 0
        for a in row:                                # held: F done, W not yet
            held += (a.kind == "F") - (a.kind == "W")
            peak = max(peak, held)
        assert peak <= P, f"stage {st} holds {peak} micro-batches, 1F1B's stage 0 holds {P}"
    # the last stage runs F, B as 1F1B does and defers its Ws into the drain
    assert " ".join(map(str, s.actions[P - 1][:9])) == "F0 B0 F1 B1 F2 B2 F3 B3 W0"


# --- closed forms under unit costs --------------------------------------------------------

@pytest.mark.parametrize("P", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_bubbles_match_the_closed_forms(P):
    for M in _ms(P):
        assert _clock(gpipe(P, M), dict(F=1, B=1)) == 2 * (M + P - 1)
        # 1F1B with B = the whole backward (B + W = 2): bubble (P-1)/(M+P-1)
        assert _clock(one_f_one_b(P, M), dict(F=1, B=2)) == 3 * (M + P - 1)
        if M >= P:
            # ZB-H1, F = B = W = 1: makespan 3M + P-1, bubble (P-1)/(3M+P-1)
            assert _clock(zero_bubble_h1(P, M), dict(F=1, B=1, W=1)) == 3 * M + P - 1
            for V in (2, 3):                   # chunk actions cost 1/V of a stage's
                t = _clock(interleaved_1f1b(P, M, V), dict(F=Fraction(1, V), B=Fraction(2, V)))
                assert t == 3 * M + Fraction(3 * (P - 1), V), (P, M, V)


@pytest.mark.slow
def test_bubbles_match_schedule_sim():
    sim = pytest.importorskip("minidist.parallel.pipeline.schedule_sim")
    one = dict(F=Fraction(1), B=Fraction(1), W=Fraction(1))
    for P in (1, 2, 3, 4):
        for M in range(P, 3 * P + 2):
            for name, V in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2),
                            ("interleaved", 3)):
                got = sim.simulate(make_schedule(name, P, M, max(V, 2)), one).bubble_fraction()
                want = sim.bubble_closed_form(name, P, M, V)
                assert got == pytest.approx(want, abs=1e-12), (name, P, M, V)


# --- the validator names what is wrong ----------------------------------------------------

def test_missing_and_duplicate_actions():
    s = one_f_one_b(2, 3)
    row = list(s.actions[0])
    with pytest.raises(ScheduleError, match="stage 0 never runs B1; add"):
        validate(_replace_stage(s, 0, [a for a in row if a != Action("B", 1)]))
    with pytest.raises(ScheduleError, match="stage 0 runs F0 more than once"):
        validate(_replace_stage(s, 0, row + [Action("F", 0)]))


def test_backward_before_its_forward():
    s = gpipe(1, 2)
    with pytest.raises(ScheduleError, match=r"stage 0 runs B0 \(#0\) before F0 \(#1\).*move B0"):
        validate(_replace_stage(s, 0, [Action("B", 0), Action("F", 0), Action("F", 1),
                                       Action("B", 1)]))


def test_shape_errors():
    s = gpipe(2, 2)
    with pytest.raises(ScheduleError, match="1 lines of actions for P = 2"):
        validate(replace(s, actions=s.actions[:1]))
    with pytest.raises(ScheduleError, match="micro-batch 2 is outside 0..1"):
        validate(_replace_stage(s, 1, s.actions[1] + (Action("F", 2),)))
    with pytest.raises(ScheduleError, match="chunk 1 is outside 0..0"):
        validate(_replace_stage(s, 1, s.actions[1] + (Action("F", 0, 1),)))
    # a W splits its B (the B becomes the input gradient only): legal, once, after the B
    split = _replace_stage(s, 1, s.actions[1] + (Action("W", 0),))
    validate(split)
    assert split.is_split(1, 0, 0) and not split.is_split(1, 1, 0) and not split.is_split(0, 0, 0)
    with pytest.raises(ScheduleError, match="runs W0 more than once"):
        validate(_replace_stage(s, 1, s.actions[1] + (Action("W", 0),) * 2))
    with pytest.raises(ScheduleError, match="runs W0 .#0. before B0"):
        validate(_replace_stage(s, 1, (Action("W", 0),) + s.actions[1]))
    with pytest.raises(ScheduleError, match="unknown kind 'X'"):
        validate(_replace_stage(s, 1, s.actions[1] + (Action("X", 0),)))


def test_channel_order_swap_names_the_first_mismatch():
    s = gpipe(2, 5)
    row = list(s.actions[0])
    row[3], row[4] = row[4], row[3]                 # stage 0 sends F4 before F3
    with pytest.raises(ScheduleError) as err:
        validate(_replace_stage(s, 0, row))
    assert "stage 1's F3 expects the activation of micro-batch 3 (virtual stage 1) from " \
           "stage 0, but stage 0 sends micro-batch 4" in str(err.value)


def test_real_deadlock_names_the_first_stuck_action():
    # stage 0 waits for B0's gradient before sending F1; stage 1 needs F1 before its B0
    s = PipelineSchedule("cyclic", 2, 2, (
        (Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)),
        (Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1))))
    with pytest.raises(ScheduleError) as err:
        validate(s)
    assert str(err.value).startswith(
        "cyclic: deadlock: stage 0 is stuck at action #1 B0 (waits for the gradient of "
        "micro-batch 0 (virtual stage 0) from stage 1), stage 1 at #1 F1 (waits for the "
        "activation of micro-batch 1 (virtual stage 1) from stage 0).")


# --- CSV ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEDULES)
def test_csv_round_trip(name):
    for P in (1, 2, 3):
        for M in [M for M in (1, P, 2 * P, 2 * P + 1) if runs_on(name, P, M)]:
            s = make_schedule(name, P, M, V=3)
            assert from_csv(to_csv(s), name=name) == s


def test_csv_reads_comments_blanks_and_spaces():
    text = "# interleaved by hand\n 0F0 , 0F1,,2F0,2F1,2B0,2B1,0B0,0B1,\n\n" \
           "1F0,1F1,3F0,3B0,3F1,3B1,1B0,1B1\n"
    s = from_csv(text, name="hand")
    assert (s.stages, s.micro_batches, s.chunks, s.split_backward) == (2, 2, 2, False)
    assert s.actions[0][:3] == (Action("F", 0), Action("F", 1), Action("F", 0, 1))
    validate(s)
    assert from_csv("0F0,0B0,0W0\n").split_backward


@pytest.mark.parametrize("text, match", [
    ("0F0,0B0\n0F0,1B0\n", r"Not the loop: line 2, column 1 \('0F0'\) is vstage 0 on "
     r"stage 1"),
    ("0F0, 0X0\n", r"line 1, column 2 \('0X0'\): a cell is"),
    ("# c\n0F0,F1\n", r"line 2, column 2 \('F1'\)"),
    ("# only a comment\n", "no stage lines"),
])
def test_csv_errors_name_line_column_and_cell(text, match):
    with pytest.raises(ValueError, match=match):
        from_csv(text)
