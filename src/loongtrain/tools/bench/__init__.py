"""Benchmarks and the demo's shared helpers."""
