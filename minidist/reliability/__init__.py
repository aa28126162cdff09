"""Reliability: checkpoints, faults, recovery, elasticity, loss spikes and stragglers.

Read in this order: checkpoint.py (the crash-safe, layout-free checkpoint: writer, commit,
finding the newest), checkpoint_format.py (what a checkpoint holds on disk, and the
reader), async_checkpoint.py (snapshot now, write behind: CheckFreq), faults.py
(injecting failures), recovery.py (resuming after one), elastic.py (going on with fewer
ranks), spike.py (loss spikes), straggler.py (slow ranks), then interval.py (how often to
checkpoint: Young/Daly optima, expected efficiency, simulated runs, exponential or Weibull
failures) and its command line, interval_cli.py.
"""
