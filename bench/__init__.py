"""Benchmark commands (DESIGN.md section 5): `python -m bench.run`, `python -m bench.allreduce`."""
