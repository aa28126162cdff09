"""Reliability: checkpoints, faults, recovery, elasticity, loss spikes and stragglers.

A checkpoint (`reliability/checkpoint.py`) holds the run's GLOBAL state: the full
parameters in the single-process order, the optimizer's `state_dict()`, the step, the losses
so far, the data cursor and the run's configuration (RNG streams are stateless here: dropout
is drawn from (seed, step, sample index)). With W ranks every array is flattened and cut
into W pieces; rank r writes piece r of every array into
`stepNNNNNNNN/rankRRRRR.safetensors` (a plain safetensors file), rank 0 writes
`manifest.json` (every tensor's shape, dtype and pieces, the sha256 of every piece and file,
a checksum of itself) and then replaces `D/latest`, the commit point. Every file is written
under a temporary name and fsynced before the rename that publishes it, so a crash at any
moment leaves the previous checkpoint current. `--keep K` keeps the newest K. Loading checks
every byte against the manifest, never unpickles (a planted pickle or any unexpected file is
refused by name), and falls back to the previous complete checkpoint when a file is missing,
truncated or corrupt, or its load fails in any other way, saying which file and which check
in one line.

A checkpoint directory is treated as input someone else may have written into
(`reliability/confined.py`): nothing below it is reached through a symbolic link (every file
is opened relative to its directory's descriptor with `O_NOFOLLOW`; a linked `latest`, step
directory, manifest or rank file is refused, never followed out), only regular files are
read (a FIFO or `/dev/zero` is refused at once), every read is bounded by `fstat` before a
byte is read, and every shape, dtype and byte count in the manifest is checked against the
files' headers and sizes before an array is allocated (a shape of [2^40] is refused, not
attempted). A save creates its files exclusively, under `.tmp-stepN-<token>` with a random
token the launcher draws for each attempt (nothing can be planted there in advance);
cleaning up unlinks stale `.tmp-*` names themselves, never what they point at; permissions
are what your umask gives. A save that fails for a reason a restart cannot fix (disk full,
permissions, a planted link) says so in one line, removes its temporary directory at once,
and `--max-restarts` does not retry it. A `--checkpoint-dir` that is a file or cannot be
made is refused before any rank starts. `--async-checkpoint` snapshots the arrays at the
step boundary and writes them in a background thread while training goes on (CheckFreq); the
checkpoint commits at the next snapshot or at the end.

Because the checkpoint is layout-free, ANY layout loads it: every engine has
`load_full_state(params, optimizer_state)`, the inverse of `full_params()` and
`full_optimizer_state()`, which cuts this rank's pieces (tp shards, pipeline stage, experts,
ZeRO flat shards) without communication. Resumed under the same Plan, a run is bitwise the
uninterrupted one; under another Plan it continues within 1e-12 (float64) of it, the
difference being the layouts' own order of additions.

Started again with the same `--checkpoint-dir`, a run resumes from the latest complete
checkpoint (`--resume never` refuses a folder that holds one); a checkpoint of another run
(model, data, seed, batch, lr, optimizer, steps) is refused, naming the fields that differ
(`lr 0.003 vs 0.01`). The state of the run's stateful hooks (the spike detector's
statistics, the straggler handler's streaks and rows) is in every checkpoint too, so a
resumed run judges its next steps exactly as the uninterrupted one would. `--max-restarts K`
supervises the job (`reliability/recovery.py`): on a RankFailure (a rank raised, died, or
hung past the deadline) the launcher logs what failed, waits a backoff (0.5 s, doubling),
and starts all ranks again from the latest checkpoint, saying which steps are lost and run
again. Every run ends with `params sha256: <hex>` over the full parameters in name order: an
interrupted and recovered run prints the same digest as the uninterrupted one.

`--elastic` (`reliability/elastic.py`) is for a rank that does not come back: after a
failure the job goes on with one data-parallel replica less, from the latest checkpoint,
keeping the global batch (each replica takes B/(dp-1) rows); `--rejoin-after N` brings the
capacity back after N steps (the smaller job checkpoints there and the full layout
continues). Only the grouping of the gradient sum changes, so the run equals the reference
within rounding (tested within 1e-12 in float64 for dp 4 -> 3 -> 4, not bitwise). A smaller
layout that cannot take the batch (B not divisible by dp-1 x micro-batches) is refused and
the job restarts at full size, saying why.

`--spike detect|skip|rollback|rerun` (`reliability/spike.py`) watches each step's global
loss and gradient norm: a value that is not finite, or, after 10 warm-up steps, above its
running mean + 6 sigma (exponential averages over ~20 steps, sigma at least 2 % of the mean)
is a spike. `skip` leaves that update out (gradients zeroed, parameters and optimizer
untouched); `rollback` restarts from the latest checkpoint and skips `--spike-skip-batches
N` batches (PaLM: step s then trains on batch s + N); `rerun` computes the step again on the
same batch, applies it if the rerun is normal (a transient fault: an injected NaN then
leaves the run bitwise equal to a clean one) and skips it if it spikes again (bad data), as
Megatron's re-run machine does. Every rank sees the same global loss and norm, so all decide
alike with no extra message.

How often to checkpoint: `python -m minidist interval --checkpoint-cost 30s --restart 2m
--mtbf 3h [--plot out.png]` (or `--llama3 --gpus 1024` in place of `--mtbf`) prints Young's optimum sqrt(2CM), Daly's
higher-order one, the exact optimum of the expected-efficiency model (exponential failures:
E[segment] = M e^(R/M) (e^((T+C)/M) - 1)) and a table of interval -> analytic and simulated
efficiency (Monte Carlo, 95 % CI); `--llama3` scales Llama 3's 466 interruptions in 54 days
on 16k GPUs to the job's GPU count. `--weibull-shape K` simulates failures that are not
memoryless (gaps Weibull of shape K with the same mean, a renewal process; field data fit K
< 1, Schroeder and Gibson 2006); the simulation of a single segment matches the renewal
closed form within its CI (tested for K = 0.5, 0.7, 1.5).

Faults to test this with (`reliability/faults.py`; `--inject` may repeat, and scripts read
`MINIDIST_INJECT="spec;spec"`): `kind:rank=R:step=S[:point=P][:attempt=A]
[:seconds=X][:per_row=Y][:phase=NAME]` with kind `raise`, `exit`, `sigkill`, `sigstop` (a
hang), `sleep` (a slow rank), `slow` (every step from S: X seconds plus Y per row), `nan`
(the rank's gradients of that step are NaN), `corrupt` (its batch is replaced by random
tokens); point `start` or `end` of the step, or `save`: inside the checkpoint save after
that step, at one of its eleven phases (default `rank_file_partial`: the rank's file half
written). A fault fires on attempt 0 only (`attempt=A` to change that), so the restarted run
gets past it.

Tested: a crash at each of the eleven phases of a save leaves a loadable checkpoint equal to
what was saved; every layout of up to 4 ranks loads every other's state; 100 random kills
(`raise`, `exit`, `sigkill` at the start or end of a step or inside a save, over seven
layouts, `-m slow`) all end with the uninterrupted run's digest, and so do 60 random trials
over fifteen layouts (ZeRO 0-3, tp with and without sp, every pipeline schedule, cp ring and
Ulysses, ep, dp x tp) with random stateful options (spike handling, straggler detection,
async checkpoints, `--keep 1`) and faults (hangs included), a rank killed by another
process, and the launcher SIGKILLed and its command run again. A hostile-directory suite
(`tests/reliability/test_checkpoint_hostile.py`: links at every level, pointer tricks, huge
shapes and sparse files, devices, FIFOs, deep nesting, a full disk) checks that nothing
outside the directory is read or written and memory stays bounded. Faults inside a save
(`point=save`) fire in the synchronous save's phases, so they are refused with
`--async-checkpoint`.

`--straggler detect|rebalance` (`reliability/straggler.py`) is for a rank that is slow
rather than dead. After every step the ranks all-gather their timings over the world group
(4 float64 each: dp coordinate, compute = forward + backward, wait for the gradient sync,
step; outside the per-step byte counts). The rule: a rank whose compute exceeds 1.5x the
median of the others' for 3 consecutive steps is a straggler, and rank 0 prints `straggler:
rank 1 computes 2.1x the median for 3 steps (compute 50 ms vs 24 ms)`. Compute, not wall
time: a fast rank's wall time includes waiting for the slow one (under ZeRO-2/3, which wait
inside the backward, the engine times those waits and they count as communication, not
compute). `rebalance` also moves rows of the global batch between dp replicas: every 5 steps
each replica is offered rows in proportion to its measured rows per second (at least one per
micro-batch), applied only if that predicts a step at least 10 % faster; every rank computes
the same partition from the same table, and the tp, cp and pp ranks of a replica share its
rows. The loss is divided by the global token count, so the run equals the even split within
rounding (tested within 1e-12 in float64 on dp, ZeRO-1, dp x tp and dp x pp; not bitwise);
MoE models keep the even split. The test fault is `--inject slow:rank=R:step=S:seconds=X` (X
seconds as the rank's forward begins, at every step from S on: a fixed delay) or
`...:per_row=Y` (Y seconds per row of the rank's step: a slow device, whose delay shrinks
with its rows). Measured on a 2-core machine shared with other jobs (`python -m minidist
train --dp 2 --steps 200 --batch 128 --n-layer 4 --n-embd 64 --every 20 --inject
slow:rank=1:step=2:seconds=X --straggler detect|rebalance`, or `per_row=Y`; ms per step over
steps 21-199, median of 3 interleaved runs; tokens/s = 128 x 12 / that):

    fault          no fault   detect                     rebalance
    seconds=0.025  30.7 ms    54.2 ms (28.3k tokens/s)   43.6 ms (35.2k tokens/s)
        rows (97..101, 27..31) by step 30; recovers 45 % of the loss, 1.24x
    seconds=0.05   27.4 ms    78.2 ms (19.6k tokens/s)   58.1 ms (26.4k tokens/s)
        rows (126, 2) by step 200; recovers 40 % of the loss, 1.35x
    per_row=0.001  31.3 ms    93.9 ms (16.4k tokens/s)   46.9 ms (32.7k tokens/s)
        rows (101..105, 23..27) by step 200; recovers 75 % of the loss, 2.0x

A slow device (per_row: rank 1 about 3.6x slower per row) is what rebalancing wins back: the
best split puts about 104 of 128 rows on the fast rank, and the measured rows end there.

A fixed delay cannot be balanced away: with compute c per row (about 0.38 ms here), the best
step is max((X + cB)/2, X) plus what the step spends outside compute (3-7 ms in the no-fault
runs), 40-43 and 54-57 ms here, which the rebalanced runs come near. The rows move in
several smaller steps, the prediction taking compute as proportional to rows, which a fixed
delay is not. An earlier round on a busier machine measured 67.6 ms (detect) and 44.1 ms
(rebalance) for X = 0.025 s; there a rank slowed by the other jobs is named, and gets rows
taken away, as well.

Read in this order: checkpoint.py (the crash-safe, layout-free checkpoint: writer, commit,
finding the newest), checkpoint_format.py (what a checkpoint holds on disk, and the
reader), async_checkpoint.py (snapshot now, write behind: CheckFreq), faults.py
(injecting failures), recovery.py (resuming after one), elastic.py (going on with fewer
ranks), spike.py (loss spikes), straggler.py (slow ranks), then interval.py (how often to
checkpoint: Young/Daly optima, expected efficiency, simulated runs, exponential or Weibull
failures) and its command line, interval_cli.py.
"""
