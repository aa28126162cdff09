"""`python -m minidist predict`: a layout's step at scale, predicted, with its breakdown.

    python -m minidist predict --model gpt3-175b --hardware a100-80g --gpus 1024 --tp 8
        --pp 16 --global-batch 1536 [--seq 2048] [--micro-batch 1] [--zero 0] [--sp]
        [--recompute full] [--precision bf16] [--schedule 1f1b] [--overlap-dp] [--png F]
    python -m minidist predict --search --model gpt3-175b --gpus 1024 --global-batch 1536
                                               the 10 fastest layouts that fit
    python -m minidist predict --replay        the model against Megatron's published runs

The defaults are Megatron's GPT-3 175B layout on 1,024 A100s (tp 8, pp 16, dp 8, global
batch 1,536). What it prints: the model and the layout (dp = gpus / (tp pp)), where each group lies on
the nodes, the step time, tokens/s, model FLOP/s per GPU, MFU and HFU (one convention:
hardware/predict.py), the step's breakdown (compute, recomputation, tp collectives, pipeline
p2p and bubble, data-parallel sync, optimizer), memory per GPU by category against the
GPU's, and the global efficiency parameters with where they were fitted. `--png` draws the
breakdown (matplotlib). Models: the GPT-3 presets of memory/budget_models.py
(gpt3-125m ... gpt3-175b), Megatron's Table 1 shapes (megatron-1.7b ... megatron-1t), the
Llama 2 and 3 presets of hardware/llama.py (llama2-7b ... llama3-405b; dense, no --cp), or
--layers/--hidden/--heads/--vocab. Hardware: hardware/profiles/ (a100-40g, a100-80g,
h100-sxm, h200), or cpu (this machine).
Read next: hardware/predict.py, hardware/replay.py.
"""

from __future__ import annotations

import textwrap
from dataclasses import replace

from minidist.cli import CliParser, at_least
from minidist.hardware import profiles, replay
from minidist.hardware.architecture import Architecture
from minidist.hardware.llama import LLAMA_SHAPES, llama
from minidist.hardware.predict import Efficiency, predict, search
from minidist.memory.budget_models import GPT3_SHAPES, preset
from minidist.nn import GPTConfig
from minidist.parallel.compose import Plan

MEGATRON = {f"megatron-{'1t' if r.params_b > 1000 else f'{r.params_b:g}b'}": r
            for r in replay.TABLE_1}
GIB = 2 ** 30


def parse_args(argv):
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-175b",
                    help=f"a preset: {', '.join(GPT3_SHAPES)}, {', '.join(MEGATRON)}, "
                         f"{', '.join(LLAMA_SHAPES)}; or 'custom' with --layers --hidden "
                         "--heads")
    ap.add_argument("--layers", type=at_least(1), default=None)
    ap.add_argument("--hidden", type=at_least(1), default=None)
    ap.add_argument("--heads", type=at_least(1), default=None)
    ap.add_argument("--vocab", type=at_least(1), default=None)
    ap.add_argument("--hardware", default="a100-80g",
                    help=f"{', '.join(profiles.names())}, or cpu (this machine, measured)")
    ap.add_argument("--gpus", type=at_least(1), default=1024)
    ap.add_argument("--tp", type=at_least(1), default=8)
    ap.add_argument("--pp", type=at_least(1), default=16)
    ap.add_argument("--cp", type=at_least(1), default=1, help="context-parallel ranks")
    ap.add_argument("--cp-algo", default="ring", choices=["ring", "ulysses"])
    ap.add_argument("--dp", type=at_least(1), default=None,
                    help="data-parallel ranks (default: gpus / (tp pp cp))")
    ap.add_argument("--ep", type=at_least(1), default=1,
                    help="expert-parallel ranks among the dp ranks (a MoE model: --moe-every)")
    ap.add_argument("--moe-every", type=at_least(0), default=0,
                    help="every k-th block a mixture of experts (0: dense)")
    ap.add_argument("--experts", type=at_least(1), default=8, help="experts of a MoE block")
    ap.add_argument("--top-k", type=at_least(1), default=2, help="experts per token")
    ap.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    ap.add_argument("--global-batch", type=at_least(1), default=1536)
    ap.add_argument("--micro-batch", type=at_least(1), default=1)
    ap.add_argument("--seq", type=at_least(1), default=None,
                    help="sequence length (default: the model's)")
    ap.add_argument("--recompute", default="full", choices=["none", "selective", "full"])
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32", "tf32"])
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved"])
    ap.add_argument("--virtual-stages", type=at_least(1), default=None,
                    help="model chunks per pipeline rank (interleaved; default 2)")
    ap.add_argument("--overlap-dp", action="store_true",
                    help="hide the gradient sync behind the last backward (DDP buckets)")
    ap.add_argument("--png", default="", help="also draw the breakdown into this PNG")
    ap.add_argument("--search", action="store_true",
                    help="rank every layout of --gpus that fits (tp, pp, dp, micro-batch, "
                         "recomputation, ZeRO 0/1) by predicted step time; the top 10")
    ap.add_argument("--replay", action="store_true",
                    help="the model against Megatron's Table 1 and 2 (fits on 3 rows)")
    return ap.parse_args(argv), ap


def model_of(a) -> GPTConfig | Architecture:
    if a.model in LLAMA_SHAPES:
        if a.moe_every:
            raise ValueError(f"--moe-every {a.moe_every}: the Llama presets are dense models")
        arch = llama(a.model, a.recompute)
        return replace(arch, block_size=a.seq or arch.block_size,
                       vocab_size=a.vocab or arch.vocab_size)
    if a.model in MEGATRON:
        cfg = MEGATRON[a.model].config()
    elif a.model in GPT3_SHAPES:
        cfg = preset(a.model)
    elif a.model == "custom":
        if None in (a.layers, a.hidden, a.heads):
            raise ValueError("--model custom needs --layers, --hidden and --heads")
        cfg = GPTConfig(vocab_size=a.vocab or 51200, block_size=a.seq or 2048,
                        n_layer=a.layers, n_head=a.heads, n_embd=a.hidden, dtype="float32")
    else:
        raise ValueError(f"--model {a.model!r} is unknown; use one of "
                         f"{', '.join([*GPT3_SHAPES, *MEGATRON, *LLAMA_SHAPES])} or custom")
    return replace(cfg, block_size=a.seq or cfg.block_size, recompute=a.recompute,
                   vocab_size=a.vocab or cfg.vocab_size, moe_every=a.moe_every,
                   n_experts=a.experts, top_k=a.top_k, capacity_factor=0.0)


def shape_words(cfg: GPTConfig | Architecture) -> str:
    """"96 layers, h=12288, 96 heads, V=51200, s=2048"; an Architecture's KV heads and MLP
    too ("64 heads (8 KV), swiglu F=28672")."""
    heads = f"{cfg.n_head} heads"
    if isinstance(cfg, Architecture):
        heads += f" ({cfg.n_kv_head} KV), {cfg.mlp} F={cfg.ffn_hidden}"
    return (f"{cfg.n_layer} layers, h={cfg.n_embd}, {heads}, V={cfg.vocab_size}, "
            f"s={cfg.block_size}")


def say(text: str) -> None:
    """One statement, wrapped within 100 columns (continuations indented)."""
    print("\n".join(textwrap.wrap(text.lstrip(), 100, break_on_hyphens=False,
                                   initial_indent="  " if text[0] == " " else "",
                                   subsequent_indent="    ")))


def layout(a) -> tuple[Plan, int]:
    """The Plan of the layout flags, and dp (--dp, else what the GPUs leave)."""
    model_parallel = a.tp * a.pp * a.cp
    if a.gpus % model_parallel:
        raise ValueError(f"--gpus {a.gpus} is not a multiple of --tp {a.tp} x --pp {a.pp} x "
                         f"--cp {a.cp}")
    dp = a.dp or a.gpus // model_parallel
    if dp * model_parallel != a.gpus:
        raise ValueError(f"--dp {dp} x --tp {a.tp} x --pp {a.pp} x --cp {a.cp} is "
                         f"{dp * model_parallel} GPUs, not --gpus {a.gpus}; leave --dp out")
    if a.ep > 1 and not a.moe_every:
        raise ValueError(f"--ep {a.ep} splits experts: give the model some (--moe-every 1)")
    if a.global_batch % (dp * a.micro_batch):
        raise ValueError(f"--global-batch {a.global_batch} does not split into dp={dp} ranks "
                         f"of micro-batches of --micro-batch {a.micro_batch}")
    plan = Plan(tp=a.tp, pp=a.pp, dp=dp, cp=a.cp, cp_algo=a.cp_algo, ep=a.ep, zero=a.zero,
                sequence_parallel=a.sp, micro_batches=a.global_batch // (dp * a.micro_batch),
                schedule=a.schedule, virtual_stages=a.virtual_stages, check_placements=False)
    return plan, dp


def show(a) -> int:
    cfg = model_of(a)
    hw = profiles.this_machine() if a.hardware == "cpu" else profiles.load(a.hardware)
    plan, dp = layout(a)
    if a.cp > 1 and a.moe_every:         # routing groups inside a cp chunk (no effect on time)
        cfg = replace(cfg, moe_group_size=cfg.block_size // (2 * a.cp))
    p = predict(cfg, plan, a.global_batch, hw, fmt=a.precision, overlap_dp=a.overlap_dp)
    nodes = -(-a.gpus // hw.gpus_per_node)
    say(f"predict · {a.model}: {shape_words(cfg)} · {a.gpus} x {hw.name} ({nodes} nodes of "
        f"{hw.gpus_per_node})")
    say(f" layout tp={a.tp}{' +sp' if a.sp else ''} pp={a.pp} dp={dp}"
        + (f" cp={a.cp} ({a.cp_algo})" * (a.cp > 1)) + (f" ep={a.ep}" * (a.ep > 1))
        + f" zero={a.zero}, "
        f"micro-batch {a.micro_batch}, M={plan.micro_batches}, {a.schedule}, recompute "
        f"{a.recompute}, {a.precision}")
    spans, ranks = profiles.layout_span(plan, hw), plan.group_ranks(0)
    say(" groups: " + ", ".join(
        f"{axis} {'inside a node' if n == 1 else f'across {n} nodes'} ({local} per node)"
        for axis, (n, local) in spans.items() if axis in ("tp", "cp", "pp", "dp", "ep")
        and len(ranks[axis]) > 1))
    say(f" step {p.step_s:.3f} s · {p.tokens_per_s:,.0f} tokens/s · "
        f"{p.flops_per_gpu / 1e12:.1f} TFLOP/s per GPU (model) · MFU {100 * p.mfu:.1f}% · "
        f"HFU {100 * p.hfu:.1f}% of {hw.peak(a.precision) / 1e12:.1f} TFLOP/s")
    say(" breakdown (seconds a step, the slowest stage): " + ", ".join(
        f"{k} {v:.3f}" for k, v in p.breakdown.items()
        if k != "pipeline" and (v or k not in ("cp exposed", "ep exposed"))))
    mem = p.memory
    if mem:
        say(" memory per GPU (GiB): " + ", ".join(f"{k} {v / GIB:.1f}" for k, v in mem.items()
                                                 if k != "total")
            + f"; total {mem['total'] / GIB:.1f} of {hw.hbm_bytes / GIB:.0f} GiB: "
            + ("fits" if p.fits else "DOES NOT FIT"))
    else:
        say(f" memory per GPU: not estimated ({p.unmodelled})")
    e, fit = Efficiency(), ", ".join(str(i + 1) for i in replay.FIT_ROWS)
    say(f" efficiency: eta_max {e.eta_max}, I_0 {e.knee:.2f} ridge points "
        f"({e.knee * hw.peak(a.precision) / hw.hbm_bytes_per_s:.0f} FLOP/B here), rho {e.rho} "
        f"(fitted on Megatron's Table 1 rows {fit}: python -m minidist predict --replay)")
    if a.png:
        save_png(a.png, p)
    return 0


def show_search(a) -> int:
    """--search: the 10 fastest layouts that fit, with their MFU and memory."""
    cfg = model_of(a)
    hw = profiles.this_machine() if a.hardware == "cpu" else profiles.load(a.hardware)
    rows = search(cfg, a.gpus, a.global_batch, hw, fmt=a.precision)
    say(f"predict --search · {a.model} on {a.gpus} x {hw.name}, global batch "
        f"{a.global_batch}: {len(rows)} layouts fit; the fastest 10")
    print(f"  {'tp':>3}{'pp':>4}{'dp':>6}{'zero':>5}{'micro':>6}  {'recompute':<10}"
          f"{'step s':>9}{'tokens/s':>11}{'MFU':>7}{'memory GiB':>12}")
    for p, plan, mb, rc in rows[:10]:
        print(f"  {plan.tp:>3}{plan.pp:>4}{plan.dp:>6}{plan.zero:>5}{mb:>6}  {rc:<10}"
              f"{p.step_s:>9.3f}{p.tokens_per_s:>11,.0f}{100 * p.mfu:>6.1f}%"
              f"{p.memory['total'] / GIB:>12.1f}")
    if not rows:
        print("  (none fits: more GPUs, a smaller model or batch)")
    return 0


def show_replay() -> int:
    eff, rows = replay.replay()
    print(f"fitted on Table 1 rows {', '.join(str(i + 1) for i in replay.FIT_ROWS)}: "
          f"eta_max {eff.eta_max:.2f}, I_0 {eff.knee:.2f} ridge points, rho {eff.rho}")
    print(f"  {'row':<29}{'model':>7}{'t':>3}{'p':>4}{'GPUs':>6}{'paper':>9}{'predicted':>11}"
          f"{'error':>8}")
    for row, t, err, fitted in rows:
        note = "  (fit)" if fitted else ""
        if row.mfu:                            # Table 5: the MFU, Eq. 7 over the time
            mfu = replay.korthikanti_flops(row.config(), row.batch, 2048) / (
                t * row.gpus * profiles.load("a100-80g").peak("bf16"))
            note = f"  MFU {100 * row.mfu:.1f}->{100 * mfu:.1f}%"
        print(f"  {row.source:<29}{row.params_b:>6g}B{row.tp:>3}{row.pp:>4}{row.gpus:>6}"
              f"{row.in_unit(row.published_seconds()):>7.4g}{row.unit:>2}"
              f"{row.in_unit(t):>9.4g}{row.unit:>2}{100 * err:>+7.1f}%" + note)
    print("  MFU: Korthikanti et al.'s Eq. 7 over the time (their HFU is MFU x Eq. 8 / Eq. 7: "
          "the same error)")
    for name, (mean, worst) in replay.summary(rows).items():
        print(f"  {name}: mean |error| {100 * mean:.1f}%, worst {100 * worst:.1f}%")
    return 0


def save_png(path: str, p) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return print("no PNG: matplotlib is missing (pip install -e '.[plot]')")
    parts = {k: v for k, v in p.breakdown.items() if k != "pipeline" and v > 0}
    fig = Figure(figsize=(7, 2.8), layout="constrained")
    ax = fig.subplots()
    left = 0.0
    for name, v in parts.items():
        ax.barh(0, v, left=left, label=name)
        left += v
    ax.set(xlabel="seconds per step", yticks=[],
           title=f"predicted step {p.step_s:.2f} s, MFU {100 * p.mfu:.1f}%")
    fig.legend(ncol=4, fontsize=8, loc="outside lower center")
    fig.savefig(path)
    print(f"breakdown written to {path}")


def main(argv: list[str] | None = None) -> int:
    a, ap = parse_args(argv)
    try:
        if a.replay:
            return show_replay()
        return show_search(a) if a.search else show(a)
    except ValueError as e:
        ap.error(str(e))
