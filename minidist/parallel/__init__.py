"""Parallel layouts (data parallelism, ZeRO, ...), each checked against baseline.py."""
