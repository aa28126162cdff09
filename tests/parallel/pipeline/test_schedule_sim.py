"""The pipeline simulator clocks a schedule by its order and inputs only: start times of small
hand-built schedules, the papers' bubble closed forms (exactly), peak activations, and the
renderers (ASCII, Chrome trace, PNG) of simulated and recorded timelines.

`-m slow` adds the sweeps that take ~0.1-1 s each: the simulator-vs-validator deadlock sweep
(test_megatrons_literal_rule_deadlocks_where_ours_does_not covers it by default), the
interleaved closed form for P = 4, 5, and the PNG plot (a matplotlib import)."""

from __future__ import annotations

import functools
from fractions import Fraction

import numpy as np
import pytest

from minidist.observe.trace import Trace
from minidist.parallel.pipeline import schedule_render as R
from minidist.parallel.pipeline import family
from minidist.parallel.pipeline import schedules as S
from minidist.parallel.pipeline.schedule_sim import (Slot, Timeline, bubble_closed_form,
                                                     peak_activations, simulate)
from minidist.parallel.pipeline.schedules import Action, PipelineSchedule

F, B, W = (functools.partial(Action, k) for k in "FBW")
UNIT = {k: Fraction(1) for k in "FBW"}                 # exact arithmetic for every V


def _starts(tl: Timeline) -> list[list[tuple[str, float, float]]]:
    return [[(str(sl.action), sl.start, sl.end) for sl in row] for row in tl.stages]


def _hand_gpipe(P: int, M: int) -> PipelineSchedule:
    row = tuple(F(m) for m in range(M)) + tuple(B(m) for m in range(M))
    return PipelineSchedule("gpipe-by-hand", P, M, (row,) * P)


# --- start times of hand-built schedules ----------------------------------------------------

def test_hand_built_gpipe_start_times():
    # F = 1, whole backward = B + W = 2; stage 1 starts B0 as soon as its forwards are done
    tl = simulate(_hand_gpipe(2, 2))
    assert _starts(tl) == [[("F0", 0, 1), ("F1", 1, 2), ("B0", 5, 7), ("B1", 7, 9)],
                           [("F0", 1, 2), ("F1", 2, 3), ("B0", 3, 5), ("B1", 5, 7)]]
    assert (tl.makespan, tl.busy(0), tl.idle(0), tl.idle(1)) == (9, 6, 3, 3)
    assert tl.bubble_fraction() == 6 / 18 == bubble_closed_form("gpipe", 2, 2)


def test_comm_delays_only_messages_between_stages():
    tl = simulate(_hand_gpipe(2, 2), {"F": 1, "B": 1, "W": 0}, comm=0.5)
    # each gradient lands comm after its B ends: stage 0's B0 starts at 4.5 + 0.5
    assert _starts(tl) == [[("F0", 0, 1), ("F1", 1, 2), ("B0", 5, 6), ("B1", 6, 7)],
                           [("F0", 1.5, 2.5), ("F1", 2.5, 3.5), ("B0", 3.5, 4.5),
                            ("B1", 4.5, 5.5)]]


def test_split_backward_w_waits_for_its_b_only():
    row = (F(0), B(0), W(0))
    tl = simulate(PipelineSchedule("zb-by-hand", 2, 1, (row, row)),
                  {"F": 1, "B": 2, "W": 3})
    assert _starts(tl) == [[("F0", 0, 1), ("B0", 4, 6), ("W0", 6, 9)],
                           [("F0", 1, 2), ("B0", 2, 4), ("W0", 4, 7)]]


def test_chunks_cost_one_vth_and_visit_every_stage_twice():
    # P=2, V=2: virtual stages 0 1 2 3 live on stages 0 1 0 1
    row = (F(0, 0), F(0, 1), B(0, 1), B(0, 0))
    tl = simulate(PipelineSchedule("v-by-hand", 2, 1, (row, row), chunks=2), UNIT)
    assert _starts(tl) == [[("F0", 0, Fraction(1, 2)), ("F0.1", 1, Fraction(3, 2)),
                            ("B0.1", 3, 4), ("B0", 5, 6)],
                           [("F0", Fraction(1, 2), 1), ("F0.1", Fraction(3, 2), 2),
                            ("B0.1", 2, 3), ("B0", 4, 5)]]


def test_deadlock_is_a_value_error_that_names_the_wait():
    bad = PipelineSchedule("bad", 2, 1, ((B(0), F(0)), (F(0), B(0))))
    with pytest.raises(ValueError, match=r"(?s)stage 0 waits at action #0 \(B0\).*validate"):
        simulate(bad)


@pytest.mark.parametrize("costs, match", [({"X": 1}, "unknown cost"), ({"F": [1, 2]}, "3 stages"),
                                          ({"B": -1}, "negative")])
def test_bad_costs_are_value_errors(costs, match):
    with pytest.raises(ValueError, match=match):
        simulate(_hand_gpipe(3, 1), costs)


def test_actions_outside_the_schedule_shape_are_value_errors():
    with pytest.raises(ValueError, match="kind must be F, B, W or FB"):
        simulate(PipelineSchedule("x", 1, 1, ((F(0), Action("X", 0)),)))
    with pytest.raises(ValueError, match="chunk in 0..0"):
        simulate(PipelineSchedule("x", 1, 1, ((F(0, 1), B(0, 1)),)))
    with pytest.raises(ValueError, match="twice"):
        simulate(PipelineSchedule("x", 1, 1, ((F(0), F(0), B(0)),)))


def _megatron_interleaved(P: int, M: int, V: int) -> PipelineSchedule:
    """Megatron's interleaved order taken literally for any M: groups of P micro-batches (the
    last one smaller), warmup min(M V, 2 (P-1-s) + (V-1) P). Deadlocks for some M < P."""
    table = [(m, c) for g in range(0, M, P) for c in range(V) for m in range(g, min(g + P, M))]
    fwd = [F(m, c) for m, c in table]
    bwd = [B(m, V - 1 - c) for m, c in table]
    rows = []
    for s in range(P):
        k = min(M * V, 2 * (P - 1 - s) + (V - 1) * P)
        steady = [a for pair in zip(fwd[k:], bwd) for a in pair]
        rows.append(tuple(fwd[:k] + steady + bwd[len(fwd) - k:]))
    return PipelineSchedule("megatron-interleaved", P, M, tuple(rows), chunks=V)


@pytest.mark.slow
def test_simulator_and_validator_agree_on_which_schedules_deadlock():
    from minidist.parallel.pipeline.schedule_validate import validate
    stuck = []
    for P, M, V in [(P, M, V) for V in (2, 3) for P in range(1, 7) for M in range(1, 10)]:
        for sched in (S.interleaved_1f1b(P, M, V), _megatron_interleaved(P, M, V)):
            try:
                validate(sched)
                valid = True
            except (ValueError, RuntimeError):
                valid = False
            try:
                simulate(sched)
                runs = True
            except ValueError:
                runs = False
                stuck.append((sched.name, P, M, V))
            assert runs == valid, (f"{sched.name} P={P} M={M} V={V}: simulate {runs}, "
                                   f"validate {valid}")
    assert ("megatron-interleaved", 4, 5, 3) in stuck
    assert not [x for x in stuck if x[0] == "interleaved"]


# --- an independent oracle: memoised recursion over the dependency graph --------------------

def _oracle_makespan(sched: PipelineSchedule, cost: dict) -> Fraction:
    """end(s, i) = max(end(s, i-1), ends of what action i needs) + its cost, written from the
    schedule rules directly (no messages_in / local_needs)."""
    P, V, rows = sched.stages, sched.chunks, sched.actions
    where = {(s, a): i for s, row in enumerate(rows) for i, a in enumerate(row)}

    def needs(s, a):
        k = a.chunk * P + s
        if a.kind == "F":
            return [((k - 1) % P, F(a.micro_batch, (k - 1) // P))] if k else []
        if a.kind == "W":
            return [(s, B(a.micro_batch, a.chunk))]
        out = [(s, F(a.micro_batch, a.chunk))]
        return out + ([((k + 1) % P, B(a.micro_batch, (k + 1) // P))] if k < V * P - 1 else [])

    @functools.cache
    def end(s, i):
        a = rows[s][i]
        whole = a.kind == "B" and not sched.is_split(s, a.micro_batch, a.chunk)
        c = cost[a.kind][s] + (cost["W"][s] if whole else 0)
        start = max([end(s, i - 1) if i else 0] + [end(d[0], where[d]) for d in needs(s, a)])
        return start + Fraction(c) / V

    return max(end(s, len(row) - 1) for s, row in enumerate(rows) if row)


@pytest.mark.parametrize("make", [S.gpipe, S.one_f_one_b, lambda P, M: S.interleaved_1f1b(P, M)])
def test_non_uniform_stage_costs_match_the_oracle(make):
    cost = {"F": [1, 3, 2], "B": [2, 1, 4], "W": [1, 0, 2]}
    for M in (1, 2, 3, 6):
        sched = make(3, M)
        assert simulate(sched, cost).makespan == _oracle_makespan(sched, cost), (sched.name, M)


def test_gpipe_with_a_slow_stage_is_a_flow_shop():
    # identical jobs through machines of times p_s take sum p + (M-1) max p, forward then back
    f, bw = [1, 3, 2, 1], [2, 2, 5, 1]
    for M in (1, 2, 5):
        tl = simulate(S.gpipe(4, M), {"F": f, "B": bw, "W": 0})
        assert tl.makespan == sum(f) + sum(bw) + (M - 1) * (max(f) + max(bw))


# --- closed forms, exactly ---------------------------------------------------------------------

@pytest.mark.parametrize("name, make", [("gpipe", S.gpipe), ("1f1b", S.one_f_one_b)])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 13])
def test_gpipe_and_1f1b_bubble_is_the_closed_form(name, make, P, M):
    assert simulate(make(P, M)).bubble_fraction() == bubble_closed_form(name, P, M)
    # any uniform costs: the fill and drain scale with the work
    tl = simulate(make(P, M), {"F": Fraction(2), "B": Fraction(5), "W": Fraction(1)})
    assert tl.bubble_fraction() == Fraction(P - 1, M + P - 1)


@pytest.mark.parametrize("V", [2, 3])
@pytest.mark.parametrize("P", [1, 2, 3] + [pytest.param(P, marks=pytest.mark.slow)
                                             for P in (4, 5)])        # 4, 5: ~0.15 s each
def test_interleaved_bubble_is_the_closed_form_for_m_at_least_p(P, V):
    # Megatron's claim is for M a multiple of P; schedules.interleaved_1f1b, whose last
    # group takes the M mod P left over, meets it for every M >= P (measured, P <= 5, M < 16)
    for M in range(P, 16):
        tl = simulate(S.interleaved_1f1b(P, M, V), UNIT)
        assert tl.bubble_fraction() == Fraction(P - 1, V * M + P - 1), (P, M, V)
        if V == 2:       # V = 2 halves are exact binary fractions: floats give it exactly too
            assert (simulate(S.interleaved_1f1b(P, M, V)).bubble_fraction()
                    == bubble_closed_form("interleaved", P, M, V))
    # measured: for M < P the pipeline never fills and the bubble is larger
    for M in range(1, P):
        b = simulate(S.interleaved_1f1b(P, M, V), UNIT).bubble_fraction()
        assert b > Fraction(P - 1, V * M + P - 1), (P, M, V)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
def test_zb_h1_bubble_is_the_closed_form_for_m_at_least_p(P):
    for M in range(P, P + 8):
        assert (simulate(S.zero_bubble_h1(P, M)).bubble_fraction()
                == bubble_closed_form("zb-h1", P, M)), (P, M)
    # measured: for M < P the bubble is larger than (P-1)/(3M+P-1) (too few Ws to fill it)
    for M in range(1, P):
        b = simulate(S.zero_bubble_h1(P, M), UNIT).bubble_fraction()
        assert b > Fraction(P - 1, 3 * M + P - 1), (P, M)


def test_zb_h1_peak_activations_match_1f1b_first_stage():
    # activations stay until W, so every stage holds min(P, M), stage 0's 1F1B peak: the
    # paper's "same number of in-flight micro-batches on all stages" (Qi et al. 2023, 2.1)
    for P, M in [(1, 3), (2, 1), (2, 4), (3, 3), (4, 8), (5, 7)]:
        peaks = peak_activations(S.zero_bubble_h1(P, M))
        assert peaks == [min(P, M)] * P
        assert max(peaks) == max(peak_activations(S.one_f_one_b(P, M)))


def test_make_schedule_names_have_closed_forms():
    for name in set(family.SCHEDULES) - {"zbv", "v-half", "v-min", "dualpipe", "dualpipev"}:
        # searched, built from blocks, or with a formula in other terms: test_family.py,
        # test_dualpipe.py
        P, M = 2, 4
        tl = simulate(family.make_schedule(name, P, M, V=2))
        assert tl.bubble_fraction() == bubble_closed_form(name, P, M, V=2), name


def test_closed_form_rejects_unknown_names():
    with pytest.raises(ValueError, match="known"):
        bubble_closed_form("pipedream-async", 4, 8)


# --- memory ------------------------------------------------------------------------------------

@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
def test_peak_activations_gpipe_m_everywhere_1f1b_p_minus_s(P):
    for M in (1, 2, 3, 4, 7):
        assert peak_activations(S.gpipe(P, M)) == [M] * P
        assert peak_activations(S.one_f_one_b(P, M)) == [min(P - s, M) for s in range(P)]


def test_peak_activations_split_schedule_frees_at_w():
    row = (F(0), F(1), B(0), B(1), W(0), W(1))
    assert peak_activations(PipelineSchedule("x", 1, 2, (row,))) == [2]
    row = (F(0), B(0), W(0), F(1), B(1), W(1))
    assert peak_activations(PipelineSchedule("x", 1, 2, (row,))) == [1]


# --- recorded timelines ---------------------------------------------------------------------

RECORDS = [[(F(0), 10.0, 10.4), (B(0), 11.27, 11.6)],
           [(F(0), 10.45, 10.85), (B(0), 10.85, 11.25)]]


def test_from_records_shifts_to_zero_and_measures_the_bubble():
    tl = Timeline.from_records(RECORDS, name="measured")
    assert tl.stages[1][0] == Slot(F(0), pytest.approx(0.45), pytest.approx(0.85))
    assert (tl.origin, tl.time_unit, tl.micro_batches) == (0, "s", 1)
    assert tl.makespan == pytest.approx(1.6)
    assert tl.bubble_fraction() == pytest.approx(1 - (0.4 + 0.33 + 0.4 + 0.4) / 3.2)
    with pytest.raises(ValueError, match="before it starts"):
        Timeline.from_records([[(F(0), 2.0, 1.0)]])


# --- renderers --------------------------------------------------------------------------------

def test_ascii_one_cell_per_time_unit():
    text = R.ascii(simulate(_hand_gpipe(2, 2), {"F": 1, "B": 1, "W": 0}))
    assert text == "\n".join([
        "gpipe-by-hand: P=2, M=2, bubble 33.3% (1 cell = 1 time unit)",
        "stage 0 |F0 F1 .  .  B0 B1 |",
        "stage 1 |.  F0 F1 B0 B1 .  |",
        R.LEGEND])


def test_ascii_quantizes_float_timings_by_majority():
    text = R.ascii(Timeline.from_records(RECORDS, name="measured"), columns=8)
    assert text.splitlines()[:3] == [
        "measured: P=2, M=1, bubble 52.2% (1 cell = 0.2 s)",
        "stage 0 |F0 F0 .  .  .  .  B0 B0 |",
        "stage 1 |.  .  F0 F0 B0 B0 .  .  |"]


def test_ascii_quantizes_whole_unit_timelines_too_long_for_exact_cells():
    tl = simulate(S.gpipe(2, 8), {"F": 10, "B": 10, "W": 0})      # 180 units
    lines = R.ascii(tl).splitlines()
    assert "1 cell = 3 unit" in lines[0] and len(lines[1]) == len("stage 0 |") + 60 * 3 + 1


def test_ascii_interleaved_lower_case_for_later_chunks():
    text = R.ascii(simulate(S.interleaved_1f1b(2, 2, 2), {"F": 1, "B": 1, "W": 1}))
    assert "1/2 time unit" in text.splitlines()[0]
    assert "f0" in text and "b1" in text and "F1" in text and "B0" in text


def test_module_docstring_diagram_is_what_the_code_draws():
    drawn = R.ascii(simulate(S.one_f_one_b(3, 4)))
    assert "\n".join("    " + line for line in drawn.splitlines()) in R.__doc__


def test_side_by_side_draws_both_with_as_many_cells():
    sim = simulate(S.one_f_one_b(2, 1), {"F": 1, "B": 1, "W": 0})
    text = R.side_by_side(sim, Timeline.from_records(RECORDS), ("simulated", "measured"))
    lines = text.splitlines()
    assert lines[0] == "== simulated ==" and "== measured ==" in lines
    rows = [line for line in lines if line.startswith("stage")]
    assert len(rows) == 4 and len({len(r) for r in rows}) == 1
    assert "bubble 50.0%" in text and "bubble 52.2%" in text


def test_chrome_trace_one_event_per_action(tmp_path):
    tl = simulate(S.interleaved_1f1b(2, 2, 2))
    trace = R.chrome_trace(tl, rank_of_stage=[4, 5])
    assert len(trace) == sum(len(row) for row in tl.stages) == 2 * 2 * 2 * 2
    names = {(e.rank, e.name) for e in trace.events()}
    assert (4, "F0") in names and (5, "B1 (chunk 1)") in names
    first = min((e for e in trace.events() if e.rank == 5), key=lambda e: e.start_us)
    assert (first.name, first.start_us, first.end_us, first.cat) == ("F0", 500.0, 1000.0, "F")
    assert first.args == {"micro_batch": 0, "chunk": 0}
    back = Trace.read(trace.write(tmp_path / "pp.json"))
    assert len(back) == len(trace) and back.labels[5] == "stage 1 (rank 5)"
    measured = R.chrome_trace(Timeline.from_records(RECORDS))
    assert max(e.end_us for e in measured.events()) == pytest.approx(1.6e6)


@pytest.mark.slow       # ~1 s, the matplotlib import; the error path below stays
def test_plot_png_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    sim = simulate(S.one_f_one_b(3, 4))
    path = R.plot_png(sim, tmp_path / "a.png", title="1F1B")
    both = R.plot_png(Timeline.from_records(RECORDS), tmp_path / "b.png", compare=sim)
    for p in (path, both):
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_png_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[plot\]'"):
        R.plot_png(simulate(S.gpipe(1, 1)), tmp_path / "x.png")


def test_a_measured_action_too_short_for_a_cell_is_still_drawn():
    """Demo 12 under load: a quick F1 between two long waits vanished from the quantized
    measured timeline. Every action gets at least one cell."""
    records = [[(Action("F", 0, 0), 0.0, 1.0), (Action("F", 1, 0), 5.0, 5.01),
                (Action("B", 0, 0), 9.0, 10.0)]]
    row = R.ascii(Timeline.from_records(records, "1f1b"), columns=10).splitlines()[1]
    assert "F0" in row and "F1" in row and "B0" in row, row


def _shown(row: str) -> list[str]:
    """The actions a drawn row shows, in order, repeats merged."""
    cells = [row[i:i + 3].strip() for i in range(row.index("|") + 1, len(row) - 1, 3)]
    return [c for k, c in enumerate(cells) if c != "." and (k == 0 or c != cells[k - 1])]


@pytest.mark.parametrize("seed", range(20))
def test_every_measured_action_is_drawn_once_in_order_whatever_its_length(seed):
    """Random measured rows (durations over four orders of magnitude, gaps between them),
    drawn in as few as len(row) cells: each action shows, and in the order it ran."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 12))
    t, records = 0.0, []
    for m in range(k):
        t += float(rng.choice([0.0, 10 ** rng.uniform(-3, 1)]))          # a gap, or none
        length = 10 ** rng.uniform(-4, 0)
        records.append((Action("F" if m % 2 == 0 else "B", m, 0), t, t + length))
        t += length
    for columns in (k, k + 3, 30):
        row = R.ascii(Timeline.from_records([records]), columns=columns).splitlines()[1]
        assert _shown(row) == [f"{a.kind}{a.micro_batch}" for a, _, _ in records], row
