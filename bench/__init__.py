"""Benchmarks: commands run on a quiet machine, not tests (bench/README.md).

Commands, one module each at this level: run.py (`python -m bench.run`), allreduce.py,
data.py, snapshot.py, snapshot_async.py, cp_balance.py. report.py is the results writer they all share.
run_engine/ is bench.run's engine, used by no other command.

Imports: a command may import bench.report and the project's modules; only run.py
imports bench.run_engine; no command imports another; report.py imports nothing of
the project.
"""
