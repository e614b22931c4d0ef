"""The step-time model's terms that no comparison with a run can see, each by how it must
move (in process, on the planner's meta census: no process group, well under a second):

- parallel.offload moves AdamW off the device: the device's optimizer time is 0, the
  rest of its compute unchanged, and the host runs AdamW over this rank's shard;
- the compute peak is the precision's: bf16 against fp32 changes the compute time by
  the peaks' ratio (the efficiency model's products and attention, plan.mfu's compute),
  and the MFU a plan reports is over the precision's peak;
- offload's PCIe copies are one shard each way (the reduced gradient down, the updated
  parameters up): doubling the shards halves them.

The FLOP conventions of the published runs are tests/test_published_runs.py's.
"""

import dataclasses
import math

import pytest

from planner.config import PlanConfig
from planner.efficiency import MATMUL_EFF, RAMP_US, attention_seconds, compute_seconds, \
    matmul_seconds
from planner.figures import rank_figures
from planner.machines import PRESETS
from planner.shapes import Layout, Workload
from planner.step_time import host_seconds, rank_params, step_time

H100 = PRESETS["H100-80GB"]
# GPT-2 small's shape (padded vocabulary), 64 sequences: large enough that AdamW's and the
# copies' times are past every launch floor
GPT2 = dict(n_layer=12, n_head=12, n_embd=768, vocab=50304, block=1024, batch=64)


def model_parameters(w: Workload) -> int:
    """The GPT's own parameter count (the model on the meta device; tied head counted once)."""
    from model import GPT, GPTConfig, shapes_only
    with shapes_only():
        gpt = GPT(GPTConfig(n_layer=w.n_layer, n_head=w.n_head, n_embd=w.n_embd, bias=w.bias,
                            vocab_size=w.vocab, block_size=w.block, dropout=0.0))
    return sum(p.numel() for p in gpt.parameters())


def model_flops(w: Workload) -> float:
    """The step's model FLOPs by telemetry/mfu.py's count (what a run's MFU uses)."""
    from telemetry.mfu import flops_per_token
    gpt = {"n_embd": w.n_embd, "n_layer": w.n_layer, "block_size": w.block,
           "vocab_size": w.vocab, "bias": w.bias}
    return flops_per_token(gpt) * w.batch * w.block


@pytest.mark.parametrize("stage_", [1, 2, 3])
def test_offload_moves_the_optimizers_time_off_the_device(stage_):
    """fsdp on 8 ranks, with and without parallel.offload: the device's compute loses
    exactly its AdamW time (and nothing else), which was > 0; the host's part is AdamW's
    28 bytes an element of this rank's shard (about the model's parameters / 8) at host
    memory speed (PCIe made free to see it alone)."""
    w = Workload(**GPT2, precision="bf16")
    on, off = (Layout(dp_kind="fsdp", zero_stage=stage_, dp=8, offload=o) for o in (True, False))
    params = rank_params(w, off, 0, 0)
    device_on, device_off = (compute_seconds(w, L, 0, H100, params) for L in (on, off))
    print(f"fsdp{stage_}: device optimizer {device_off['optimizer'] * 1e3:.4f} ms without offload, "
          f"{device_on['optimizer'] * 1e3:.4f} ms with")
    assert device_off["optimizer"] > 0 and device_on["optimizer"] == 0, (device_on, device_off)
    assert {k: v for k, v in device_on.items() if k != "optimizer"} == \
        {k: v for k, v in device_off.items() if k != "optimizer"}
    pcfg = PlanConfig(gpus_per_node=8)
    t_on, t_off = (step_time(w, L, rank_figures(w, L)["fullest"], H100, pcfg) for L in (on, off))
    assert math.isclose(t_off["compute"] - t_on["compute"], 1e3 * device_off["optimizer"],
                        rel_tol=1e-9), (t_on, t_off)
    assert t_off["host"] == 0 and t_on["host"] > 0
    no_copies = dataclasses.replace(H100, pcie_gbps=math.inf)
    adamw = host_seconds(w, on, rank_figures(w, on)["fullest"], no_copies)
    expected = 28 * model_parameters(w) / 8 / (H100.host_gbps * 1e9)
    print(f"fsdp{stage_}: host AdamW {adamw * 1e3:.4f} ms, 28 B x parameters / 8 at "
          f"{H100.host_gbps} GB/s: {expected * 1e3:.4f} ms")
    assert math.isclose(adamw, expected, rel_tol=1e-3), (adamw, expected)


@pytest.mark.parametrize("stage_", [1, 2, 3])
def test_offload_copies_a_shard_each_way_so_twice_the_shards_halve_them(stage_):
    """host_seconds' PCIe copies (the host's AdamW made free to see them alone): the
    reduced gradient shard down and the updated shard up, 2 x 4 bytes x parameters / N
    per step; from 4 to 8 shards they halve (a copy of the whole reduced gradient, not
    divided by the shards, would shrink by 5/9 x 2 = 1.11 only)."""
    w = Workload(**GPT2, precision="bf16")
    no_adamw = dataclasses.replace(H100, host_gbps=math.inf)
    seconds = {}
    for n in (4, 8):
        L = Layout(dp_kind="fsdp", zero_stage=stage_, dp=n, offload=True)
        seconds[n] = host_seconds(w, L, rank_figures(w, L)["fullest"], no_adamw)
        expected = 2 * 4 * model_parameters(w) / n / (H100.pcie_gbps * 1e9)
        print(f"fsdp{stage_} {n} shards: copies {seconds[n] * 1e3:.4f} ms, "
              f"2 x 4 B x parameters / {n}: {expected * 1e3:.4f} ms")
        assert math.isclose(seconds[n], expected, rel_tol=1e-3), (n, seconds[n], expected)
    assert math.isclose(seconds[4] / seconds[8], 2, rel_tol=1e-3), seconds


def test_compute_time_moves_by_the_ratio_of_the_precisions_peaks():
    """bf16 against fp32 on an H100 (989 and 67 TFLOP/s): a large product's time beyond
    its ramp, and fused attention's, change by the peaks' ratio; with plan.mfu set, the
    step's compute is the model's FLOPs over the world at that share of the precision's
    peak; and the reported MFU is over the precision's peak, never above 1."""
    peaks = H100.peak
    ratio = peaks["bf16"] / peaks["fp32"]
    bf16, fp32 = (Workload(**GPT2, precision=p) for p in ("bf16", "fp32"))
    product = {w.precision: matmul_seconds(8192, 8192, 8192, w, H100) - RAMP_US * 1e-6
               for w in (bf16, fp32)}
    assert math.isclose(product["fp32"] / product["bf16"], ratio, rel_tol=1e-9), product
    assert math.isclose(product["bf16"], 2 * 8192 ** 3 / (peaks["bf16"] * MATMUL_EFF), rel_tol=1e-9)
    L = Layout()
    attention = {w.precision: attention_seconds(w, L, 8, 1024, 1, True, H100) for w in (bf16, fp32)}
    assert math.isclose(attention["fp32"] / attention["bf16"], ratio, rel_tol=1e-9), attention
    L = Layout(dp_kind="ddp_bucket", dp=8)
    for mfu in (0.0, 0.4):
        pcfg = PlanConfig(gpus_per_node=8, mfu=mfu)
        t = {w.precision: step_time(w, L, rank_figures(w, L)["fullest"], H100, pcfg)
             for w in (bf16, fp32)}
        for precision, got in t.items():
            own = model_flops(bf16) / (got["step_ms"] / 1e3 * 8 * peaks[precision])
            print(f"plan.mfu={mfu} {precision}: compute {got['compute']:.3f} ms, step "
                  f"{got['step_ms']:.3f} ms, MFU {got['mfu']:.4f} (own count {own:.4f})")
            assert math.isclose(got["mfu"], own, rel_tol=1e-9) and 0 < got["mfu"] <= 1, got
            if mfu:
                compute_ms = 1e3 * model_flops(bf16) / 8 / (peaks[precision] * mfu)
                assert math.isclose(got["compute"], compute_ms, rel_tol=1e-9), (precision, got)
        if mfu:
            assert math.isclose(t["fp32"]["compute"] / t["bf16"]["compute"], ratio, rel_tol=1e-9)
