"""The benchmark commands: bench.run end to end on a tiny model (its reports carry the jobs'
own numbers), and the committed results read back by the code that writes them."""

import glob
import json
import os
import re
import sys
from statistics import median

import pytest

from bench import data, snapshot
from bench.run_engine import stats, tables
from bench.run_engine.jobs import check
from bench.run_engine.tables import fmt_ms
from harness import REPO, job_env, read_metrics, run_tree

STEPS, WARMUP = 6, 2


def test_bench_reports_the_jobs_numbers(tmp_path):
    out, runs = tmp_path / "out", tmp_path / "runs"
    cmd = [sys.executable, "-m", "bench.run", "--model", "tiny", "--variants", "single,torch_ddp",
           "--rounds", "1", "--steps", str(STEPS), "--warmup", str(WARMUP),
           "--out", str(out), "--runs-dir", str(runs)]
    result = run_tree(cmd, 180, "bench.run", cwd=REPO, env=job_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    doc = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert (out / "step_time.png").stat().st_size > 0
    assert "python -m bench.run --model tiny --variants single,torch_ddp" in md
    # by default the embedded corpus, the same on every machine: no data.path of this one
    assert not [o for o in doc["settings"]["overrides"] if o.startswith("data.path")]

    medians = {}
    for name in ("single", "torch_ddp"):
        metrics = read_metrics(str(runs / f"r1-{name}"))  # what the job itself logged
        assert len(metrics) == STEPS
        medians[name] = median(m["step_ms"] for m in metrics[WARMUP:])
        got = doc["variants"][name]
        assert got["step_ms"] == pytest.approx(medians[name])
        assert got["state_bytes"] == metrics[-1]["state_bytes"]
        assert got["peak_mem_mb"] == max(m["peak_mem_mb"] for m in metrics)
        assert [j["records"] for j in doc["jobs"] if j["variant"] == name] == [metrics]
        assert f"| {name} | " in md and f"| {fmt_ms(medians[name])} |" in md
    ratio = doc["variants"]["torch_ddp"]["vs_single"]["median"]
    assert ratio == pytest.approx(medians["torch_ddp"] / medians["single"])
    assert f"{ratio:.2f}x" in md
    # same run under both layouts (the parity rule), so the ratio compares like with like
    assert doc["variants"]["torch_ddp"]["loss_rel_diff_vs_single"] <= 1e-5


def test_unknown_strategy_is_skipped_with_the_configs_reason():
    why, _ = check(["parallel.dp=no_such_strategy"], 2)
    assert "no_such_strategy" in why
    assert check(["parallel.dp=torch_ddp"], 2)[0] is None


def test_textbook_figures():
    ddp, zero3 = stats.textbook(1000, 2, 0), stats.textbook(1000, 2, 3)
    assert ddp["wire_bytes"] == 4000  # ring: 2(N-1)/N x 4 bytes x params
    assert zero3["wire_bytes"] == 1.5 * ddp["wire_bytes"]
    assert (ddp["state_bytes"], zero3["state_bytes"]) == (16000, 8000)


def test_committed_results_name_no_path_of_one_machine():
    """The committed benchmark results and docs record commands and settings a fresh
    clone can run as written: no absolute path of the machine that made them."""
    machine_path = re.compile(r"(?<![\w.<])/(work|tmp|home|Users|root|mnt|opt|srv)/")
    files = glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True) + \
        glob.glob(os.path.join(REPO, "docs", "**", "*.json"), recursive=True) + \
        [os.path.join(REPO, "README.md"), os.path.join(REPO, "bench", "README.md")]
    found = []
    for path in files:
        with open(path) as f:
            found += [f"{os.path.relpath(path, REPO)}:{n}: {m.group(0)}"
                      for n, line in enumerate(f, 1) if (m := machine_path.search(line))]
    assert len(files) > 8 and not found, found


def test_bench_data_prepare_reports_what_prepare_wrote(tmp_path):
    """bench.data's prepare step on a 1 MB generated corpus, as the command runs it (a
    worker process): its MB and tokens are the index's own (the full command takes
    minutes; this is the part that reads prepare's output format)."""
    size = data.generate(str(tmp_path / "text"), 1, 1)
    got = data.prepare(str(tmp_path / "text"), str(tmp_path / "tokens"), "char", 1, job_env())
    index = json.loads((tmp_path / "tokens" / "index.json").read_text())
    assert size == 2**20 and got["text_mb"] == pytest.approx(1.0, rel=0.01)
    assert got["tokens"] == index["tokens"] > 0 and got["shards"] == len(index["shards"])


def committed(*parts):
    return os.path.join(REPO, "docs", "bench", *parts)


def table_rows(lines):
    return [ln for ln in lines if ln.startswith("|")]


# every committed results.json but the standalone commands' is bench.run's
RUN_RESULTS = sorted({os.path.basename(os.path.dirname(p)) for p in glob.glob(
    committed("*", "results.json"))} - {"data", "snapshot"})


@pytest.mark.parametrize("name", RUN_RESULTS)
def test_committed_run_results_render_as_committed(name):
    """A committed bench.run results.json still renders through bench/run_engine/tables.py
    into the committed tables, figure for figure (a change of the tables' format fails
    here: the committed results then no longer read as the code writes them)."""
    doc = json.loads(open(committed(name, "results.json")).read())
    md = tables.markdown(doc["command"], doc["settings"], doc["variants"], doc["skipped"],
                         doc["jobs"], "step_time.png").splitlines()
    want = open(committed(name, "results.md")).read().splitlines()
    assert f"    {doc['command']}" in md and table_rows(md) == table_rows(want)


def test_committed_snapshot_and_data_results_render_as_committed():
    """bench.snapshot's and bench.data's tables, rendered from their committed results.json,
    are the rows of their committed results.md."""
    snap = json.loads(open(committed("snapshot", "results.json")).read())
    want = open(committed("snapshot", "results.md")).read().splitlines()
    assert snapshot.table(snap["rows"]) == table_rows(want)
    doc = json.loads(open(committed("data", "results.json")).read())
    names = list(dict.fromkeys(r["corpus"] for r in doc["train"]))  # round 0 runs them in order
    want = open(committed("data", "results.md")).read().splitlines()
    assert data.prepare_table(doc["prepare"]) + data.train_table(
        data.train_medians(doc["train"], names)) == table_rows(want)
