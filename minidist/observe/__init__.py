"""Observability: traces, metrics and throughput (the flight recorder is the runtime's:
runtime/flight.py). Only run_dir.py imports the runtime: its tracer records the runtime's
calls.

Every multi-rank `python -m minidist train` writes a run directory (`observe/run_dir.py`),
`runs/<UTC time>-<layout>` under `$MINIDIST_RUN_DIR` or `./runs` (`--run-dir none` turns it
off; `--run-dir D` chooses it, and also writes one for a single process): `config.json`
(command, configs, Plan, versions, MFU's inputs), `metrics/rank<r>.jsonl` (one line per step
and rank, flushed as it goes: loss, grad norm, lr, compute / communication wait / other,
bytes per axis, memory), `trace.json` (one Chrome/Perfetto trace merged over ranks: every
autograd op's forward and backward, every collective and send/recv, every pipeline action of
the steps in `--trace-steps`, default 0,1; open it at ui.perfetto.dev) and `summary.json`.
`python -m minidist report RUN_DIR` prints the summary (tokens/s, and MFU by the one
convention of observe/throughput.py, from the model FLOPs per token and the peak that
config.json records) and, with the `plot` extra, draws loss and grad-norm curves, the
step-time breakdown and the memory per rank. It reads the run directory as untrusted input
(`observe/run_files.py`): no link followed, regular files only, at most 16 MiB for
`config.json` or `summary.json` and 256 MiB for the metrics files together or for
`trace.json`; a malformed or planted file is one `error:` line naming the file and line
(exit code 2). A collective that times out now opens its report with one sentence from the
flight recorder, e.g. `rank 2 finished all_reduce #1 on 'tp1' and has made no call since;
ranks 0, 1 are in barrier #3 on 'world'`. The trace hooks cost 0.94 us per op, 0.7 % of a
step (`bench observe`; the write-out after a traced step adds ~2 % of that tiny step).
"""
