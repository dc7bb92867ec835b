"""`python -m bench …`: the benchmarks without the rest of the `vlmcap` command (for a machine that has only
torch and transformers, such as a lent GPU machine)."""

from cli.bench import bench_app

bench_app()
