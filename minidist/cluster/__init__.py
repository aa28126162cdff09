"""Cluster: scheduling many training jobs on one shared GPU cluster.

Read in this order: placement.py (gang placement on nodes of G GPUs), traces.py (job
traces: Philly-like synthetic ones, or a CSV/JSON file), policies.py (FIFO, EASY
backfilling, SJF, fair share, Tiresias' LAS with preemption), scheduler.py (the
discrete-event simulator), metrics.py (completion time, queueing delay, utilisation,
fairness; plots), real.py (the same policies running real `minidist train` processes,
preempted by checkpoint and resumed), cli.py (`python -m minidist cluster simulate`).
"""
