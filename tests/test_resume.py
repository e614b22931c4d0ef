"""Stop a run, start it again, and get exactly the run that was never interrupted
(DESIGN.md section 3): same steps, losses and gradient norms after the snapshot.

A real 2-rank job is SIGKILLed, launcher and workers (the whole tree), and the
same command resumes it: it must say which step it resumed from, train every
step after that one again, and reproduce the uninterrupted losses. Dropout is
on, so the per-step random stream must resume too.
"""

import os
import re
import subprocess
import time

from char_dataset import embedded_corpus
from harness import (TINY, assert_parity, command, job_env, kill_tree, read_metrics, run_job,
                     run_metrics)
from snapshot import open_snapshot

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
    assert step % 4 == 0 and 0 < step < len(before_kill), \
        f"snapshot at step {step}: the killed run must have logged steps past it"

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
