"""Command line: `python -m minidist run|train|demo|bench ...`.

    python -m minidist run -n 4 script.py [args]     run script.py on 4 ranks
    python -m minidist train [--dp 2 --tp 2 --sp]    train the tiny GPT (the main job;
                             [--zero 1] [--check]    --check: against one process)
    python -m minidist demo [name]                   list the demos, or run one
    python -m minidist bench collectives|autograd|train|pipeline   benchmarks (medians, tables)
"""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import runpy
import sys

DEMO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demos")
BENCHES = ("collectives", "autograd", "train", "pipeline")


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m minidist run",
                                description="Run SCRIPT on N ranks; it calls minidist.init().")
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds any one collective wait may take (default 60)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.nproc < 1:
        p.error(f"-n must be >= 1, got {a.nproc}")
    from minidist.runtime.launch import run_script
    return run_script(a.nproc, a.script, a.args, collective_timeout=a.timeout)


def _demos() -> list[str]:
    return sorted(glob.glob(os.path.join(DEMO_DIR, "[0-9][0-9]_*.py")))


def _demo(argv: list[str]) -> int:
    demos = _demos()
    if not demos:
        print(f"no demos found in {DEMO_DIR}: they live in the source checkout; install it "
              "with `pip install -e .` from a clone, or run `python demos/NN_name.py` there.",
              file=sys.stderr)
        return 2
    if not argv:
        print("demos (python -m minidist demo NAME [args]):")
        for path in demos:
            print("  ", os.path.basename(path)[:-3])
        return 0
    name, rest = argv[0], argv[1:]
    match = [d for d in demos if os.path.basename(d)[:-3] == name
             or os.path.basename(d)[3:-3] == name or os.path.basename(d)[:2] == name]
    if not match:
        print(f"no demo named {name!r}; run `python -m minidist demo` for the list",
              file=sys.stderr)
        return 2
    sys.argv = [match[0], *rest]
    try:
        runpy.run_path(match[0], run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: python -m minidist bench {{{','.join(BENCHES)}}} [options]",
              file=sys.stderr)
        return 2
    module = importlib.import_module(f"minidist.bench.{argv[0]}")
    return module.main(argv[1:]) or 0


def _train(argv: list[str]) -> int:
    from minidist import train
    return train.main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from minidist.runtime.rank_env import setup_rank_process
    setup_rank_process()              # one BLAS thread, reuse of freed memory: as every rank
    commands = {"run": _run, "demo": _demo, "bench": _bench, "train": _train}
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
