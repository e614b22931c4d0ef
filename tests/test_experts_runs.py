"""Mixture of experts through main.py: resume across expert-parallel degrees, the metrics
records, the layouts that cannot run, export's refusal and sampling.

- A chain of jobs in one run directory: ep 2 (ddp_bucket, 2 ranks) for two steps, then
  ep 4 (fsdp ZeRO-3, 4 ranks), then one process: each resumes the snapshot the one before
  it wrote, and its steps equal an uninterrupted single-process run's (loss, pre-clip
  gradient norm and balance loss, rtol 1e-5; constant learning rate, no clipping, so a
  wrong Adam state or gradient scale shows in the two steps after a resume). DeepSeek-V3's
  choice biases move every step (model.moe_bias_rate): the snapshot carries them.
- Each logged record of an ep job holds the balance and z-losses, the load of each MoE
  block and the worst, and the all-to-all bytes.
- Bad layouts: one line on every rank, non-zero exit, before any collective.
"""

import os

import pytest

from harness import REPO, assert_parity, max_rel_diff, read_metrics, run_job, run_metrics
from test_bad_input import assert_clean_failure

MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_hidden=48"]
BIAS = ["model.moe_bias_rate=0.05"]  # the chain: the choice biases must resume too
CONSTANT = ["trainer.warmup_steps=0", "trainer.lr=0.003", "trainer.min_lr=0.003",
            "trainer.grad_clip=0"]
CHAIN = [(2, ["parallel.dp=ddp_bucket", "parallel.ep=2"]),
         (4, ["parallel.dp=fsdp", "parallel.zero_stage=3", "parallel.ep=4"]),
         (1, ["parallel.dp=single"])]
STEPS = 2  # per job


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_metrics(tmp_path_factory.mktemp("ref"), 1, ["parallel.dp=single"] + MOE + BIAS + CONSTANT
                       + [f"trainer.max_steps={STEPS * len(CHAIN)}"])


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("chain")
    results = []
    for k, (nproc, args) in enumerate(CHAIN):
        results.append(run_job(workdir, nproc, args + MOE + BIAS + CONSTANT
                               + [f"trainer.max_steps={STEPS * (k + 1)}"]))
        if results[-1].returncode != 0:
            break
    return results, read_metrics(os.path.join(workdir, "runs", "default"))


@pytest.mark.parametrize("k", [1, 2], ids=["ep2-to-ep4", "ep4-to-one-process"])
def test_resume_across_expert_parallel_degrees(chain, uninterrupted, k):
    results, records = chain
    assert len(results) > k, f"an earlier job failed:\n{results[-1].stderr[-3000:]}"
    assert results[k].returncode == 0, results[k].stderr[-3000:]
    assert f"at step {STEPS * k}" in results[k].stdout, results[k].stdout[-2000:]
    resumed = [r for r in records if STEPS * k < r["step"] <= STEPS * (k + 1)]
    ref = uninterrupted[STEPS * k:STEPS * (k + 1)]
    assert_parity(ref, resumed)
    aux = max_rel_diff([r["moe_aux_loss"] for r in ref], [r["moe_aux_loss"] for r in resumed])
    assert aux <= 1e-5, aux


def test_an_ep_run_logs_the_balance_losses_the_load_and_the_all_to_all_bytes(chain, uninterrupted):
    _, records = chain
    first = records[0]  # ep 2 on 2 ranks, two MoE blocks
    for key in ("moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_load_h0", "moe_load_h1",
                "comm_all_to_all_bytes", "comm_all_to_all_counts_bytes"):
        assert key in first, sorted(first)
    assert first["moe_load_max"] == max(first["moe_load_h0"], first["moe_load_h1"]) >= 1.0
    assert first["moe_aux_loss"] > 0 and first["comm_all_to_all_bytes"] > 0
    assert abs(first["moe_aux_loss"] - uninterrupted[0]["moe_aux_loss"]) <= 1e-5 * first["moe_aux_loss"]
    assert "comm_all_to_all_bytes" not in uninterrupted[0]  # one process: nothing to send


@pytest.mark.parametrize("nproc,overrides,needle", [
    (2, MOE[:1] + ["model.moe_experts=3", "parallel.ep=2"], "is not divisible by parallel.ep=2"),
    (2, MOE + ["parallel.ep=4"], "parallel.ep=4 does not divide"),
    (2, ["parallel.ep=2"], "needs mixture-of-experts blocks"),
    (2, MOE + ["parallel.ep=2", "parallel.dp=torch_ddp"], "PyTorch's reference would average"),
    (2, MOE + ["parallel.ep=2", "parallel.allreduce=ring"], "parallel.allreduce=ring with"),
    (2, MOE + ["parallel.tp=2", "data.block_size=15"],
     "each TP rank routes its equal share"),
    (1, MOE + ["model.moe_top_k=5"], "must be between 1 and model.moe_experts=4"),
    (1, MOE + ["parallel.ep=0"], "must be >= 1"),
    (1, MOE + BIAS + ["ft.enabled=true", "parallel.timeout_s=120"],
     "would count its own share of the batch"),
    (1, MOE + ["parallel.ep_impl=scatter"], "parallel.ep_impl must be one of"),
], ids=["experts-not-divisible", "ep-beyond-dp", "ep-without-experts", "torch_ddp",
        "ring", "tokens-not-divisible-by-tp", "top-k-beyond-experts", "ep-zero",
        "biases-under-replica-groups", "unknown-exchange"])
def test_a_layout_experts_cannot_run_is_one_line(tmp_path, nproc, overrides, needle):
    result = run_job(tmp_path, nproc, overrides)
    if nproc > 1:
        assert_clean_failure(result, needle)
    else:
        assert_one_error_line(result, needle)


def assert_one_error_line(result, needle):
    """One process: exit status 2 and one line, `error: ...` with the needle."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode == 2 and len(errors) == 1 and needle in errors[0], result.stderr


def test_export_refuses_experts_and_sample_reads_them(tmp_path):
    trained = run_job(tmp_path, 1, ["parallel.dp=single", "trainer.max_steps=2"] + MOE)
    assert trained.returncode == 0, trained.stderr[-3000:]
    export = run_job(tmp_path, 1, ["mode=export", f"export.path={tmp_path / 'hf'}"])
    assert_one_error_line(export, "has no mixture-of-experts blocks")
    assert not os.path.exists(tmp_path / "hf")
    sample = run_job(tmp_path, 1, ["mode=sample", "sample.length=20"])
    assert sample.returncode == 0, sample.stderr[-3000:]
    assert len(sample.stdout.strip()) > 0


def test_the_tiny_preset_trains_with_its_experts_split(tmp_path):
    """configs/moe-tiny.yaml's own keys, sizes scaled down, ep=2 on 2 ranks."""
    preset = "config=" + os.path.join(REPO, "configs", "moe-tiny.yaml")
    scaled = ["model.n_layer=2", "model.n_embd=32", "model.moe_hidden=32", "data.block_size=16",
              "trainer.batch_size=8", "trainer.max_steps=2", "trainer.log_every=1",
              "trainer.eval_every=0", "trainer.save_every=0", "sample.length=0",
              "wandb.mode=disabled", "parallel.ep=2", "trainer.run_dir=runs/moe-tiny",
              "trainer.device=cpu"]
    result = run_job(tmp_path, 2, [preset] + scaled, tiny=False)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "runs" / "moe-tiny")
    assert [r["step"] for r in records] == [1, 2] and records[-1]["moe_load_max"] >= 1.0


def test_the_gpt2_sized_preset_has_gpt2_small_s_active_parameters():
    """configs/gpt2-124m-moe.yaml: GPT-2 small's shape, ~124M active parameters per token
    (the router and 2 of 8 experts in 6 of 12 blocks) of ~209M."""
    from dataclasses import asdict
    import torch
    from config import load_config
    from model import GPT, GPTConfig
    m = load_config(["config=" + os.path.join(REPO, "configs", "gpt2-124m-moe.yaml"),
                     "trainer.grad_accum=5", "parallel.ep=8"], 8).model  # its command line
    with torch.device("meta"):
        model = GPT(GPTConfig(**asdict(m), vocab_size=50257, block_size=1024))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = model.num_params() - experts * (m.moe_experts - m.moe_top_k) // m.moe_experts
    assert (m.n_layer, m.n_head, m.n_embd) == (12, 12, 768)
    assert round(active / 1e6, 1) == 124.5 and round(model.num_params() / 1e6, 1) == 209.5


def test_recompute_runs_in_a_fresh_process(tmp_path):
    """trainer.activation_checkpointing with experts in a new interpreter: the first
    block's forward probes torch._grouped_mm inside the checkpointed region, and the probe's
    own graph must not count as what the block saved (CheckpointError: 49 vs 46 tensors).
    A fresh process: the probe's answer is cached per process."""
    result = run_job(tmp_path, 1, ["parallel.dp=single", "trainer.activation_checkpointing=true",
                                   "trainer.max_steps=2"] + MOE, fresh=True)
    assert result.returncode == 0, result.stderr[-3000:]
