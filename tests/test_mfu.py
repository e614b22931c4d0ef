"""Model FLOPs utilisation (telemetry/mfu.py): 6N + 12LCT FLOPs per token over the device's peak,
from a table keyed by the device's name; absent where the peak is not known (CPU). N counts
the parameters a token meets: in a mixture-of-experts block the router and k of E experts."""

import pytest
import torch

from telemetry import mfu
from model import GPT, GPTConfig


@pytest.mark.parametrize("bias", [True, False])
def test_flops_per_token_counts_every_parameter_but_the_position_embedding(bias):
    shape = dict(n_layer=3, n_head=2, n_embd=32, vocab_size=65, block_size=16, bias=bias)
    n = GPT(GPTConfig(**shape)).num_params() - 16 * 32  # wpe holds no matmul
    assert mfu.flops_per_token(shape) == 6 * n + 12 * 3 * 32 * 16


@pytest.mark.parametrize("every,bias,hidden", [(1, True, 48), (2, False, 0)])
def test_flops_per_token_counts_k_of_the_experts(every, bias, hidden):
    """A mixture-of-experts model (8 experts, top 2): every parameter of the model but the
    position embedding, its experts' weighed k / E (a token meets 2 of the 8), the routers
    whole; not all 8 experts (what its memory holds)."""
    shape = dict(n_layer=4, n_head=2, n_embd=32, vocab_size=65, block_size=16, bias=bias,
                 moe_experts=8, moe_top_k=2, moe_every=every, moe_hidden=hidden)
    gpt = GPT(GPTConfig(**shape))
    active = held = 0
    for name, p in gpt.named_parameters():
        if name != "transformer.wpe.weight":
            held += p.numel()
            active += p.numel() * 2 // 8 if ".mlp.experts." in name else p.numel()
    assert any(".mlp.router." in name for name, _ in gpt.named_parameters())
    assert mfu.active_params(shape) == active < held
    assert mfu.flops_per_token(shape) == 6 * active + 12 * 4 * 32 * 16
    assert mfu.active_params({**shape, "moe_experts": 0}) == \
        GPT(GPTConfig(**{**shape, "moe_experts": 0})).num_params() - 16 * 32  # dense: every one


def test_peak_comes_from_the_device_name_and_precision():
    assert mfu.peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert mfu.peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert mfu.peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert mfu.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert mfu.peak_flops("NVIDIA L40S", "bf16") == 362e12  # not L4's
    assert mfu.peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert mfu.peak_flops("NVIDIA A10G", "bf16") is None
    assert mfu.peak_flops("Some Future GPU", "bf16") is None
    # whole names only: a longer model number, or a variant not listed, gets no peak
    assert mfu.peak_flops("NVIDIA L40", "bf16") is None  # not L4's
    assert mfu.peak_flops("NVIDIA RTX A1000", "bf16") is None  # not A100's
    assert mfu.peak_flops("NVIDIA H100 NVL", "bf16") is None  # not SXM's
    assert mfu.peak_flops("NVIDIA L4", "bf16") == 121e12 and mfu.peak_flops("Tesla T4", "fp16") == 65e12
    assert mfu.device_peak(torch.device("cpu"), "fp32") is None  # never a made-up CPU number
    assert mfu.mfu(1e9, 1e5, 1e15, 2) == pytest.approx(0.05)


def test_cpu_runs_log_no_mfu(tmp_path):
    from harness import run_metrics
    records = run_metrics(tmp_path, 1, ["parallel.dp=single", "trainer.max_steps=2"])
    assert records and all("mfu" not in r and r["tokens_per_s"] > 0 for r in records)


@pytest.mark.parametrize("model", [[], ["model.moe_experts=4", "model.moe_top_k=1"]],
                         ids=["dense", "experts"])
def test_mfu_is_logged_where_the_peak_is_known(one_rank_grid, tmp_path, monkeypatch, capsys, model):
    """The trainer's wiring, with a stand-in peak (this machine has no GPU): the FLOPs of
    the model it trains (with experts: its active parameters)."""
    import main
    from harness import TINY, read_metrics
    monkeypatch.setattr(mfu, "device_peak", lambda device, precision: 1e12)
    cfg = main.load_config(TINY + model + ["parallel.dp=single", "trainer.max_steps=2",
                                           f"trainer.run_dir={tmp_path}"], 1)
    main.train(cfg, one_rank_grid)
    from checkpoint.snapshot_reader import open_snapshot
    gpt = open_snapshot(str(tmp_path / "snapshot")).meta["gpt_config"]
    assert gpt["moe_experts"] == (4 if model else 0)
    for r in read_metrics(tmp_path):
        assert r["mfu"] == pytest.approx(mfu.flops_per_token(gpt) * r["tokens_per_s"] / 1e12)
    assert "| mfu " in capsys.readouterr().out
