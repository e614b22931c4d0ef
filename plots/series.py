"""What each chart of a run plots, read from its run directory: (step, value) series of
metrics.jsonl's fields, one chart per topic, and only the charts whose fields the run has
(a pipeline's bubble only under pp, the expert load only for a mixture of experts)."""

import json
import os
import re

from errors import UserError

# (file name, title, y label, the fields it plots: exact names or patterns of metrics.jsonl)
CHARTS = [
    ("loss.png", "training and validation loss", "loss", ["loss", "val_loss"]),
    ("lr.png", "learning rate", "lr", ["lr"]),
    ("grad_norm.png", "gradient norm before clipping", "grad_norm", ["grad_norm"]),
    ("tokens_per_s.png", "throughput", "tokens / s", ["tokens_per_s"]),
    ("mfu.png", "model FLOPs utilisation", "mfu", ["mfu"]),
    ("comm_bytes.png", "bytes of each collective per step (rank 0)", "bytes",
     [r"comm_\w+_bytes"]),
    ("pp_bubble.png", "pipeline bubble (idle share of the step, mean over stages)", "pp_bubble",
     ["pp_bubble"]),
    ("expert_load.png", "expert load: busiest expert over the mean (1.0 = even)", "load",
     [r"moe_load_h\d+", "moe_load_max"]),
    ("stragglers.png", "step-time spread across ranks: the busiest rank over the median",
     "busy_spread", ["busy_spread"]),
]


def read_records(run_dir):
    """metrics.jsonl's records (a line a kill left half-written skipped); UserError if the
    run directory has none yet."""
    path = os.path.join(run_dir, "metrics.jsonl")
    records = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    pass
    if not records:
        raise UserError(f"mode=plot: {path} has no records yet: nothing to draw (a run writes "
                        "one every trainer.log_every steps)")
    return records


def fields_of(patterns, records):
    """The fields of the records that the patterns name, in the order first seen."""
    seen = dict.fromkeys(k for r in records for k in r)
    return [k for p in patterns for k in seen if re.fullmatch(p, k)]


def series(records):
    """[(file, title, ylabel, {field: (steps, values)})] of every chart the run has data for."""
    charts = []
    for file, title, ylabel, patterns in CHARTS:
        lines = {}
        for field in fields_of(patterns, records):
            points = [(r["step"], r[field]) for r in records if r.get(field) is not None]
            lines[field] = ([s for s, _ in points], [v for _, v in points])
        if lines:
            charts.append((file, title, ylabel, lines))
    return charts


def timeline(run_dir):
    """pipeline_timeline.json (a pipeline's last step), or None."""
    path = os.path.join(run_dir, "pipeline_timeline.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
