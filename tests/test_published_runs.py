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


def test_a_product_off_16_bytes_is_unaligned_slowdown_times_slower():
    """efficiency.matmul_seconds: GPT-2's vocabulary unpadded (50,257: rows of an odd
    number of bf16 elements) makes each LM-head product UNALIGNED_SLOWDOWN (3) x slower
    than padded to 50,304 (per FLOP: the 47 more columns cost their share); a 16-byte
    multiple in fp32 (4 elements) is aligned."""
    from planner.efficiency import UNALIGNED_SLOWDOWN, matmul_seconds
    from planner.machines import PRESETS
    from planner.shapes import Workload
    a100 = PRESETS["A100-80GB"]
    bf16 = Workload(12, 12, 768, 50257, 1024, 96, "bf16")
    unpadded, padded = (matmul_seconds(12 * 1024, v, 768, bf16, a100) for v in (50257, 50304))
    assert UNALIGNED_SLOWDOWN == 3.0
    assert abs(unpadded / padded / (3.0 * 50257 / 50304) - 1) < 1e-3, unpadded / padded
    fp32 = Workload(12, 12, 768, 50260, 1024, 96, "fp32")
    assert matmul_seconds(12 * 1024, 50260, 768, fp32, a100) < 1.001 * 50260 / 50304 * \
        matmul_seconds(12 * 1024, 50304, 768, fp32, a100)


def test_kernel_slowdown_scales_the_compute_and_nothing_else():
    """plan.kernel_slowdown (the nanoGPT rows' 1.46): every kind of the step's compute that
    many times the model's; the communication parts unchanged; not > 0 is a UserError."""
    import pytest
    from errors import UserError
    row = next(r for r in RUNS if r["name"] == "llm.c GPT-2 124M")
    slow = dict(row, layout=dict(row["layout"], **{"plan.kernel_slowdown": 1.46}))
    base, scaled = replay(row)["time"], replay(slow)["time"]
    assert abs(scaled["compute"] / base["compute"] - 1.46) < 1e-9, (base, scaled)
    assert base["dp"] > 0  # ZeRO-1's exposed gather: communication is there, and unchanged
    for part in ("dp", "tp", "pp", "cp", "host"):
        assert scaled[part] == base[part], part
    bad = dict(row, layout=dict(row["layout"], **{"plan.kernel_slowdown": 0}))
    with pytest.raises(UserError, match="plan.kernel_slowdown=0"):
        replay(bad)
