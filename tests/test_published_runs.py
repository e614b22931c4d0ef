"""The step-time model against published training runs (planner/published_runs.py).

Every row (Megatron-LM's 2021 weak-scaling table, the 2022 sequence-parallel and
selective-recomputation paper's end-to-end times, Megatron-Core's H100 weak-scaling
table, llm.c on A100 and H100, nanoGPT) is
replayed in process as `mode=plan plan.search=false` with its own shape, cluster and
layout; the predicted seconds per iteration must be within 25% of what the source
publishes, except a row whose `checked` field says why not. docs/published-runs.md shows the
same table (scripts/published_runs_table.py): its predicted column must be this run's,
to its three printed digits.
"""

import os
import re

from harness import REPO
from planner.published_runs import RUNS, published_seconds
from scripts.published_runs_table import replay

WITHIN = 0.25


def docs_predictions():
    """{run name: predicted seconds} from docs/published-runs.md's table."""
    text = open(os.path.join(REPO, "docs", "published-runs.md")).read()
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"[\d.]+", cells[6]):
            out[cells[0].replace(" (not checked)", "")] = float(cells[6])
    return out


def test_every_published_run_is_predicted_within_25_percent():
    assert len(RUNS) >= 12 and all(row["source"] for row in RUNS)
    documented = docs_predictions()
    misses, stale, checked = [], [], 0
    for row in RUNS:
        predicted = replay(row)["time"]["step_ms"] / 1000
        published = published_seconds(row)
        ratio = predicted / published
        print(f"{row['name']:<34} predicted {predicted:8.4g} s, published {published:8.4g} s: "
              f"{ratio:.2f}" + ("" if not row.get("checked") else "  (not checked)"))
        if not row.get("checked"):
            checked += 1
            if abs(ratio - 1) > WITHIN:
                misses.append(f"{row['name']}: {ratio:.2f}")
        shown = documented.get(row["name"])
        if shown is None or abs(shown / predicted - 1) > 0.005 + 0.5e-3 / predicted:
            stale.append(f"{row['name']}: docs/published-runs.md says {shown} s, the model {predicted:.4g}")
    assert checked >= 12, checked
    assert not misses, "outside 25% of the published figure: " + ", ".join(misses)
    assert not stale, "python -m scripts.published_runs_table: " + "; ".join(stale)
