"""Save under layout A, resume under layout B, optimizer state included: the resumed
steps equal those of an uninterrupted run under A (loss and gradient norm, rtol 1e-5).

Job A trains steps 1-3 and snapshots; job B resumes that snapshot (a copy, so every
pair starts from the same files) and trains steps 4-6. The learning rate is constant
and clipping off, so the 3-step and 6-step jobs share a schedule and a wrong Adam
state or gradient scale shows in the resumed steps.
"""

import os
import shutil
import uuid

import pytest

from harness import assert_parity, read_metrics, run_job, run_metrics

LAYOUTS = {
    "single": (1, ["parallel.dp=single"]),
    "ddp_bucket_x2": (2, ["parallel.dp=ddp_bucket"]),
    "fsdp3_x2": (2, ["parallel.dp=fsdp", "parallel.zero_stage=3"]),
    "fsdp3_x3": (3, ["parallel.dp=fsdp", "parallel.zero_stage=3"]),
}
CONSTANT = ["trainer.warmup_steps=0", "trainer.lr=0.003", "trainer.min_lr=0.003",
            "trainer.grad_clip=0"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Layout name -> snapshot directory after 3 steps under that layout."""
    out = {}
    for name, (nproc, args) in LAYOUTS.items():
        workdir = tmp_path_factory.mktemp(f"save-{name}")
        result = run_job(workdir, nproc, args + CONSTANT + ["trainer.max_steps=3"])
        assert result.returncode == 0, result.stderr[-3000:]
        out[name] = workdir / "runs" / "default" / "snapshot"
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One process, 6 steps: every layout reproduces it to fp32 tolerance (the parity
    tests), so it is the reference for resumes from any of them."""
    nproc, args = LAYOUTS["single"]
    return run_metrics(tmp_path_factory.mktemp("ref"), nproc, args + CONSTANT + ["trainer.max_steps=6"])


# a cycle through the layouts: each saved once and resumed once, every kind of change
# (replicas -> shards, shards -> more shards, fewer shards, shards -> one process);
# tests/test_fsdp_resume.py covers the other fsdp stages and torch_fsdp the same way
PAIRS = [("single", "ddp_bucket_x2"), ("ddp_bucket_x2", "fsdp3_x3"), ("fsdp3_x3", "fsdp3_x2"),
         ("fsdp3_x2", "single")]


@pytest.mark.parametrize("saved_under,resumed_under", PAIRS)
def test_resume_under_another_layout(tmp_path, saved, uninterrupted, saved_under, resumed_under):
    snapshot = tmp_path / "snapshot"
    shutil.copytree(saved[saved_under], snapshot)
    nproc, args = LAYOUTS[resumed_under]
    workdir = tmp_path / f"resume-{uuid.uuid4().hex[:6]}"
    result = run_job(workdir, nproc, args + CONSTANT + ["trainer.max_steps=6",
                                                        f"trainer.snapshot_path={snapshot}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 3" in result.stdout
    resumed = read_metrics(os.path.join(workdir, "runs", "default"))
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert_parity(uninterrupted[3:], resumed)
