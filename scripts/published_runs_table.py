"""docs/published-runs.md's table: every row of
planner/published_runs.py replayed with `mode=plan plan.search=false`, predicted beside
published seconds per iteration:

    python -m scripts.published_runs_table

tests/test_published_runs.py replays the same rows (each within 25%) and fails when the
page's predicted column differs from this output by more than its rounding."""

import contextlib
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import load_config  # noqa: E402
from planner.published_runs import RUNS, overrides, published_seconds  # noqa: E402
from planner.report import plan  # noqa: E402


def replay(row) -> dict:
    """The plan.search=false row of a published run (its printout swallowed)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return plan(load_config(overrides(row), 1))


def layout_words(row):
    keys = row["layout"]
    words = [f"tp{keys.get('parallel.tp', 1)}", f"pp{keys.get('parallel.pp', 1)}",
             f"dp{row['gpus'] // (keys.get('parallel.tp', 1) * keys.get('parallel.pp', 1))}"]
    if keys.get("parallel.pp_virtual_stages", 1) > 1:
        words.append(f"V{keys['parallel.pp_virtual_stages']}")
    if keys.get("parallel.dp") == "fsdp":
        words.append(f"ZeRO-{keys['parallel.zero_stage']}")
    if keys.get("plan.tp_comm_overlap") or keys.get("plan.param_gather_overlap"):
        words.append("overlapped")  # the source system's overlaps (plan.* keys)
    if keys.get("plan.kernel_slowdown", 1) != 1:
        words.append(f"kernels x{keys['plan.kernel_slowdown']}")  # a slower stack (plan.kernel_slowdown)
    return " ".join(words)


def markdown():
    lines = ["| run | GPUs | layout | batch | recompute | published | predicted s | "
             "published s | predicted / published | predicted MFU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in RUNS:
        got = replay(row)
        predicted, published = got["time"]["step_ms"] / 1000, published_seconds(row)
        value, unit = row["published"]
        mark = "" if not row.get("checked") else " (not checked)"
        lines.append(
            f"| {row['name']}{mark} | {row['gpus']} x {row['gpu']} | {layout_words(row)} | "
            f"{row['batch']} | {row['recompute']} | {value:.4g} {unit} | {predicted:.3g} | "
            f"{published:.3g} | {predicted / published:.2f} | {100 * got['time']['mfu']:.0f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
