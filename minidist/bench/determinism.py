"""Benchmark: what the deterministic mode costs in step time, against the normal mode.

The deterministic mode (minidist/deterministic/, train.py --deterministic) trains
bitwise the same parameters under every layout it covers and in one process: each
micro-batch is one grain of G rows, and the grains' gradients are added in one fixed tree
over the global batch. It pays for this with smaller matmuls (G rows instead of B/dp),
one backward per grain, and an all-gather of the tree's nodes on top of the usual
reduction. This bench measures that price and checks the promise at the same time.

Per layout (--layouts, default dp=2,tp=2) it runs minidist.train.train_on_rank on
plan.world_size spawned ranks: the normal mode (deterministic=False, micro_batches=1:
each dp rank's B/dp rows in one micro-batch) and the deterministic mode once per grain
(--grains, default 1,max; "max" = B/dp, one grain per dp rank: the normal mode's own
micro-batch, so that row's extra cost is the tree, its all-gather and the hand-over of
the root alone). The runs are interleaved (normal, grain 1, grain max, next layout, ...,
then the next repeat) so that the machine's load hits all alike.

    step ms    per run: each step's time on its slowest rank, median over --steps
               measured steps after --warmup; the row shows the median over --repeats
               runs (not the best: the typical run, load included)
    ratio      step ms / step ms of the same layout's normal row
    sha256     the first 12 hex digits of minidist.deterministic.digest.params_digest of the final
               parameters (rank 0's gathered copy; "ranks differ" if the ranks' copies
               disagree, "varies" if the repeats' do)
    refused    a layout the deterministic mode does not cover yet: the ValueError that
               deterministic.check raised inside train_on_rank, taken from the RankFailure

Then, per grain, the single process's deterministic run (baseline.train_single_process,
deterministic=True, the same warm-up + measured steps, lr and seed) and one line:
OK if every layout that ran that grain ended with its digest, MISMATCH otherwise.
Exit code 1 on any MISMATCH (the promise is exact, on any machine); the time target is
printed, not enforced (it depends on the machine).

Target (issue: "Deterministic mode's cost: measured and printed against the normal mode
for dp=2 and tp=2 on the bench model"): deterministic step time <= 1.5x the normal mode's.

Default model: the tensor-parallel bench model of bench/train.py (4 layers, C = 256,
H = 4, T = 128, float32), global batch 8, AdamW lr 1e-3. BLAS: one thread per rank.

Run:  python -m minidist bench determinism [--layouts dp=2,tp=2] [--grains 1,max]
      [--repeats 3] [--steps 3] [--warmup 1] [--batch 8] [--n-layer 4] [--n-embd 256]
      [--n-head 4] [--length 64] [--dtype float32] [--token-tiles N]  (about a minute)
      A layout is a Plan: key=value items joined by ':', e.g. dp=2:zero=1, pp=2,
      pp=2:schedule=gpipe, dp=2:tp=2 (keys: see LAYOUT_KEYS).
Read next: deterministic/__init__.py (the mode's map), deterministic/step.py
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")          # effective only if NumPy is not imported yet

import argparse                                # noqa: E402
import re                                      # noqa: E402
import shlex                                   # noqa: E402
import statistics                              # noqa: E402
import sys                                     # noqa: E402
from dataclasses import dataclass, field       # noqa: E402

from minidist.baseline import train_single_process  # noqa: E402
from minidist.cli import CliParser, at_least   # noqa: E402
from minidist.data import DataConfig, model_config_for  # noqa: E402
from minidist.deterministic.digest import params_digest  # noqa: E402
from minidist.nn import GPT                    # noqa: E402
from minidist.runtime.errors import RankFailure  # noqa: E402
from minidist.runtime.launch import spawn      # noqa: E402
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank  # noqa: E402

TARGET = 1.5                    # the bound on deterministic / normal step time
LR = 1e-3
DIGITS = 12                     # hex digits of the sha256 shown
LAYOUT_KEYS = {"dp": ("dp", int), "tp": ("tp", int), "pp": ("pp", int), "cp": ("cp", int),
               "ep": ("ep", int), "zero": ("zero", int), "schedule": ("schedule", str),
               "v": ("virtual_stages", int), "cp_algo": ("cp_algo", str),
               "sp": ("sequence_parallel", bool)}
_CHECK_FRAME = re.compile(r'deterministic/step\.py", line \d+, in check\b')


@dataclass
class Row:
    """One (layout, mode) of the table; grain None is the normal mode."""

    layout: str
    plan: Plan
    grain: int | None
    steps_s: list[float] = field(default_factory=list)    # one per repeat
    digests: set[str] = field(default_factory=set)
    refused: str | None = None

    @property
    def mode(self) -> str:
        return "normal" if self.grain is None else f"det grain={self.grain}"

    @property
    def step(self) -> float:
        return statistics.median(self.steps_s)

    @property
    def digest(self) -> str:
        return next(iter(self.digests)) if len(self.digests) == 1 else "varies"


def parse_layout(text: str) -> Plan:
    """'dp=2:zero=1' -> Plan(dp=2, zero=1, check_placements=False); ValueError if not."""
    fields = {}
    for item in text.split(":"):
        key, eq, value = (s.strip() for s in item.partition("="))
        if key.replace("-", "_") not in LAYOUT_KEYS or not eq or not value:
            raise ValueError(f"--layouts: {item!r} in {text!r} is not key=value with a key "
                             f"in {', '.join(LAYOUT_KEYS)}; join items with ':', e.g. "
                             f"dp=2:zero=1.")
        name, kind = LAYOUT_KEYS[key.replace("-", "_")]
        try:
            fields[name] = value in ("1", "true", "on") if kind is bool else kind(value)
        except ValueError:
            raise ValueError(f"--layouts: {key}={value!r} in {text!r} must be an int.") \
                from None
    return Plan(check_placements=False, **fields)      # placement digests would be traffic


def parse_grains(text: str) -> list[int | str]:
    """'1,max' -> [1, 'max'] (argparse type)."""
    out: list[int | str] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        if item != "max" and not (item.isdigit() and int(item) >= 1):
            raise argparse.ArgumentTypeError(f"{item!r} is neither an int >= 1 nor 'max' "
                                             f"(= B/dp, one grain per dp rank); e.g. 1,2,max")
        out.append(item if item == "max" else int(item))
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r} names no grain; e.g. 1,max")
    return out


def _on_rank(ctx, cfg, data_cfg, plan: Plan, steps: int, batch: int, grain: int | None,
             token_tiles: int | None):
    r = train_on_rank(ctx, cfg, data_cfg, plan,
                      RunConfig(steps=steps, global_batch=batch, deterministic=grain is not None,
                                grain=grain or 1,
                                token_tiles=token_tiles if grain is not None else None),
                      OptimizerConfig(lr=LR))
    return r.timing["step"], params_digest(r.params)


def refusal(e: RankFailure) -> str | None:
    """The one-line message if `e` is the deterministic mode refusing the layout (a
    ValueError from deterministic/step.check on some rank), else None."""
    for text in [e.failures.get(e.rank, "")] + list(e.failures.values()):
        if not text.startswith("ValueError: "):
            continue
        message = text[len("ValueError: "):].splitlines()[0].strip()
        if message.startswith(("--deterministic", "--grain", "--token-tiles")) or \
                _CHECK_FRAME.search(str(e)):
            return message
    return None


def measure(cfg, data_cfg, plan: Plan, grain: int | None, steps: int, warmup: int,
            batch: int, token_tiles: int | None = None) -> tuple[float, str]:
    """(median over the measured steps of the slowest rank's step time, digest) of one run
    of warmup + steps steps. Raises RankFailure as spawn does (a refusal included)."""
    runs = spawn(plan.world_size, _on_rank, cfg, data_cfg, plan, warmup + steps, batch, grain,
                 token_tiles)
    keep = slice(warmup, warmup + steps)
    slowest = [max(t) for t in zip(*(times[keep] for times, _ in runs))]
    digests = {d for _, d in runs}
    return statistics.median(slowest), \
        runs[0][1][:DIGITS] if len(digests) == 1 else "ranks differ"


def run_rows(rows: list[Row], cfg, data_cfg, a: argparse.Namespace) -> None:
    """Fill rows in place: `a.repeats` rounds over all rows, interleaved; a refused row is
    not retried (the refusal depends on the layout only)."""
    for _ in range(a.repeats):
        for row in rows:
            if row.refused is not None:
                continue
            try:
                step, digest = measure(cfg, data_cfg, row.plan, row.grain, a.steps,
                                       a.warmup, a.batch, a.token_tiles)
            except RankFailure as e:
                row.refused = refusal(e) if row.grain is not None else None
                if row.refused is None:
                    raise
                continue
            row.steps_s.append(step)
            row.digests.add(digest)


def render(rows: list[Row]) -> str:
    width = max(len("layout"), *(len(r.layout) for r in rows)) + 2
    lines = [f"{'layout':<{width}}{'mode':<15}{'step ms':>9}{'ratio':>8}  params sha256"]
    normal = {r.layout: r.step for r in rows if r.grain is None}
    for r in rows:
        head = f"{r.layout:<{width}}{r.mode:<15}"
        if r.refused is not None:
            lines.append(f"{head}refused: {r.refused}")
            continue
        lines.append(f"{head}{r.step * 1e3:>9.2f}{r.step / normal[r.layout]:>7.2f}x  "
                     f"{r.digest}")
    return "\n".join(lines)


def verdicts(rows: list[Row], cfg, data_cfg, a: argparse.Namespace) -> list[str]:
    """One OK / MISMATCH line per grain that some layout ran, against the single process."""
    lines = []
    grains = sorted({r.grain for r in rows if r.grain is not None})
    for g in grains:
        ran = [r for r in rows if r.grain == g and r.refused is None]
        if not ran:
            lines.append(f"--: grain {g}: every layout refused it; nothing to compare")
            continue
        ref = params_digest(train_single_process(
            cfg, data_cfg, steps=a.warmup + a.steps, global_batch=a.batch, lr=LR,
            deterministic=True, grain=g, token_tiles=a.token_tiles).params)[:DIGITS]
        names = ", ".join(r.layout for r in ran)
        if all(r.digest == ref for r in ran):
            lines.append(f"OK: grain {g}: {names} end bitwise equal to the single process "
                         f"(sha256 {ref})")
        else:
            got = "; ".join(f"{r.layout} {r.digest}" for r in ran)
            lines.append(f"MISMATCH: grain {g}: single process {ref}; {got}")
    return lines


def target_line(rows: list[Row]) -> str:
    normal = {r.layout: r.step for r in rows if r.grain is None}
    met, missed, refused = [], [], []
    for r in rows:
        if r.grain is None:
            continue
        if r.refused is not None:
            refused.append(f"{r.layout} grain={r.grain}")
            continue
        ratio = r.step / normal[r.layout]
        (met if ratio <= TARGET else missed).append(f"{r.layout} grain={r.grain} "
                                                    f"({ratio:.2f}x)")
    parts = [f"met by {', '.join(met) or 'none'}", f"missed by {', '.join(missed) or 'none'}"]
    if refused:
        parts.append(f"not measured (refused): {', '.join(refused)}")
    return f"target: deterministic step time <= {TARGET}x the normal mode's; " + \
        "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist bench determinism`: step time of the deterministic mode against
    the normal mode per layout and grain; the digests checked against one process."""
    p = CliParser(prog="python -m minidist bench determinism", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="dp=2,tp=2",
                   help="comma list of Plans, items joined by ':' (default dp=2,tp=2)")
    p.add_argument("--grains", type=parse_grains, default=parse_grains("1,max"),
                   help="comma list of ints or 'max' (= B/dp) (default 1,max)")
    p.add_argument("--repeats", type=at_least(1), default=3,
                   help="interleaved runs; the median kept (default 3)")
    p.add_argument("--steps", type=at_least(1), default=3, help="measured steps (default 3)")
    p.add_argument("--warmup", type=at_least(0), default=1, help="warm-up steps (default 1)")
    p.add_argument("--batch", type=at_least(1), default=8, help="global batch (default 8)")
    p.add_argument("--n-layer", type=at_least(1), default=4)
    p.add_argument("--n-embd", type=at_least(1), default=256)
    p.add_argument("--n-head", type=at_least(1), default=4)
    p.add_argument("--length", type=at_least(1), default=64,
                   help="sort task's prompt length, T = 2 x length (default 64)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--token-tiles", type=at_least(1), default=None,
                   help="the deterministic runs' --token-tiles (context parallelism needs "
                        "it, e.g. --layouts cp=2 --token-tiles 8)")
    a = p.parse_args(argv)
    data_cfg = DataConfig(task="sort", length=a.length)
    cfg = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head,
                           dtype=a.dtype)
    rows: list[Row] = []
    for spec in filter(None, (s.strip() for s in a.layouts.split(","))):
        try:
            plan = parse_layout(spec)
            plan.validate(cfg, a.batch, cfg.block_size)
        except ValueError as e:
            p.error(f"layout {spec!r}: {e}")
        grains = [a.batch // plan.dp if g == "max" else g for g in a.grains]
        rows.append(Row(spec, plan, None))
        rows += [Row(spec, plan, g) for g in dict.fromkeys(grains)]     # unique, in order
    if not rows:
        p.error(f"--layouts {a.layouts!r} names no layout; e.g. dp=2,tp=2")
    command = sys.argv[1:] if argv is None else argv
    print(("$ python -m minidist bench determinism " + shlex.join(command)).rstrip())
    print(f"GPT {cfg.n_layer} layers, C={cfg.n_embd}, H={cfg.n_head}, T={cfg.block_size}, "
          f"Ψ={GPT(cfg).num_parameters():,} params, {cfg.dtype}; global batch {a.batch}, "
          f"AdamW lr {LR:g}; step = slowest rank, median over {a.steps} steps after "
          f"{a.warmup} warm-up; median of {a.repeats} interleaved runs; "
          f"{os.cpu_count()} CPU cores")
    print("normal: one micro-batch of B/dp rows per dp rank; det grain=G: B/(dp G) "
          "micro-batches of G rows per dp rank, added in the fixed tree"
          + ("" if a.token_tiles is None else
             f"; sums over positions in {a.token_tiles} runs per sequence (--token-tiles)"))
    run_rows(rows, cfg, data_cfg, a)
    print(render(rows))
    print(target_line(rows))
    lines = verdicts(rows, cfg, data_cfg, a)
    print("\n".join(lines))
    return 1 if any(line.startswith("MISMATCH") for line in lines) else 0


if __name__ == "__main__":
    raise SystemExit(main())
