"""Command line: `python -m minidist run|train|demo|bench ...`.

    python -m minidist run -n 4 script.py [args]     run script.py on 4 ranks
    python -m minidist train [--dp 2 --tp 2 --sp]    train the tiny GPT (the main job;
                             [--zero 1] [--check]    --check: against one process;
                             [--dry-run --world N]   --dry-run: one rank of N, counted)
    python -m minidist demo [name]                   list the demos, or run one
    python -m minidist bench collectives|autograd|train|pipeline|checkpoint|throughput|
                             recompute|observe|offload|determinism|predict|hierarchical|
                             sync|async_tp
                                                     benchmarks (medians, tables)
    python -m minidist memory --model ... --plan dp=2,zero=1 [--measure] [--fit]
                                                     the memory budget per rank
    python -m minidist report RUN_DIR                 a run directory's summary (and plots)
    python -m minidist roofline [--model tiny]        every op of a step on the H200's roofs
                                                      and this CPU's (measured)
    python -m minidist predict --model gpt3-175b --gpus 1024 --tp 8 --pp 16
                                                      a layout's step at scale, predicted
    python -m minidist gpu check [--dry-run]          the GPU path on a GPU (a few minutes;
                                                     exit 3: no GPU, 4: CuPy without CUDA)
    python -m minidist cluster simulate --policy fifo|easy|sjf|fair|las|all [--real]
                                                     a GPU cluster's job scheduler
    python -m minidist interval --checkpoint-cost 30s --restart 2m --mtbf 3h
                                                     how often to checkpoint
    python -m minidist --help | --version            this text | the version
    python -m minidist COMMAND --help                the options of one command

Exit codes: 0 done; 1 a failure (a rank failed, a check found a mismatch); 2 a usage error
(one line on stderr, `error: ...`); 130 interrupted (Ctrl-C); 141 stdout closed by its
reader (`... | head`).
"""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import runpy
import signal
import sys

from minidist.cli import CliParser, at_least

DEMO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demos")
BENCHES = ("collectives", "autograd", "compare", "train", "pipeline", "checkpoint", "throughput",
           "recompute", "observe", "offload", "determinism", "predict", "hierarchical",
           "sync", "async_tp")
INTERRUPTED = 128 + signal.SIGINT           # the shells' code for "ended by SIGINT"
STDOUT_CLOSED = 128 + signal.SIGPIPE        # ... and for "ended by SIGPIPE"


def _error(message: str) -> int:
    """A user error: one line on stderr, `error: ...`; exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def _run(argv: list[str]) -> int:

    def ranks(text: str) -> set[int]:
        try:
            return {int(r) for r in text.split(",")}
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be ranks separated by commas, e.g. 0 or "
                                             f"0,2; got {text!r}") from None
    p = CliParser(prog="python -m minidist run", description=(
        "Run SCRIPT on N ranks, as torchrun does. Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, "
        "LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and "
        "MASTER_PORT=29500 (nothing listens there: the ranks meet in shared memory), and its "
        "output lines arrive tagged [rank<r>]:. SCRIPT calls minidist.init() or "
        "minidist.init_process_group()."))
    p.add_argument("-n", "--nproc-per-node", "--nproc_per_node", "--nproc", dest="nproc",
                   type=at_least(1), default=1, metavar="N",
                   help="number of ranks (default: 1, as torchrun's --nproc-per-node; a "
                        "default of os.cpu_count() would make one command compute different "
                        "things on different machines)")
    p.add_argument("--timeout", type=at_least(1e-3, float), default=None,
                   help="seconds any one collective wait may take (default 60)")
    p.add_argument("--no-prefix", action="store_true",
                   help="print the ranks' lines without the [rank<r>]: tag")
    p.add_argument("--log-dir", "--log_dir", metavar="DIR",
                   help="also write each rank's stdout and stderr lines, untagged, to "
                        "DIR/rank<r>.log (DIR is created if missing)")
    p.add_argument("--local-ranks-filter", "--local_ranks_filter", metavar="R,R,...",
                   type=ranks, default=None,
                   help="show only these ranks' lines (e.g. 0 or 0,2); with --log-dir every "
                        "rank's lines still reach its file")
    p.add_argument("script", help="the Python file every rank runs as __main__")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (all after SCRIPT)")
    a = p.parse_args(argv)
    if not os.path.isfile(a.script):
        p.error(f"no such script: {os.path.abspath(a.script)}")
    outside = sorted(r for r in a.local_ranks_filter or () if not 0 <= r < a.nproc)
    if outside:
        p.error(f"--local-ranks-filter names rank {outside[0]}, but this run has ranks "
                f"0..{a.nproc - 1} (-n {a.nproc})")
    if a.log_dir is not None:
        if os.path.exists(a.log_dir) and not os.path.isdir(a.log_dir):
            p.error(f"--log-dir {a.log_dir} is a file; give a folder (it is created if missing)")
        try:
            os.makedirs(a.log_dir, exist_ok=True)
        except OSError as e:
            p.error(f"--log-dir {a.log_dir}: cannot create it ({e.strerror})")
    from minidist.runtime.launch import run_script
    try:                                 # -n beyond this machine, MINIDIST_* variables
        return run_script(a.nproc, a.script, a.args, collective_timeout=a.timeout,
                          prefix=not a.no_prefix, log_dir=a.log_dir, show=a.local_ranks_filter)
    except ValueError as e:
        return _error(str(e))


def _demos() -> list[str]:
    return sorted(glob.glob(os.path.join(DEMO_DIR, "[0-9][0-9]_*.py")))


def _demo(argv: list[str]) -> int:
    demos = _demos()
    if not demos:
        return _error(f"no demos found in {DEMO_DIR}: they live in the source checkout; "
                      "install it with `pip install -e .` from a clone, or run "
                      "`python demos/NN_name.py` there.")
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m minidist demo [NAME [args]]   NAME: 07, zero or 07_zero")
        print("demos:")
        for path in demos:
            print("  ", os.path.basename(path)[:-3])
        return 0
    name, rest = argv[0], argv[1:]
    match = [d for d in demos if os.path.basename(d)[:-3] == name
             or os.path.basename(d)[3:-3] == name or os.path.basename(d)[:2] == name]
    if not match:
        return _error(f"no demo named {name!r}; run `python -m minidist demo` for the list")
    sys.argv = [match[0], *rest]
    try:
        runpy.run_path(match[0], run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0


def _bench(argv: list[str]) -> int:
    usage = f"python -m minidist bench {{{','.join(BENCHES)}}} [options]"
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: {usage}")
        return 0
    if not argv or argv[0] not in BENCHES:
        got = f"got {argv[0]!r}" if argv else "got none"
        return _error(f"bench needs one of {', '.join(BENCHES)} ({got}); usage: {usage}")
    module = importlib.import_module(f"minidist.bench.{argv[0]}")
    return module.main(argv[1:]) or 0


def _memory(argv: list[str]) -> int:
    from minidist.memory.budget_cli import main as memory_main
    return memory_main(argv) or 0


def _cluster(argv: list[str]) -> int:
    from minidist.cluster.cli import main as cluster_main
    return cluster_main(argv) or 0


def _interval(argv: list[str]) -> int:
    from minidist.reliability.interval_cli import main as interval_main
    return interval_main(argv) or 0


def _report(argv: list[str]) -> int:
    from minidist.observe.report import main as report_main
    return report_main(argv) or 0


def _roofline(argv: list[str]) -> int:
    from minidist.hardware.roofline_cli import main as roofline_main
    return roofline_main(argv) or 0


def _predict(argv: list[str]) -> int:
    from minidist.hardware.predict_cli import main as predict_main
    return predict_main(argv) or 0


def _gpu(argv: list[str]) -> int:
    """`gpu check`: imports nothing of the runtime (the GPU machine may lack multiprocess)."""
    if not argv or argv[0] != "check":
        return _error("usage: python -m minidist gpu check [--parts kernels,fusion,...]")
    from minidist.gpu.check import main as check_main
    return check_main(argv[1:]) or 0


def _train(argv: list[str]) -> int:
    from minidist import train_cli
    return train_cli.main(argv) or 0


COMMANDS = {"run": _run, "train": _train, "demo": _demo, "bench": _bench, "memory": _memory,
            "cluster": _cluster, "report": _report, "roofline": _roofline, "gpu": _gpu,
            "interval": _interval, "predict": _predict}


def main(argv: list[str] | None = None) -> int:
    """The exit code of `python -m minidist ARGV` (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv[0] == "--version":
        from minidist import __version__
        print(f"minidist {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        what = "option" if argv[0].startswith("-") else "command"
        return _error(f"unknown {what} {argv[0]!r}; the commands are {', '.join(COMMANDS)} "
                      f"(python -m minidist {'|'.join(COMMANDS)} ...; --help for more)")
    if argv[0] == "gpu":              # before the runtime's import: see _gpu
        return _gpu(argv[1:])
    from minidist.runtime.process_setup import setup_rank_process
    setup_rank_process()              # one BLAS thread, reuse of freed memory: as every rank
    try:
        return COMMANDS[argv[0]](argv[1:])
    except KeyboardInterrupt:         # Ctrl-C: spawn has already killed and reaped the ranks
        return INTERRUPTED
    except BrokenPipeError:           # the reader of stdout left: end as `yes | head` does,
        null = os.open(os.devnull, os.O_WRONLY)     # with nothing more to say; what is
        os.dup2(null, sys.stdout.fileno())          # still buffered goes to /dev/null, not
        os.close(null)                              # into a second error at exit
        return STDOUT_CLOSED


if __name__ == "__main__":
    raise SystemExit(main())
