"""Benchmarks: side-by-side runs in one invocation, reported as ratios and percentiles (`vlmcap bench`)."""
