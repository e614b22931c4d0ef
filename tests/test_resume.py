"""Stop a run, start it again, and get exactly the run that was never interrupted
(docs/checkpointing.md): same steps, losses and gradient norms after the snapshot.

- A real 2-rank job is SIGKILLed, launcher and workers (the whole tree), and the
  same command resumes it: it must say which step it resumed from, train every
  step after that one again, and reproduce the uninterrupted losses. Dropout is
  on, so the per-step random stream must resume too.
- In process (one rank, no torchrun; main.train as the job runs it), a run
  "crashes" right after logging step 5 with its snapshot at step 4 and is
  resumed; once per strategy, so each one's optimizer state must be saved and
  loaded. These are the deterministic guards (no kill timing involved).
"""

import contextlib
import io
import math
import os
import re
import subprocess
import time
from unittest import mock

import pytest
import torch.distributed as dist

from char_dataset import embedded_corpus
from harness import (TINY, assert_parity, command, job_env, kill_tree, read_metrics, run_job,
                     run_metrics)
from checkpoint.snapshot_reader import open_snapshot

# a short corpus makes an epoch 10 steps long, so the run crosses epoch boundaries
# and the kill lands mid-epoch; a wider model makes steps slow enough to kill mid-run
RESUME = ["trainer.max_steps=30", "trainer.save_every=4", "trainer.eval_every=10",
          "data.val_fraction=0.3", "model.n_embd=64", "data.block_size=32",
          "model.dropout=0.1"]  # dropout: the random stream must resume too


def small_corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(embedded_corpus(1000)[:220])  # 154 train tokens: 122 windows, 10 steps/epoch
    return path


def kill_after_step(workdir, overrides, step, timeout=120):
    """Start a 2-rank job and SIGKILL its launcher and workers once `step` is logged."""
    os.makedirs(workdir, exist_ok=True)
    metrics = os.path.join(workdir, "runs", "default", "metrics.jsonl")
    proc = subprocess.Popen(command(2, TINY + overrides), cwd=workdir, env=job_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(metrics):
                with open(metrics) as f:
                    if f.read().count("\n") >= step:
                        break
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
        proc.wait()
    return read_metrics(os.path.dirname(metrics))


def trained_steps(stdout, total):
    """The steps a job trained, from its console lines `step k/total | loss ...`."""
    return [int(k) for k in re.findall(rf"^step (\d+)/{total} \|", stdout, re.M)]


def test_killed_job_resumes_from_its_snapshot_with_identical_losses(tmp_path):
    args = ["parallel.dp=ddp_bucket", f"data.path={small_corpus(tmp_path)}", *RESUME]
    reference = run_metrics(tmp_path, 2, args)
    assert len(reference) == 30

    workdir = tmp_path / "killed"
    before_kill = kill_after_step(workdir, args, step=13)
    print(f"killed after step {len(before_kill)}")
    assert 13 <= len(before_kill) < 30, "the kill must land mid-run"
    step = open_snapshot(str(workdir / "runs" / "default" / "snapshot")).meta["step"]
    # usually the run has logged steps past its snapshot; on a busy machine the kill can
    # land between a snapshot's commit and its step's metrics line (the resumed run
    # writes that line back from the snapshot: test_metrics_line_lost_after_a_commit...)
    assert step % 4 == 0 and 0 < step <= len(before_kill) + 1, \
        f"snapshot at step {step}, {len(before_kill)} steps logged before the kill"

    result = run_job(workdir, 2, args)
    assert result.returncode == 0, result.stderr
    assert re.search(rf"^resuming from snapshot \S+ at step {step}$", result.stdout, re.M), \
        result.stdout[-3000:]
    assert trained_steps(result.stdout, 30) == list(range(step + 1, 31)), \
        f"the resumed job must train steps {step + 1}..30 again:\n{result.stdout[-3000:]}"
    resumed = read_metrics(workdir / "runs" / "default")
    assert [r["step"] for r in resumed] == list(range(1, 31))  # re-done steps not duplicated
    assert_parity(reference, resumed)
    for ref, got in zip(reference, resumed):
        assert abs(ref["loss"] - got["loss"]) <= 1e-6 * abs(ref["loss"]), (ref, got)
        assert ("val_loss" in ref) == ("val_loss" in got)
        if "val_loss" in ref:
            assert abs(ref["val_loss"] - got["val_loss"]) <= 1e-6 * ref["val_loss"]


def test_snapshot_holds_what_resume_needs(tmp_path):
    run_metrics(tmp_path, 1, ["parallel.dp=single", "trainer.max_steps=3"])
    job = next(p for p in tmp_path.iterdir() if p.name.startswith("job-"))
    snap = open_snapshot(str(job / "runs" / "default" / "snapshot"))
    assert snap.meta["step"] == 3 and snap.meta["samples_seen"] == 36
    assert set(snap.meta) >= {"lr_schedule", "rng", "config", "tokenizer", "wandb_id",
                              "gpt_config", "layout", "format_version"}
    model = {k for k in snap.keys() if k.startswith("model/")}
    assert "model/transformer.wte.weight" in model  # canonical single-device names
    for field in ("exp_avg", "exp_avg_sq", "step"):  # AdamW state for every parameter
        assert {k for k in snap.keys() if k.endswith("/" + field)} == \
               {k.replace("model/", "optim/") + "/" + field for k in model}


# ---------------------------------------------------------------- in process: crash and resume

STRATEGIES = {"single": ["parallel.dp=single"], "ddp_naive": ["parallel.dp=ddp_naive"],
              "ddp_bucket": ["parallel.dp=ddp_bucket"], "torch_ddp": ["parallel.dp=torch_ddp"],
              **{f"fsdp{s}": ["parallel.dp=fsdp", f"parallel.zero_stage={s}"] for s in (1, 2, 3)},
              "torch_fsdp": ["parallel.dp=torch_fsdp"],
              "fsdp2_offload": ["parallel.dp=fsdp", "parallel.zero_stage=2", "parallel.offload=true"]}
# snapshots at steps 2 and 4; the crash comes right after step 5 is logged, so the
# snapshot is at step 4 and metrics.jsonl holds a record past it
CRASH = ["trainer.save_every=2", "trainer.eval_every=3", "trainer.max_steps=6"]
CRASH_AFTER, SNAPSHOT_STEP = 5, 4


class Crash(Exception):
    """Stands for a kill: raised inside the training loop, nothing runs after it."""


@pytest.fixture(scope="module")
def grid():
    """A one-rank gloo group for this module's in-process runs."""
    import torch
    from parallel.grid import ProcessGrid
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield ProcessGrid({}, torch.device("cpu"))
    dist.destroy_process_group()


def train_in_process(grid, run_dir, overrides, crash_after=None, crash_before=None):
    """main.train in this process: (console output, steps it logged). It "crashes" right
    after writing step `crash_after`'s metrics line, or right before `crash_before`'s."""
    import main
    from telemetry.metrics import MetricsLog
    cfg = main.load_config(TINY + CRASH + overrides + [f"trainer.run_dir={run_dir}"], 1)
    logged, real_write = [], MetricsLog.write

    def write(self, record, total_steps, console):
        if record["step"] == crash_before:
            raise Crash
        real_write(self, record, total_steps, console)
        logged.append(record["step"])
        if record["step"] == crash_after:
            raise Crash

    out = io.StringIO()
    with mock.patch.object(MetricsLog, "write", write), contextlib.redirect_stdout(out):
        try:
            main.train(cfg, grid)
        except Crash:
            pass
    return out.getvalue(), logged


_scenarios = {}


def crash_and_resume(grid, tmp_path_factory, name, extra=()):
    """Uninterrupted run vs a run crashed after step 5 and resumed (cached per case)."""
    key = (name, tuple(extra))
    if key not in _scenarios:
        overrides = STRATEGIES[name] + list(extra)
        base = tmp_path_factory.mktemp(f"inproc-{name}")
        _, full = train_in_process(grid, base / "uninterrupted", overrides)
        assert full == list(range(1, 7))
        crashed_dir = base / "crashed"
        _, before = train_in_process(grid, crashed_dir, overrides, crash_after=CRASH_AFTER)
        assert before == list(range(1, CRASH_AFTER + 1))
        assert open_snapshot(str(crashed_dir / "snapshot")).meta["step"] == SNAPSHOT_STEP
        output, after = train_in_process(grid, crashed_dir, overrides)
        _scenarios[key] = {"reference": read_metrics(base / "uninterrupted"), "output": output,
                           "retrained": after, "resumed": read_metrics(crashed_dir)}
    return _scenarios[key]


def assert_resumed_exactly(s):
    assert re.search(rf"^resuming from snapshot \S+ at step {SNAPSHOT_STEP}$", s["output"], re.M), \
        s["output"]
    assert s["retrained"] == list(range(SNAPSHOT_STEP + 1, 7)), \
        f"the resumed run must train steps {SNAPSHOT_STEP + 1}..6 again, trained {s['retrained']}"
    assert [r["step"] for r in s["resumed"]] == list(range(1, 7))
    assert_parity(s["reference"], s["resumed"])
    val = [[r.get("val_loss") for r in rs] for rs in (s["reference"], s["resumed"])]
    assert val[0] == val[1], f"validation losses differ: {val}"


@pytest.mark.parametrize("name", STRATEGIES)
def test_optimizer_state_is_saved_and_loaded(grid, tmp_path_factory, name):
    """Adam state lost at the snapshot (not written, or not read back) changes the
    resumed steps' losses and gradient norms; exercised once per strategy."""
    s = crash_and_resume(grid, tmp_path_factory, name)
    assert_resumed_exactly(s)


def test_random_stream_is_reseeded_each_step(grid, tmp_path_factory):
    """With dropout, a resumed run draws the masks an uninterrupted one draws only if
    the random state is a function of (seed, step, dp rank), set at every step."""
    assert_resumed_exactly(crash_and_resume(grid, tmp_path_factory, "ddp_bucket",
                                            ["model.dropout=0.2"]))


def test_resume_drops_metrics_records_past_the_snapshot(grid, tmp_path_factory):
    s = crash_and_resume(grid, tmp_path_factory, "ddp_bucket", ["model.dropout=0.2"])
    steps = [r["step"] for r in s["resumed"]]
    assert steps == list(range(1, 7)), f"metrics.jsonl after resuming at step {SNAPSHOT_STEP}: {steps}"


def test_metrics_line_lost_after_a_commit_is_written_back(grid, tmp_path):
    """A step's metrics line is written after its snapshot commits (it reports the save);
    a kill in between must not leave that step missing from metrics.jsonl: the resumed
    run starts after it, so the line comes back from the snapshot."""
    overrides = STRATEGIES["ddp_bucket"]
    _, full = train_in_process(grid, tmp_path / "uninterrupted", overrides)
    _, before = train_in_process(grid, tmp_path / "crashed", overrides, crash_before=SNAPSHOT_STEP)
    assert before == list(range(1, SNAPSHOT_STEP))
    assert open_snapshot(str(tmp_path / "crashed" / "snapshot")).meta["step"] == SNAPSHOT_STEP
    output, after = train_in_process(grid, tmp_path / "crashed", overrides)
    assert after == list(range(SNAPSHOT_STEP + 1, 7)), output
    reference, resumed = read_metrics(tmp_path / "uninterrupted"), read_metrics(tmp_path / "crashed")
    assert [r["step"] for r in resumed] == list(range(1, 7)), "a step is missing from metrics.jsonl"
    assert_parity(reference, resumed)


FP16 = ["trainer.precision=fp16", "trainer.fp16_growth_interval=1"]


@pytest.mark.parametrize("name", ["single", "fsdp3"])
def test_fp16_loss_scale_is_saved_and_loaded(grid, tmp_path_factory, name):
    """fp16_growth_interval=1 doubles the loss scale after every good step until fp16
    overflows, so steps are skipped along the way; the resumed run skips the same
    steps, and trains the same losses, only if the scale came back from the snapshot."""
    s = crash_and_resume(grid, tmp_path_factory, name, FP16)
    ref, got = s["reference"], s["resumed"]
    print("step, loss scale, skipped:", [(r["step"], r["loss_scale"], r["step_skipped"]) for r in ref])
    assert any(r["step_skipped"] for r in ref[SNAPSHOT_STEP:]), "no overflow after the snapshot"
    assert [r["step"] for r in got] == list(range(1, 7))
    for a, b in zip(ref, got):
        assert (a["loss"], a["loss_scale"], a["step_skipped"]) == \
               (b["loss"], b["loss_scale"], b["step_skipped"]), (a, b)
        assert a["grad_norm"] == b["grad_norm"] or not math.isfinite(a["grad_norm"])
