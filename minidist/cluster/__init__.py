"""Cluster: scheduling many training jobs on one shared GPU cluster.

`python -m minidist cluster simulate --policy fifo|easy|sjf|fair|las|all [--trace
synthetic:N|file.csv] [--nodes 8 --gpus-per-node 8] [--plot DIR] [--real]` (`cluster/`): a
discrete-event simulator with gang placement (a job of up to G GPUs on one node, bigger ones
on whole nodes), FIFO, EASY backfilling (backfill only what does not delay the head job's
reservation, from user estimates), shortest-job-first, fair share between users, and
Tiresias-style discretised least attained service with preemption that pays a checkpoint and
a restore. Reports: average and p99 completion time and queueing delay, utilisation, Jain's
fairness over users' mean slowdown, preemptions; an audit re-checks every hold (exact work,
C + R per preemption, exact gangs, node capacity). Synthetic traces follow Gavel's
Philly-derived sampler (GPUs 1/2/4/8 with probability 0.70/0.10/0.15/0.05; run time 10^x
minutes, x ~ U(1.5, 3) with probability 0.8, else U(3, 4)), a parametric fit stated as such.
`--real` runs small `minidist train` jobs as processes under the policy on this machine's
slots, preempting after a committed checkpoint and resuming from it; every job's `params
sha256` equals its uninterrupted run. Demo 26 (300 jobs, 8 x 8 GPUs, load 1.2): average
completion 35.4 h under FIFO, 21.3 h under EASY, 20.7 h under LAS (284 preemptions), short
jobs 19.7 h -> 1.1 h.

Read in this order: placement.py (gang placement on nodes of G GPUs), traces.py (job
traces: Philly-like synthetic ones, or a CSV/JSON file), policies.py (FIFO, EASY
backfilling, SJF, fair share, Tiresias' LAS with preemption), scheduler.py (the
discrete-event simulator), metrics.py (completion time, queueing delay, utilisation,
fairness; plots), real.py (the same policies running real `minidist train` processes,
preempted by checkpoint and resumed), cli.py (`python -m minidist cluster simulate`).
"""
