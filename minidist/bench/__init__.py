"""Benchmarks run by `python -m minidist bench collectives|autograd|train`, printed as tables."""
