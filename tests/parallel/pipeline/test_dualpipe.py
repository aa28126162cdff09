"""DualPipe and DualPipeV against DeepSeek-V3's Table 2 (arXiv:2412.19437), with exact
fractions; the FB action through the validator, the simulator and the runtime; and
training equal to the single process.

Table 2 (F, B the costs of a piece's forward and whole backward, W its weight part, F&B
an overlapped forward and backward; PP pieces):
    1F1B       bubble (PP-1)(F+B)          activations PP     parameters 1x
    ZB1P       (PP-1)(F+B-2W)              PP                 1x
    DualPipe   (PP/2-1)(F&B+B-3W)          PP+1               2x
    DualPipeV  (PP/2-1)(F&B+B-3W)          PP+1               2x per device of PP/2
Here the bubble is each stage's idle time in one step (makespan - busy): 1F1B equals its
formula for any costs, ZB1P (ZB-H1) for any with W <= F and W <= b, the input part of B
(with a longer W its Ws no longer fit in the bubbles: F, b, w = 1, 2, 3 idles 2 where the
formula says 0, P = 2; checked over F <= 5, b <= 4, w <= 3: exact in all 38 cases with
W <= F, b, in none of the 22 others); DualPipe and DualPipeV equal theirs when F = B/2 = W (B
whole) and the overlap saves nothing, F&B = F + B. Where it saves time (F&B < F + B), the
simulated bubble grows: stages that finish an FB early wait for their neighbours (P = 4,
F = b = w = 1: F&B = 3 gives the table's 2; F&B = 3/2 gives 3/2 where the table says 1/2),
while the step itself gets shorter, which is what test_a_real_overlap_shortens_the_step
checks. Table 2 does not say which costs its formula assumes.
"""

from dataclasses import replace
from fractions import Fraction
import itertools

import pytest

from minidist.parallel.pipeline.dualpipe import dualpipe, dualpipe_v
from minidist.parallel.pipeline.family import make_schedule, pieces
from minidist.parallel.pipeline.schedule_csv import from_csv, to_csv
from minidist.parallel.pipeline.schedule_sim import peak_activations, simulate
from minidist.parallel.pipeline.schedule_validate import ScheduleError, validate
from minidist.parallel.pipeline.schedules import (FB, Action, one_f_one_b, overlapped,
                                                  zero_bubble_h1)
from minidist.parallel.pipeline.stage import PipelineCut, split_layers

COSTS = [(1, 1, 1), (3, 2, 1), (5, 4, 2), (2, 3, 1), (3, 3, 2), (4, 1, 1)]   # F, b, w
SIZES = [(2, 4), (4, 8), (4, 10), (6, 12), (8, 16)]


def _idle(schedule, costs) -> set:
    t = simulate(schedule, costs)
    return {t.makespan - t.busy(s) for s in range(schedule.stages)}


@pytest.mark.parametrize("F, b, w", COSTS)
def test_table_2_one_f_one_b_and_zb1p_for_any_costs(F, b, w):
    c = {"F": Fraction(F), "B": Fraction(b), "W": Fraction(w)}
    B = b + w                                                   # the table's whole backward
    for P, M in SIZES:
        assert _idle(one_f_one_b(P, M), c) == {(P - 1) * (F + B)}
        assert _idle(zero_bubble_h1(P, M), c) == {(P - 1) * (F + B - 2 * w)}


@pytest.mark.parametrize("unit", [1, 2, Fraction(3, 2)])
def test_table_2_dualpipe_and_dualpipev(unit):
    """F = b = w = unit, F&B = F + B: every stage idles the table's bubble, exactly.
    DualPipeV on P stages cuts 2P pieces (the table's PP = 2P): its costs per piece are
    half a stage's."""
    F = b = w = Fraction(unit)
    B, FB_ = b + w, F + b + w
    c = {"F": F, "B": b, "W": w, FB: FB_}
    for P, M in SIZES:
        assert _idle(dualpipe(P, M), c) == {(Fraction(P, 2) - 1) * (FB_ + B - 3 * w)}
        PP, half = 2 * P, Fraction(1, 2)
        assert _idle(dualpipe_v(P, M), c) == {
            (Fraction(PP, 2) - 1) * (FB_ * half + B * half - 3 * w * half)}


def test_table_2_memory_and_parameters():
    for P, M in SIZES:
        assert peak_activations(dualpipe(P, M)) == [P + 1] * P              # PP + 1 pieces
        assert peak_activations(dualpipe_v(P, M)) == [2 * P + 1] * P        # PP = 2P pieces
        assert pieces("dualpipe", P) == P and pieces("dualpipev", P) == 2 * P
        # DualPipe: each stage holds its piece and its mirror's, two copies of everything
        cut = split_layers(2 * P, P)
        held = [PipelineCut(s, P, tuple(cut), "dual") for s in range(P)]
        for s, c in enumerate(held):
            assert sorted(i for ch in range(2) for i in c.layers(ch)) == \
                sorted(list(cut[s]) + list(cut[P - 1 - s]))
        assert sum(len(c.layers(ch)) for c in held for ch in range(2)) == 2 * 2 * P
        assert held[0].first and held[0].last and held[P - 1].first and held[P - 1].last


def test_a_real_overlap_shortens_the_step():
    """The point of F&B: as the overlapped pair gets cheaper, the step gets shorter."""
    for P, M in [(4, 8), (8, 16)]:
        spans = [simulate(dualpipe(P, M), {"F": 1, "B": 1, "W": 1, FB: fb}).makespan
                 for fb in (3, Fraction(5, 2), 2, Fraction(3, 2))]
        assert spans == sorted(spans, reverse=True) and spans[0] > spans[-1]
        assert simulate(dualpipe(P, M)).makespan < simulate(one_f_one_b(P, M)).makespan


def test_the_order_of_one_stage_is_deepseeks_eight_steps():
    s = dualpipe(4, 8)
    assert [str(a) for a in s.actions[0]] == [
        "F0", "F1", "F2", "F4.1",             # 1: 2(H-h-1) F0, 2: (h+1) x F0 F1
        "B4.1", "W4.1", "F5.1",               # 3: (H-h-1) x B1 W F1, zero bubble
        "F3&B5.1", "F6.1&B0",                 # 4: (n-2H+h+1) x F0&B1 F1&B0
        "B6.1", "F7.1&B1",                    # 5: (H-h-1) x B1 F1&B0
        "B7.1", "B2",                         # 6: (h+1) x B1 B0, the second half split
        "W2", "B3",                           # 7: (H-h-1) x W B0
        "W3"]                                 # 8: (h+1) x W
    # the middle stages' first steady pair is not overlapped
    assert [str(a) for a in s.actions[1][4:7]] == ["F2", "B4.1", "F6.1&B0"]


def test_sizes_each_dualpipe_needs():
    for P, M in itertools.product(range(1, 7), range(1, 15)):
        for gen, ok in ((dualpipe, P % 2 == 0 and M % 2 == 0 and M >= 2 * P),
                        (dualpipe_v, M % 2 == 0 and M >= 2 * P)):
            if ok:
                validate(gen(P, M))
            else:
                with pytest.raises(ValueError, match="must be even|needs an even M >= 2P"):
                    gen(P, M)


def test_a_planted_swap_of_two_messages_is_refused_by_name():
    s = dualpipe(4, 8)
    row = list(s.actions[0])
    row[0], row[1] = row[1], row[0]                 # stage 0 sends F1's output before F0's
    with pytest.raises(ScheduleError, match=r"stage 1's F0 expects the activation of micro-"
                       r"batch 0 \(virtual stage 1\) from stage 0, but stage 0 sends "
                       r"micro-batch 1 \(virtual stage 1, by F1\) there first"):
        validate(replace(s, actions=(tuple(row),) + s.actions[1:]))
    row = list(s.actions[3])                         # the other direction, from stage 3
    row[0], row[1] = row[1], row[0]
    with pytest.raises(ScheduleError, match=r"stage 2's F4.1 expects .* but stage 3 sends "
                       r"micro-batch 5"):
        validate(replace(s, actions=s.actions[:3] + (tuple(row),)))


def test_fb_through_the_validator_and_the_csv():
    s = dualpipe(2, 4)
    with pytest.raises(ScheduleError, match="flows up from stage 0 in the dual placement, "
                       "through chunk 0 of every stage, not chunk 1"):
        validate(replace(s, actions=((Action("F", 0, 1),) + s.actions[0][1:],)
                         + s.actions[1:]))
    with pytest.raises(ValueError, match="needs a forward and a backward"):
        overlapped(Action("B", 0), Action("F", 1))
    text = to_csv(s)
    assert "&" in text and from_csv(text, name="dualpipe") == s
    assert from_csv(to_csv(dualpipe_v(3, 6)), name="dualpipev") == dualpipe_v(3, 6)
    fb = next(a for a in s.actions[0] if a.kind == FB)
    assert fb.parts() == (Action("F", fb.micro_batch, fb.chunk),
                          Action("B", fb.back_micro_batch, fb.back_chunk))
    with pytest.raises(ValueError, match=r"0F4&1B1"):
        from_csv("0F0&1F1\n")


def test_make_schedule_names_them():
    assert make_schedule("dualpipe", 4, 8) == dualpipe(4, 8)
    assert make_schedule("dualpipev", 2, 4) == dualpipe_v(2, 4)
