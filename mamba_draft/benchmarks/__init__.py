"""Benchmarks and the end-to-end demo: `mamba-draft demo`, `mamba-draft bench`, `mamba-draft bench-drafters`."""
