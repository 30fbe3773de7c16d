"""Micro-benchmarks that print numbers (``python -m kvgate.bench.micro.<name>``)."""
