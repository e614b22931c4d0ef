"""Benchmark commands (bench/README.md): `python -m bench.run`, `python -m bench.allreduce`, ..."""
