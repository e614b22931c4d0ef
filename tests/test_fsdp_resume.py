"""Snapshots stay canonical under fsdp: a run saved under one layout resumes under
another with the losses of an uninterrupted run (README, "Stopping and resuming").

Job A trains steps 1-3 and snapshots; job B, same run directory and snapshot,
continues to step 6. The LR is constant after warm-up (min_lr = lr), so A's
max_steps=3 gives it the same schedule as the uninterrupted 6-step reference.
"""

import os

import pytest

from harness import assert_parity, read_metrics, run_job, run_metrics

CONSTANT_LR = ["trainer.lr=0.002", "trainer.min_lr=0.002"]
SINGLE = (1, ["parallel.dp=single"])
FSDP3_3 = (3, ["parallel.dp=fsdp", "parallel.zero_stage=3"])
FSDP3_2 = (2, ["parallel.dp=fsdp", "parallel.zero_stage=3", "trainer.grad_accum=2"])
FSDP2_2 = (2, ["parallel.dp=fsdp", "parallel.zero_stage=2"])
FSDP1_3 = (3, ["parallel.dp=fsdp", "parallel.zero_stage=1"])
TORCH_FSDP_2 = (2, ["parallel.dp=torch_fsdp"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_metrics(tmp_path_factory.mktemp("ref"), 1,
                      ["parallel.dp=single", "trainer.max_steps=6"] + CONSTANT_LR)


def run_ok(workdir, nproc, overrides):
    result = run_job(workdir, nproc, overrides + CONSTANT_LR)
    assert result.returncode == 0, f"job failed: {overrides}\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-5000:]}"
    return result


CASES = {"fsdp3x3-to-single": (FSDP3_3, SINGLE), "single-to-fsdp3x2": (SINGLE, FSDP3_2),
         "fsdp2x2-to-fsdp1x3": (FSDP2_2, FSDP1_3), "fsdp1x3-to-torch_fsdp": (FSDP1_3, TORCH_FSDP_2)}


@pytest.mark.parametrize("first,then", CASES.values(), ids=CASES.keys())
def test_resume_across_layouts(uninterrupted, tmp_path, first, then):
    workdir = str(tmp_path)  # both jobs: same run_dir, same snapshot
    run_ok(workdir, first[0], first[1] + ["trainer.max_steps=3"])
    resumed = run_ok(workdir, then[0], then[1] + ["trainer.max_steps=6"])
    assert "resuming from snapshot" in resumed.stdout and "at step 3" in resumed.stdout
    records = read_metrics(os.path.join(workdir, "runs", "default"))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert_parity(uninterrupted, [r["loss"] for r in records])
