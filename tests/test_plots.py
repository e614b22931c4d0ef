"""Pictures of one's own run (mode=plot) and TensorBoard's event files
(metrics.tensorboard=true), held to the run's metrics.jsonl: a 2-rank pipeline of
mixture-of-experts blocks, stopped and resumed from an older snapshot (so metrics.jsonl
dropped two steps and the resumed run wrote them again), then drawn."""

import json
import os
import shutil

import numpy as np
import pytest

from harness import read_metrics, run_job

PIPELINE_MOE = ["parallel.dp=single", "parallel.pp=2", "parallel.microbatches=2",
                "model.moe_experts=4", "trainer.eval_every=2", "trainer.save_every=2",
                "trainer.keep_snapshots=2", "metrics.tensorboard=true"]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """(run directory, mode=plot's result): steps 1-4, then 3-6 again from step 2's snapshot."""
    workdir = tmp_path_factory.mktemp("plots")
    for more in (["trainer.max_steps=4"], ["trainer.resume_step=2", "trainer.max_steps=6"]):
        result = run_job(workdir, 2, PIPELINE_MOE + more)
        assert result.returncode == 0, result.stderr[-3000:]
    plot = run_job(workdir, 1, ["mode=plot"])
    return workdir / "runs" / "default", plot


def plotted(run_dir):
    """{file: {line label: (x, y)}} of the figures mode=plot draws, read off matplotlib's
    lines (what the PNGs show), and the timeline figure's boxes per panel."""
    import matplotlib.pyplot as plt
    from plots.draw import figures
    out = {}
    for file, _, fig in figures(str(run_dir)):
        ax = fig.axes[0]
        out[file] = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()))
                     for ln in ax.get_lines()}
        out[file]["boxes"] = sum(len(c.get_paths()) for a in fig.axes for c in a.collections)
        plt.close(fig)
    return out


def test_mode_plot_draws_each_chart_the_run_has_with_its_records(resumed_run):
    run_dir, plot = resumed_run
    assert plot.returncode == 0, plot.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    drawn = plotted(run_dir)
    pictures = sorted(f for f in os.listdir(run_dir / "plots") if f.endswith(".png"))
    print(plot.stdout, sorted(drawn))
    assert plot.stdout.startswith(f"{len(pictures)} pictures of runs/default in runs/default/plots")
    assert sorted(drawn) == pictures == sorted([
        "loss.png", "lr.png", "grad_norm.png", "tokens_per_s.png", "comm_bytes.png",
        "pp_bubble.png", "expert_load.png", "stragglers.png", "pipeline_timeline.png"])  # no mfu: CPU
    for name in pictures:
        with open(run_dir / "plots" / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    fields = {"loss.png": ["loss", "val_loss"], "lr.png": ["lr"], "grad_norm.png": ["grad_norm"],
              "tokens_per_s.png": ["tokens_per_s"], "pp_bubble.png": ["pp_bubble"],
              "comm_bytes.png": sorted(k for k in records[0] if k.startswith("comm_")
                                       and k.endswith("_bytes") and k != "comm_bytes"),
              "expert_load.png": ["moe_load_h0", "moe_load_h1", "moe_load_max"],
              "stragglers.png": ["busy_spread"]}
    from parallel.pipeline_parallel.simulator import unit_time
    schedule = drawn["pp_bubble.png"].pop("1f1b at unit time (P=2, M=2, V=1)")
    assert schedule[1] == [unit_time("1f1b", 2, 2, 1)[1]] * 2 == pytest.approx([1 / 3] * 2)
    for file, names in fields.items():
        assert sorted(k for k in drawn[file] if k != "boxes") == sorted(names), file
        for name in names:
            want = [(r["step"], r[name]) for r in records if name in r]
            got = list(zip(*drawn[file][name]))
            assert got == want, (file, name, got, want)
    assert drawn["loss.png"]["val_loss"][0] == [2, 4, 6]
    with open(run_dir / "pipeline_timeline.json") as f:
        timeline = json.load(f)
    assert drawn["pipeline_timeline.png"]["boxes"] == sum(map(len, timeline["stages"])) > 0
    with open(run_dir / "plots" / "index.html") as f:
        page = f.read()
    assert sorted(p.split('"')[0] for p in page.split('<img src="')[1:]) == pictures


def test_a_dense_run_of_one_rank_has_no_collective_pipeline_expert_or_straggler_chart(
        tmp_path, resumed_run):
    """Drawn where an earlier pipeline run left its timeline and pictures: neither shows."""
    from plots.draw import write_plots
    run_dir = tmp_path / "runs" / "default"
    shutil.copytree(resumed_run[0], run_dir, ignore=shutil.ignore_patterns("metrics.jsonl"))
    result = run_job(tmp_path, 1, ["trainer.max_steps=2", "trainer.snapshot_path=fresh"])
    assert result.returncode == 0, result.stderr[-3000:]
    _, pictures = write_plots(str(run_dir))
    left = sorted(f for f in os.listdir(run_dir / "plots") if f.endswith(".png"))
    assert sorted(pictures) == left == [
        "grad_norm.png", "loss.png", "lr.png", "tokens_per_s.png"], pictures
    # on a GPU of the peak table the records carry mfu (never on CPU): its chart then shows it
    records = [dict(r, mfu=r["tokens_per_s"] / 1e6) for r in read_metrics(run_dir)]
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    assert plotted(run_dir)["mfu.png"]["mfu"] == ([r["step"] for r in records],
                                                  [r["mfu"] for r in records])


def test_mode_plot_of_a_run_directory_without_records_is_one_line(tmp_path):
    result = run_job(tmp_path, 1, ["mode=plot"])
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and lines == [
        "error: mode=plot: runs/default/metrics.jsonl has no records yet: nothing to draw "
        "(a run writes one every trainer.log_every steps)"], result.stderr[-3000:]


def test_tensorboard_holds_the_records_of_metrics_jsonl_once_after_a_resume(resumed_run):
    """What TensorBoard shows (its EventAccumulator, which drops the events a restart
    replaces) is every number of metrics.jsonl at its step, each step once; the resumed
    run's file starts with the restart at the first step it wrote again."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    run_dir, _ = resumed_run
    records = read_metrics(run_dir)
    board = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    want = {}
    for r in records:
        for k, v in r.items():
            if k != "step":
                want.setdefault(k, []).append((r["step"], np.float32(v)))
    got = {tag: [(e.step, np.float32(e.value)) for e in board.Scalars(tag)]
           for tag in board.Tags()["scalars"]}
    assert got == want
    files = sorted(os.listdir(run_dir / "tensorboard"))
    assert len(files) == 2, files  # one per run start, by the main rank only
    starts = [e.step for e in EventFileLoader(str(run_dir / "tensorboard" / files[1])).Load()
              if e.HasField("session_log")]
    assert starts == [3], starts
