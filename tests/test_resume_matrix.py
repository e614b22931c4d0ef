"""Save under layout A, resume under layout B, optimizer state included: the resumed
steps equal those of an uninterrupted run (loss and gradient norm, rtol 1e-5).

One chain of jobs in one run directory, each resuming the snapshot the one before it
wrote and training two more steps under the next layout: every kind of change
(replicas -> shards, more shards, fewer, other ZeRO stages, PyTorch's FSDP, shards
with gradient accumulation, shards -> hybrid sharding with offload -> shards over all
ranks, shards -> one process). The learning rate is constant and
clipping off, so jobs of any length share a schedule, and a wrong Adam state or
gradient scale shows in the two steps after its resume (the test of that transition).
A chain costs one job per layout, where a saved-and-resumed pair costs two.
"""

import os

import pytest

from harness import assert_parity, read_metrics, run_job, run_metrics

LAYOUTS = {
    "single": (1, ["parallel.dp=single"]),
    "ddp_bucket_x2": (2, ["parallel.dp=ddp_bucket"]),
    "fsdp3_x3": (3, ["parallel.dp=fsdp", "parallel.zero_stage=3"]),
    "fsdp2_x2": (2, ["parallel.dp=fsdp", "parallel.zero_stage=2"]),
    "fsdp1_x3": (3, ["parallel.dp=fsdp", "parallel.zero_stage=1"]),
    "torch_fsdp_x2": (2, ["parallel.dp=torch_fsdp"]),
    "fsdp3_x2_accum2": (2, ["parallel.dp=fsdp", "parallel.zero_stage=3", "trainer.grad_accum=2"]),
    # hybrid sharding: 2 replica groups of 2 (offloaded), then plain ZeRO-3 over all 4
    "hsdp2x2_fsdp2_offload": (4, ["parallel.dp=fsdp", "parallel.zero_stage=2",
                                  "parallel.dp_replicate=2", "parallel.offload=true"]),
    "fsdp3_x4": (4, ["parallel.dp=fsdp", "parallel.zero_stage=3"]),
}
CHAIN = ["single", "ddp_bucket_x2", "fsdp3_x3", "fsdp2_x2", "fsdp1_x3", "torch_fsdp_x2",
         "fsdp3_x2_accum2", "hsdp2x2_fsdp2_offload", "fsdp3_x4", "single"]
STEPS = 2  # per job
CONSTANT = ["trainer.warmup_steps=0", "trainer.lr=0.003", "trainer.min_lr=0.003",
            "trainer.grad_clip=0"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One process through the chain's whole length: every layout reproduces it to fp32
    tolerance (the parity tests), so it is the reference for resumes from any of them."""
    nproc, args = LAYOUTS["single"]
    return run_metrics(tmp_path_factory.mktemp("ref"), nproc,
                       args + CONSTANT + [f"trainer.max_steps={STEPS * len(CHAIN)}"])


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Job k of CHAIN resumes the snapshot of job k-1 (same run directory) and trains to
    step STEPS * (k + 1). Returns each job's result; stops at the first failure."""
    workdir = tmp_path_factory.mktemp("chain")
    results = []
    for k, name in enumerate(CHAIN):
        nproc, args = LAYOUTS[name]
        results.append(run_job(workdir, nproc, args + CONSTANT + [f"trainer.max_steps={STEPS * (k + 1)}"]))
        if results[-1].returncode != 0:
            break
    return results, read_metrics(os.path.join(workdir, "runs", "default"))


TRANSITIONS = list(zip(CHAIN, CHAIN[1:]))


@pytest.mark.parametrize("k", range(1, len(CHAIN)), ids=[f"{a}-to-{b}" for a, b in TRANSITIONS])
def test_resume_under_another_layout(chain, uninterrupted, k):
    results, records = chain
    assert len(results) > k, f"an earlier job of the chain failed:\n{results[-1].stderr[-3000:]}"
    result = results[k]
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"at step {STEPS * k}" in result.stdout, result.stdout[-2000:]
    resumed = [r for r in records if STEPS * k < r["step"] <= STEPS * (k + 1)]
    assert [r["step"] for r in resumed] == list(range(STEPS * k + 1, STEPS * (k + 1) + 1))
    assert_parity(uninterrupted[STEPS * k:STEPS * (k + 1)], resumed)
