"""The schedule family against its claims (family.py's table), with exact fractions.

Bubble: Timeline.steady_bubble at unit costs, in units of 1F1B's (P-1)/M, for M >= 2P;
memory: the peak activations a stage holds, in units of one stage's micro-batch (a chunk
of the V placement holds half); p2p: messages over links per step, in units of 1F1B's.
Sources: Qi et al. 2023, arXiv:2401.10241 (ZB-H1 Sec. 2.1, ZB-H2 Sec. 2.2, ZB-1p and
ZB-2p Sec. 3); the zero-bubble repository's table (1F1B 1, ZB1P 1/3, ZB2P 0, ZBV 0; memory
1, 1, 2, 1; communication 1, 1, 1, 2); Qi et al. 2024, arXiv:2405.15362 (ZBV).
"""

from fractions import Fraction

import pytest

from minidist.parallel.pipeline.family import (CLAIMS, SCHEDULES, chunks_of, make_schedule,
                                               runs_on)
from minidist.parallel.pipeline.schedule_auto import auto_schedule
from minidist.parallel.pipeline.schedule_csv import from_csv, to_csv
from minidist.parallel.pipeline.schedule_sim import peak_activations, simulate
from minidist.parallel.pipeline.schedule_validate import validate
from minidist.parallel.pipeline.schedules import (Action, PipelineSchedule, one_f_one_b,
                                                  place_of, vstage_of, zero_bubble_h1,
                                                  zero_bubble_h2)

ONE = {k: Fraction(1) for k in "FBW"}
SIZES = [(P, M) for P in (2, 3, 4) for M in (2 * P, 3 * P)]


def _steady(schedule, costs=ONE, comm=0):
    return Fraction(simulate(schedule, costs, comm).steady_bubble()).limit_denominator(10**6)


def _memory(schedule) -> Fraction:
    """Peak activations over stages, in whole-stage units."""
    return max(peak_activations(schedule)) * schedule.chunk_share


def _p2p(schedule) -> int:
    """Messages that cross a link in one step (the V placement's turn stays on its rank)."""
    return sum(m.dst != s for s, row in enumerate(schedule.actions) for a in row
               for m in schedule.messages_out(s, a))


@pytest.mark.parametrize("P, M", SIZES)
def test_bubble_memory_and_p2p_claims(P, M):
    unit_bubble = _steady(one_f_one_b(P, M))
    assert unit_bubble == Fraction(P - 1, M)                  # 1F1B: (P-1)/M exactly
    for name in ("zb-h1", "zb-1p", "zb-h2", "zb-2p"):
        s = make_schedule(name, P, M)
        bubble, memory, p2p = CLAIMS[name]
        assert _steady(s) == bubble * unit_bubble, name
        assert _memory(s) <= memory * P, name
        assert _p2p(s) == p2p * _p2p(one_f_one_b(P, M)), name
    assert _memory(make_schedule("zb-h2", P, M)) == 2 * P - 1          # (2P-1) M_B


@pytest.mark.parametrize("P, M", SIZES)
def test_zbv_memory_p2p_and_its_measured_bubble(P, M):
    """ZBV holds 1F1B's memory and sends twice its messages, as claimed. Its bubble: the
    paper reports 0 for its search; this greedy leaves a tail of at most 1/4 of 1F1B's
    here (measured 0.06 to 0.23 of it for P <= 8, M = 2P..4P), and still ends a
    synchronous step sooner than ZB-1p, which is what the runtime here (no post-
    validation) pays."""
    s = make_schedule("zbv", P, M)
    assert _memory(s) == P
    assert _p2p(s) == 2 * _p2p(one_f_one_b(P, M))
    assert _steady(s) <= Fraction(1, 4) * Fraction(P - 1, M)
    assert simulate(s).makespan < simulate(make_schedule("zb-1p", P, M)).makespan


def test_every_name_validates_and_simulates_for_small_sizes():
    for name in SCHEDULES:
        for P in (1, 2, 3, 4):
            for M in [M for M in range(1, 2 * P + 3) if runs_on(name, P, M)]:
                s = make_schedule(name, P, M, V=2)
                validate(s)
                simulate(s)
                assert s.chunks == chunks_of(name)


@pytest.mark.parametrize("costs, comm", [
    ({"F": 1, "B": 2, "W": 1}, 0),
    ({"F": 2, "B": 3, "W": 1}, Fraction(1, 2)),
    ({"F": Fraction(3, 2), "B": 1, "W": 2}, Fraction(1, 4)),
])
def test_the_search_is_never_worse_than_the_handcrafted_ones(costs, comm):
    """ZB-1p at 1F1B's memory vs ZB-H1, ZB-2p at twice it vs ZB-H2, under uneven costs
    and slow messages: the search starts from them, so it can only gain."""
    for P, M in [(2, 4), (4, 8)]:
        one = auto_schedule(P, M, P, costs=costs, comm=comm)
        two = auto_schedule(P, M, 2 * P, costs=costs, comm=comm)
        for s, limit in ((one, P), (two, 2 * P)):
            validate(s)
            assert _memory(s) <= limit
        assert simulate(one, costs, comm).makespan <= \
            simulate(zero_bubble_h1(P, M), costs, comm).makespan
        assert simulate(two, costs, comm).makespan <= \
            simulate(zero_bubble_h2(P, M), costs, comm).makespan
    # and with B twice as slow as F, twice the memory buys a shorter step
    assert simulate(auto_schedule(4, 8, 8, costs=costs, comm=comm), costs, comm).makespan < \
        simulate(auto_schedule(4, 8, 4, costs=costs, comm=comm), costs, comm).makespan


def test_auto_schedule_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="cannot hold one micro-batch"):
        auto_schedule(4, 8, Fraction(1, 3), placement="v")
    with pytest.raises(ValueError, match="placement"):
        auto_schedule(4, 8, 4, placement="w")
    with pytest.raises(ValueError, match="M \\(micro-batches\\)"):
        auto_schedule(4, 0, 4)


def test_the_v_placement():
    P = 3
    assert [vstage_of("v", P, s, c) for c in (0, 1) for s in range(P)] == [0, 1, 2, 5, 4, 3]
    for k in range(2 * P):
        assert vstage_of("v", P, *place_of("v", P, k)) == k
        assert vstage_of("loop", P, *place_of("loop", P, k)) == k
    s = make_schedule("zbv", P, 4)
    assert s.placement == "v" and s.place(2 * P - 1) == (0, 1)      # the loss on stage 0
    turn = [m for a in s.actions[P - 1] for m in s.messages_out(P - 1, a) if m.dst == P - 1]
    assert len(turn) == 2 * 4                                    # 4 activations, 4 gradients
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        PipelineSchedule("bad", 2, 1, ((Action("F", 0),),) * 2, chunks=3, placement="v")
    with pytest.raises(ValueError, match="placement"):
        PipelineSchedule("bad", 2, 1, ((Action("F", 0),),) * 2, placement="zigzag")


def test_csv_reads_the_v_placement_back():
    s = make_schedule("zbv", 2, 3)
    text = to_csv(s)
    assert text.splitlines()[0].startswith("0F0,")
    assert "3B0" in text.splitlines()[0]                         # vstage 3 is on stage 0
    assert from_csv(text, name="zbv") == s
    with pytest.raises(ValueError, match=r"no placement fits every cell .* Not the loop: line "
                       r"1, column 2 \('3F0'\) is vstage 3 on stage 0; not the V: line 2, "
                       r"column 2 \('0F1'\) is vstage 0 on stage 1"):
        from_csv("0F0,3F0\n1F0,0F1\n")


def test_the_turn_is_handed_over_in_order_and_checked():
    import numpy as np

    from minidist.parallel.pipeline.stage import Links, PipelineError
    links = Links({}, {}, stage=1)
    links.send("act", 1, np.full(3, 7.0), micro_batch=0)
    links.send("act", 1, np.full(3, 8.0), micro_batch=1)
    out = np.zeros(3)
    assert links.recv("act", 1, out, micro_batch=0)[0] == 7.0
    with pytest.raises(PipelineError, match="micro-batch 2, but the hand-over holds micro-batch 1"):
        links.recv("act", 1, out, micro_batch=2)
    with pytest.raises(PipelineError, match="holds nothing"):
        links.recv("grad", 1, out, micro_batch=0)


# Costs measured on this project's 2-core machine by `python -m minidist bench pipeline
# --pp 2 --schedule all` (GPT 8 layers, C=256, T=64, float32): a stage's share of F, B
# (input gradient) and W in seconds, and a message's median latency.
MEASURED = {"F": Fraction("1.31e-3"), "B": Fraction("1.09e-3"), "W": Fraction("0.82e-3")}
COMM = Fraction("30e-6")                                  # exact: no ties lost to rounding


@pytest.mark.parametrize("P, M", [(4, 8), (4, 16), pytest.param(8, 16, marks=pytest.mark.slow),
                                  pytest.param(8, 32, marks=pytest.mark.slow)])
def test_the_zero_bubble_paper_s_ranking_with_costs_measured_here(P, M):
    """Qi et al.'s bubble-rate table (arXiv:2401.10241, Sec. 5) ranks 1F1B > 1F1B-I >
    ZB-1p > ZB-2p in every setting, the searched schedules no worse than the handcrafted.
    Its profiled F, B, W and message times were not in the sources reachable here, so the
    simulator plays costs measured here; the ranking holds, one step and overlapping."""
    def rate(name, steady=False):
        s = make_schedule(name, P, M, costs=MEASURED) if name in ("zb-1p", "zb-2p") else \
            make_schedule(name, P, M)
        t = simulate(s, MEASURED, COMM)
        return t.steady_bubble() if steady else t.bubble_fraction()
    for steady in (False, True):
        r = {n: rate(n, steady) for n in ("1f1b", "interleaved", "zb-h1", "zb-1p", "zb-h2",
                                          "zb-2p")}
        assert r["1f1b"] > r["interleaved"] > r["zb-1p"] > r["zb-2p"], r
        assert r["zb-1p"] <= r["zb-h1"] and r["zb-2p"] <= r["zb-h2"], r


def test_a_plan_searches_for_the_costs_it_is_given():
    from minidist.parallel.compose import Plan
    costs = (1.31, 1.09, 0.82)
    plan = Plan(pp=4, micro_batches=8, schedule="zb-2p", schedule_costs=costs)
    assert plan.pipeline_schedule() == auto_schedule(4, 8, 8, costs=dict(zip("FBW", costs)),
                                                     name="zb-2p")
    assert Plan(pp=4, micro_batches=8, schedule="zb-1p").pipeline_schedule().actions == \
        zero_bubble_h1(4, 8).actions                   # at unit costs: ZB-H1, on the tie
    for bad in [dict(schedule="1f1b", schedule_costs=(1, 1, 1)),
                dict(schedule="zbv", schedule_costs=(1, 0, 1)),
                dict(schedule="zbv", schedule_costs=(1, 1))]:
        with pytest.raises(ValueError, match="schedule_costs=.* must be three positive"):
            Plan(pp=2, micro_batches=4, **bad)


@pytest.mark.parametrize("P", [2, 3, 4, 6, 8, 12, 16])
def test_v_half_and_v_min_hold_their_memory_for_their_bubble(P):
    """Qi et al. 2024 (arXiv:2405.15362): V-Half, half of 1F1B's memory for half its bubble;
    V-Min, a third for two thirds. Their building blocks hold P + 2 and about 2P/3 + 2
    chunk activations (half a stage each): the claims are the limits for many stages (at
    P = 32: 0.53 and 0.38 of 1F1B's memory); the one-step idle time stays under the
    claimed share of 1F1B's at every P here. Both send 1F1B's messages twice. (V-Half:
    P + 1 for an odd P, whose block needs no shift to keep its slots apart.)"""
    M = 2 * P
    one = simulate(one_f_one_b(P, M), ONE)
    idle_1f1b = one.makespan - one.busy(0)
    for name, bubble, held in (("v-half", Fraction(1, 2), P + 2),
                               ("v-min", Fraction(2, 3), -(-2 * P // 3) + 2)):
        s = make_schedule(name, P, M)
        validate(s)
        t = simulate(s, ONE)
        assert max(t.makespan - t.busy(i) for i in range(P)) <= bubble * idle_1f1b, name
        assert max(peak_activations(s)) <= held, (name, peak_activations(s))
        assert _p2p(s) == 2 * _p2p(one_f_one_b(P, M)), name
    assert max(peak_activations(make_schedule("v-half", P, M))) == P + 2 - P % 2


def test_the_building_blocks_never_collide():
    """Each stage's four passes and its two Ws sit in distinct slots modulo 6, so the
    repeated blocks leave no bubble in the steady state (and the schedule is valid)."""
    from minidist.parallel.pipeline.controllable_memory import INTERVAL, block
    for name in ("v-half", "v-min"):
        for P in range(1, 13):
            for slots in block(name, P):
                assert len({t % INTERVAL for t in slots}) == 4, (name, P, slots)
    with pytest.raises(ValueError, match="unknown building block"):
        block("v-max", 4)
