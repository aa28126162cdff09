"""Observability: traces, metrics and throughput (the flight recorder is the runtime's:
runtime/flight.py). Nothing here imports the runtime."""
