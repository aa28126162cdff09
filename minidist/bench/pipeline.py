"""Benchmark: pipeline schedules run on P ranks, against their simulation and formulas.

Each schedule's bubble, 1 - sum_s busy_s / (P makespan) of one step's actions
(Timeline.bubble_fraction), three ways: the closed form (unit costs, free messages; for
zbv, whose order is searched, the unit-cost simulation); the
simulation (schedule_sim.simulate) with this machine's costs, each stage's median F, B, W;
and a real training step on P ranks, each action timed from the arrival of its input
(parallel/pipeline/stage.py), so that waiting for a neighbour is idle. What the simulation
leaves out is printed beside it: the latency of a message its receiver already waited for
(the copy in and out, the receiver's wake-up at its doorbell, runtime/doorbell.py:
medians of 25-40 us here since sends are eager, collectives/api.py's send; 240-430 us
when a worker thread sent them) and the gap before an action that
receives nothing (the Python between actions: ~20 us). Counted
exactly: the (micro-batch, chunk) activations a stage holds at most, the bytes their
graphs keep, and the bytes each stage sends per step, each against its formula.

One rank's view (stage s of P, one schedule, one run):
    1. build Plan(pp=P, micro_batches=M, schedule, V), placement checks off
    2. train 1 + steps AdamW steps (the first a warm-up): records, bytes the links sent
    3. one more step with measure_memory: held_bytes_peak
    4. alone: F(0, c) of one micro-batch per chunk c, links talking to nobody, and the
       bytes that one graph keeps
The launcher joins the P records of each step into a Timeline and reduces them:
    measured   bubble of each measured step, median over steps
    simulated  simulate(schedule, costs): per stage, the median duration of each kind x V
               (a chunk is 1/V of a stage); a non-split B is b + w, passed as B with W = 0
    memory     held_peak vs peak_activations; held_bytes_peak vs the same scan weighted by
               the bytes of one micro-batch alone: count x bytes (GPipe, 1F1B), exact; ZB-H1
               below, since after B a micro-batch keeps only what its W needs
    p2p bytes  act_bytes x (#F not on the last virtual stage + #B not on virtual stage 0),
               act_bytes = rows x T x C x itemsize
Repeats run interleaved over the schedules; each keeps its fastest (median step) repeat.
Defaults: C=256, T=64, 2 layers per chunk, so an action's compute (~25 ms for 4 layers)
dwarfs a message's latency; at C=128 it is ~10 ms and measured exceeded simulated by 1.5-6
points at P=2, M=8 (1F1B: about 16 messages on the critical path).

Shapes: the boundary tensor is h (rows, T, C), rows = global batch / M; no dp, tp or cp.
Communication per step: the pipeline links (bytes above) and the tied wte's all-reduce
between the first and the last stage (its own group, not counted).
Run:  python -m minidist bench pipeline --pp 2 --schedule all [--micro-batches 8]
      [--virtual-stages 2] [--steps 5] [--repeats 3] [--n-layer 2 P V] [--n-embd 256]
      [--length 32] [--rows 4] [--dtype float32] [--trace t.json] [--png t.png]
References: Huang et al. 2019, arXiv:1811.06965 (GPipe); Narayanan et al. 2021,
    arXiv:2104.04473, Sec. 2.2 (1F1B, interleaved); Qi et al. 2023, arXiv:2401.10241,
    Sec. 2.1 (ZB-H1).
Read next: parallel/pipeline/schedule_sim.py, parallel/pipeline/stage.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import statistics
import sys
from dataclasses import replace

import numpy as np

from minidist.cli import CliParser, at_least, file_path
from minidist.data import DataConfig, SyntheticData, model_config_for
from minidist.observe.trace import Trace
from minidist.parallel import placement as pl
from minidist.parallel.compose import Plan, build
from minidist.parallel.micro_batching import micro_batches
from minidist.parallel.pipeline import schedule_render as render
from minidist.parallel.pipeline.schedule_sim import (Timeline, bubble_closed_form,
                                                     peak_activations, simulate)
from minidist.parallel.pipeline.family import SCHEDULES
from minidist.parallel.pipeline.schedules import FB, KINDS, Action, PipelineSchedule
from minidist.runtime.launch import spawn

SEED, LR = 0, 1e-3
OVERSUBSCRIBED = ("OVERSUBSCRIBED: more ranks than cores, so an action's time includes the "
                  "time other stages ran on its core; its bubble is not the schedule's")


# --- the formulas -------------------------------------------------------------------------

def p2p_formula(schedule: PipelineSchedule, act_bytes: int) -> list[int]:
    """Per stage, bytes sent per step: act_bytes x (#F not on the last virtual stage + #B
    not on virtual stage 0), each one (rows, T, C) tensor to a neighbour, less the
    hand-overs inside a stage (the turn of the V placement moves nothing over a link)."""
    return [act_bytes * sum(m.dst != s for a in row for m in schedule.messages_out(s, a))
            for s, row in enumerate(schedule.actions)]


def held_bytes_formula(schedule: PipelineSchedule, unit_bytes: list[list[int]]) -> list[int]:
    """Per stage, the most bytes held at once if (m, c) keeps unit_bytes[s][c] (one
    micro-batch alone on chunk c) from its F until its B (W when split): peak_activations'
    scan, weighted. V = 1: peak_activations x unit bytes."""
    out = []
    for s, row in enumerate(schedule.actions):
        held = peak = 0
        for a in row:
            for p in a.parts():
                frees = p.kind == "W" or (p.kind == "B" and not schedule.is_split(
                    s, p.micro_batch, p.chunk))
                held += unit_bytes[s][p.chunk] * ((p.kind == "F") - frees)
                peak = max(peak, held)
        out.append(peak)
    return out


def measured_costs(schedule: PipelineSchedule, timelines: list[Timeline]) -> dict[str, list]:
    """{kind: per stage, median duration of its actions of that kind x V}: the cost of a
    stage's whole share, as simulate() takes it (a dual chunk is a whole share: x 1);
    kinds that never ran cost 0 (W unsplit). B is the median of the split Bs where some
    are split (a whole one is then simulated as B + W); FB only where the schedule has
    some (DualPipe's overlapped pairs, run one after the other here)."""
    share = schedule.chunk_share.denominator          # chunks per stage's share: V, or 1

    def cost(kind: str, s: int) -> float:
        d = [sl.duration for tl in timelines for sl in tl.stages[s] if sl.action.kind == kind
             and (kind != "B" or not schedule.split_backward or schedule.is_split(
                 s, sl.action.micro_batch, sl.action.chunk))]
        return statistics.median(d) * share if d else 0.0
    kinds = KINDS + ((FB,) if any(a.kind == FB for r in schedule.actions for a in r) else ())
    return {kind: [cost(kind, s) for s in range(schedule.stages)] for kind in kinds}


def _sender(schedule: PipelineSchedule, msg) -> tuple[int, Action]:
    """(stage, action) that sends `msg`: F of virtual stage k-1, or B of k+1 (a gradient)."""
    k, kind = (msg.vstage - 1, "F") if msg.kind == "act" else (msg.vstage + 1, "B")
    stage, chunk = schedule.place(k, msg.micro_batch)
    return stage, Action(kind, msg.micro_batch, chunk)


def waits(schedule: PipelineSchedule, timelines: list[Timeline]) -> tuple[list, list]:
    """(latencies, gaps) in seconds, what simulate() leaves out. Latency: for each message
    whose receiver was idle before it was sent, sender's end to receiver's start (the send
    thread, the copy, the receiver's back-off, runtime/wait.py). Gap: for each action that
    receives nothing, the time since its stage's previous action ended (Python between)."""
    lat, gaps = [], []
    for tl in timelines:
        end = {(s, p): sl.end for s, row in enumerate(tl.stages) for sl in row
               for p in sl.action.parts()}
        for s, row in enumerate(tl.stages):
            for prev, sl in zip(row, row[1:]):
                msgs = schedule.messages_in(s, sl.action)
                gaps += [] if msgs else [sl.start - prev.end]
                lat += [sl.start - end[_sender(schedule, m)] for m in msgs
                        if prev.end < end[_sender(schedule, m)]]
    return lat, gaps


# --- one rank -----------------------------------------------------------------------------

class _Nobody:
    """Pipeline links that talk to nobody: recv gives zeros, send drops the tensor."""

    def send(self, kind: str, dst: int, x, micro_batch: int) -> None:
        pass

    def recv(self, kind: str, src: int, out: np.ndarray, micro_batch: int) -> np.ndarray:
        out[...] = 0
        return out

    def wait_all(self) -> None:
        pass


def _alone_bytes(stage, batches, n_tokens: int) -> list[int]:
    """Per chunk c, the bytes the graph of F(0, c) keeps when it is the only one held."""
    links, held = stage.links, stage.held_peak
    stage.links, out = _Nobody(), []
    try:
        for c in range(stage.cut.chunks):
            stage.begin(batches, n_tokens)
            stage.held_bytes_peak = 0
            stage.run(Action("F", 0, c))
            out.append(stage.held_bytes_peak)
    finally:
        stage.links, stage.held_peak, stage.live = links, held, {}
    return out


def _on_rank(ctx, cfg, data_cfg, plan: Plan, steps: int, batch: int) -> dict:
    pl.set_checking(False)                     # their digests would be traffic and time
    lay = build(ctx, plan, cfg, SEED, optimizer="adamw", lr=LR, weight_decay=0.0,
                betas=(0.9, 0.999), momentum=0.0)
    stage, data = lay.pipeline, SyntheticData(data_cfg)
    records, sent = [], []
    for step in range(steps + 2):              # warm-up, measured steps, memory step
        batches, n = micro_batches(data, step, batch, 1, 0, plan.micro_batches, SEED)
        # micro_batches() cuts views of one (B, T) batch array, and distinct_bytes counts a
        # shared buffer once: own copies, as a loader yielding micro-batches would give
        batches = [replace(mb, x=mb.x.copy(), y=mb.y.copy()) for mb in batches]
        stage.measure_memory = step == steps + 1
        before = stage.links.stats["bytes_sent"]
        stage.step(lay.engine, batches, n)
        lay.engine.step(LR, None)
        sent.append(stage.links.stats["bytes_sent"] - before)
        records.append(list(stage.record))
    return {"stage": stage.cut.stage, "records": records[:-1], "sent": sent,
            "held": stage.held_peak, "held_bytes": stage.held_bytes_peak,
            "unit_bytes": _alone_bytes(stage, batches, n)}


# --- the launcher -------------------------------------------------------------------------

def make_plan(name: str, P: int, M: int, V: int) -> Plan:
    """The Plan of one run: pp=P, M micro-batches, V chunks if interleaved, checks off."""
    return Plan(pp=P, micro_batches=M, schedule=name, check_placements=False,
                virtual_stages=V if name == "interleaved" else None)


def _unit_bubble(sched: PipelineSchedule, key: tuple) -> float:
    """The bubble at unit costs: the closed form, or the simulation where there is none
    (zbv: found by a search, schedule_auto.py)."""
    try:
        return bubble_closed_form(*key)
    except ValueError:
        return simulate(sched).bubble_fraction()


def measure(name: str, cfg, data_cfg, P: int, M: int, V: int, steps: int, rows: int) -> dict:
    """One run of schedule `name` on P ranks, reduced to numbers (module docstring)."""
    plan, key = make_plan(name, P, M, V), (name, P, M, V)
    runs = sorted(spawn(P, _on_rank, cfg, data_cfg, plan, steps, rows * M),
                  key=lambda r: r["stage"])
    sched = plan.pipeline_schedule()
    tls = [Timeline.from_records([r["records"][i] for r in runs], name, sched.chunks)
           for i in range(1, steps + 1)]                               # step 0: warm-up
    bubbles = [tl.bubble_fraction() for tl in tls]
    mid = sorted(range(steps), key=bubbles.__getitem__)[(steps - 1) // 2]
    costs = measured_costs(sched, tls)
    sim = replace(simulate(sched, costs), time_unit="s")               # costs in seconds
    lat, gaps = waits(sched, tls)
    comm = statistics.median(lat) if lat else 0.0
    act = rows * data_cfg.block_size * cfg.n_embd * np.dtype(cfg.dtype).itemsize
    unit = [r["unit_bytes"] for r in runs]
    return {"schedule": name, "P": P, "M": M, "V": sched.chunks, "split": sched.split_backward,
            "oversubscribed": P > (os.cpu_count() or 1), "closed": _unit_bubble(sched, key),
            "simulated": sim.bubble_fraction(), "measured": statistics.median(bubbles),
            "bubbles": bubbles, "step_s": statistics.median(tl.makespan for tl in tls),
            "costs": costs, "sim_timeline": sim, "timeline": tls[mid], "latency": lat,
            "gaps": gaps, "simulated_comm": simulate(sched, costs, comm).bubble_fraction(),
            "held_sched": peak_activations(sched), "held": [r["held"] for r in runs],
            "held_bytes": [r["held_bytes"] for r in runs], "unit_bytes": unit,
            "held_bytes_formula": held_bytes_formula(sched, unit), "act_bytes": act,
            "sent": [r["sent"] for r in runs], "sent_formula": p2p_formula(sched, act)}


def run_bench(cfg, data_cfg, P: int, M: int, V: int, names=SCHEDULES, steps: int = 5,
              repeats: int = 3, rows: int = 4) -> dict[str, dict]:
    """{schedule: measure(...)}, each run `repeats` times, interleaved over the schedules;
    each keeps the repeat with the smallest median step time."""
    best: dict[str, dict] = {}
    for _ in range(repeats):
        for name in names:
            r = measure(name, cfg, data_cfg, P, M, V, steps, rows)
            if name not in best or r["step_s"] < best[name]["step_s"]:
                best[name] = r
    return {name: best[name] for name in names}


# --- output -------------------------------------------------------------------------------

def _held_ok(r: dict) -> str:
    got, want = r["held_bytes"], r["held_bytes_formula"]
    if got == want:
        return "OK"
    below = r["split"] and all(0 < g <= w for g, w in zip(got, want))
    return "below" if below else "MISMATCH"      # ZB-H1: where a B-done, W-pending one is held


def _sent_ok(r: dict) -> str:
    good = all(all(b == f for b in row) for row, f in zip(r["sent"], r["sent_formula"]))
    return "OK" if good else "MISMATCH"


def render_table(results: dict[str, dict]) -> str:
    pct = lambda x: f"{100 * x:.1f}%"                                    # noqa: E731
    lines = [f"{'schedule':<12}{'M':>3}{'closed':>8}{'simulated':>11}{'measured':>10}"
             f"{'|Δ| pp':>8}{'step ms':>9}  {'held sched/meas':<18}"
             f"{'act bytes peak meas/expected':<34}{'p2p bytes/step meas/formula':<30}"]
    for r in results.values():
        cnt = lambda xs: ",".join(map(str, xs))                           # noqa: E731
        s = int(np.argmax(r["held_bytes"]))                              # the busiest stage
        sent = sum(row[-1] for row in r["sent"])
        held = f"{r['held_bytes'][s]:,}/{r['held_bytes_formula'][s]:,} {_held_ok(r)}"
        lines.append(
            f"{r['schedule']:<12}{r['M']:>3}{pct(r['closed']):>8}{pct(r['simulated']):>11}"
            f"{pct(r['measured']):>10}{100 * abs(r['measured'] - r['simulated']):>8.1f}"
            f"{1e3 * r['step_s']:>9.1f}  {cnt(r['held_sched']) + '/' + cnt(r['held']):<18}"
            f"{held:<34}{sent:,}/{sum(r['sent_formula']):,} {_sent_ok(r)}")
    return "\n".join(lines)


def render_stages(results: dict[str, dict]) -> str:
    lines = [f"{'schedule':<12}{'stage':>6}{'F ms':>8}{'B ms':>8}{'W ms':>8}{'held':>6}"
             f"{'meas':>6}{'act bytes held':>16}{'expected':>14}{'one mb alone per chunk':>24}"
             f"{'p2p sent':>12}{'formula':>12}"]
    for r in results.values():
        for s in range(r["P"]):
            c = {k: f"{1e3 * r['costs'][k][s]:.2f}" if r["costs"][k][s] else "-" for k in KINDS}
            unit = ";".join(f"{b:,}" for b in r["unit_bytes"][s])
            lines.append(f"{r['schedule']:<12}{s:>6}{c['F']:>8}{c['B']:>8}{c['W']:>8}"
                         f"{r['held_sched'][s]:>6}{r['held'][s]:>6}{r['held_bytes'][s]:>16,}"
                         f"{r['held_bytes_formula'][s]:>14,}{unit:>24}"
                         f"{r['sent'][s][-1]:>12,}{r['sent_formula'][s]:>12,}")
    return "\n".join(lines)


def render_waits(results: dict[str, dict]) -> str:
    us = lambda xs: f"{1e6 * statistics.median(xs):.0f}/{1e6 * max(xs):.0f} ({len(xs)})" \
        if xs else "-"                                                   # noqa: E731
    lines = ["what simulated leaves out: message latency (sender's end to receiver's start, "
             "receiver idle before) and the gap before actions that receive nothing",
             f"{'schedule':<12}{'latency us med/max (n)':>24}{'simulated, comm = med':>23}"
             f"{'measured':>10}{'gap us med/max (n)':>22}"]
    for r in results.values():
        lines.append(f"{r['schedule']:<12}{us(r['latency']):>24}"
                     f"{100 * r['simulated_comm']:>22.1f}%{100 * r['measured']:>9.1f}%"
                     f"{us(r['gaps']):>22}")
    return "\n".join(lines)


def render_summary(results: dict[str, dict]) -> list[str]:
    worst = max(results.values(), key=lambda r: abs(r["measured"] - r["simulated"]))
    out = [f"measured vs simulated: max |Δ| = "
           f"{100 * abs(worst['measured'] - worst['simulated']):.1f} percentage points "
           f"({worst['schedule']})" + (f"; {OVERSUBSCRIBED}" if worst["oversubscribed"]
                                         else "")]
    if "zb-h1" in results and "1f1b" in results:
        zb, one = results["zb-h1"], results["1f1b"]
        ratio = lambda k: zb[k] / one[k] if one[k] else float("nan")     # noqa: E731
        out.append(f"ZB-H1 / 1F1B bubble: measured {ratio('measured'):.2f} "
                   f"({100 * zb['measured']:.1f}% vs {100 * one['measured']:.1f}%), "
                   f"simulated {ratio('simulated'):.2f}, closed form {ratio('closed'):.2f}")
    return out


def write_trace(results: dict[str, dict], path: str) -> str:
    """One Chrome trace: for each schedule, P rows holding its measured (median) step."""
    trace = Trace()
    for i, r in enumerate(results.values()):
        rows = [i * r["P"] + s for s in range(r["P"])]
        trace.extend(render.chrome_trace(r["timeline"], rows).events())
        trace.labels.update({q: f"{r['schedule']} stage {s}" for s, q in enumerate(rows)})
    return str(trace.write(path))


def write_pngs(results: dict[str, dict], path: str) -> list[str]:
    """Measured above simulated, one PNG per schedule (PATH, or PATH-name.png for many)."""
    stem, ext = os.path.splitext(path)
    return [render.plot_png(r["timeline"], path if len(results) == 1 else
                            f"{stem}-{name}{ext or '.png'}", f"{name}: measured (median step)",
                            compare=replace(r["sim_timeline"], schedule_name=f"{name}, "
                                            "simulated with the measured costs"))
            for name, r in results.items()]


def _parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m minidist bench pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=at_least(2), default=2, help="pipeline stages, one rank each")
    p.add_argument("--schedule", default="all", choices=list(SCHEDULES) + ["all"])
    p.add_argument("--micro-batches", type=at_least(1), default=8, help="M (default 8)")
    p.add_argument("--virtual-stages", type=at_least(1), default=2,
                   help="V, interleaved (default 2)")
    p.add_argument("--steps", type=at_least(1), default=5, help="measured steps after 1 warm-up")
    p.add_argument("--repeats", type=at_least(1), default=3, help="interleaved runs; fastest kept")
    p.add_argument("--n-layer", type=at_least(1), default=None, help="default 2 P V: 2 per chunk")
    p.add_argument("--n-embd", type=at_least(1), default=256)
    p.add_argument("--n-head", type=at_least(1), default=4)
    p.add_argument("--length", type=at_least(1), default=32, help="prompt length, T = 2 x length")
    p.add_argument("--rows", type=at_least(1), default=4, help="sequences per micro-batch")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--trace", type=file_path, default=None,
                   help="write the measured timelines (Chrome)")
    p.add_argument("--png", default=None, help="write PNGs (needs the plot extra)")
    return p


def _report(results: dict[str, dict], a: argparse.Namespace) -> None:
    print(f"bubble = 1 - busy / (P x makespan) of one step; measured: median over {a.steps} "
          f"steps after 1 warm-up, each schedule keeping the fastest of {a.repeats} "
          "interleaved repeats; simulated: each stage's median F, B, W x V (non-split: B = "
          "b + w, W = 0), comm = 0; closed form: unit costs")
    print(render_table(results), render_stages(results), render_waits(results), sep="\n\n")
    for r in results.values():
        print("\n" + render.side_by_side(r["sim_timeline"], r["timeline"], (
            "simulated (measured costs)", "measured (median step)")))
    print("\n" + "\n".join(render_summary(results)))
    if a.trace:
        print(f"trace: {write_trace(results, a.trace)} (open in https://ui.perfetto.dev)")
    if a.png:
        print("png: " + ", ".join(write_pngs(results, a.png)))


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist bench pipeline`: the bubble of each schedule, closed form,
    simulated with measured costs, measured; held activations and p2p bytes vs formulas."""
    p = _parser()
    a = p.parse_args(argv)
    if a.png and importlib.util.find_spec("matplotlib") is None:
        p.error("--png needs matplotlib: pip install -e '.[plot]'")
    names = list(SCHEDULES) if a.schedule == "all" else [a.schedule]
    V, data_cfg = a.virtual_stages, DataConfig(task="sort", length=a.length)
    n_layer = a.n_layer or 2 * a.pp * V
    cfg = model_config_for(data_cfg, n_layer=n_layer, n_embd=a.n_embd, n_head=a.n_head,
                           dtype=a.dtype)
    try:
        for name in names:
            make_plan(name, a.pp, a.micro_batches, V).validate(
                cfg, a.rows * a.micro_batches, data_cfg.block_size)
    except ValueError as e:
        p.error(str(e))
    cores = os.cpu_count() or 1
    print("$ python -m minidist bench pipeline " + shlex.join(sys.argv[1:] if argv is None
                                                              else argv))
    print(f"GPT {n_layer} layers ({n_layer / a.pp:g} per stage; interleaved: "
          f"{n_layer / (a.pp * V):g} per chunk, V={V}), C={cfg.n_embd}, H={cfg.n_head}, "
          f"T={cfg.block_size}, {cfg.dtype}; M={a.micro_batches} micro-batches of {a.rows} "
          f"sequences; P={a.pp} ranks on {cores} CPU cores"
          + (f"; {OVERSUBSCRIBED}" if a.pp > cores else ""))
    _report(run_bench(cfg, data_cfg, a.pp, a.micro_batches, V, names, a.steps, a.repeats,
                      a.rows), a)
    return 0
