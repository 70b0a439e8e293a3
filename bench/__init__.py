"""Benchmarks; each headline figure is a ratio against a reference from the same run."""
