"""`python -m bench …`: the benchmarks without the rest of the `vlmcap` command (for a machine that has only
torch and transformers, such as a lent GPU machine)."""

from bench.cli import bench_app

bench_app()
