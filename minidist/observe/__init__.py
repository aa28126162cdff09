"""Observability: the flight recorder, traces, metrics and throughput."""
