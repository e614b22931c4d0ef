"""Pictures of a run (mode=plot): PNGs of its run directory's metrics.jsonl,
pipeline_timeline.json and the per-rank figures, and one HTML page showing them, in
<run_dir>/plots/. series.py says what each chart plots (no matplotlib: the tests compare
it with metrics.jsonl), draw.py draws it, page.py writes the page."""
