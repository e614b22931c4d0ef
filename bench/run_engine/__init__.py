"""The engine of `python -m bench.run` (bench/run.py is the command): variants.py what
it runs, jobs.py one training job, stats.py from logged steps to a summary, tables.py
and charts.py that summary as results.md and charts.

Imported by bench/run.py and the tests only. May import bench.report and the
project's modules (config, model, parallel, ...), never a bench command.
"""
