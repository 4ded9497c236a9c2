"""The kit's benchmarks: bench_*.py scripts run as modules (`python -m bench.bench_x`), bench.lib shared."""
