"""Reliability: checkpoints, faults and recovery.

Read in this order: checkpoint.py (the crash-safe, layout-free checkpoint: writer, commit,
finding the newest), then checkpoint_format.py (what a checkpoint holds on disk, and the
reader), then faults.py (injecting failures), recovery.py (resuming after one) and
elastic.py (going on with fewer ranks), spike.py (loss spikes), then interval.py (how
often to checkpoint: Young/Daly optima, expected efficiency, simulated runs).
"""
