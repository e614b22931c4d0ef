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
from planner.efficiency import RAMP_US, attention_seconds, compute_seconds, matmul_eff, \
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
    assert math.isclose(product["bf16"], 2 * 8192 ** 3 / (peaks["bf16"] * matmul_eff(H100)),
                        rel_tol=1e-9)
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


def _given(*keys):
    """`mode=plan plan.search=false` on GPT-2 small's shape, 8 A100s, in process: (row, printout)."""
    import contextlib
    import io
    import os
    from config import load_config
    from harness import REPO
    from planner.report import plan
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        row = plan(load_config(["config=" + os.path.join(REPO, "configs", "gpt2-124m.yaml"),
                                "mode=plan", "plan.search=false", "plan.gpu=A100-80GB",
                                "trainer.precision=bf16", "trainer.batch_size=64",
                                "trainer.grad_accum=1", "parallel.dp=ddp_bucket", *keys], 1))
    return row, out.getvalue()


def test_search_false_prices_the_configured_recompute_mode():
    """plan.search=false takes trainer.activation_checkpointing_mode and _every (issue 53:
    they were dropped, every recompute priced and printed as full): selective, and full on
    every 2nd block, cost less compute than full and more than none; the printed layout
    names the mode; the activations saved order the other way."""
    runs = {}
    for name, keys in {"none": ["trainer.activation_checkpointing=false"],
                       "full": ["trainer.activation_checkpointing=true"],
                       "selective": ["trainer.activation_checkpointing=true",
                                     "trainer.activation_checkpointing_mode=selective"],
                       "every2": ["trainer.activation_checkpointing=true",
                                  "trainer.activation_checkpointing_every=2"]}.items():
        runs[name] = _given(*keys)
    compute = {k: row["time"]["compute"] for k, (row, _) in runs.items()}
    acts = {k: row["fig"]["activation_bytes"] for k, (row, _) in runs.items()}
    print(compute, acts)
    assert compute["none"] < compute["selective"] < compute["full"], compute
    assert compute["none"] < compute["every2"] < compute["full"], compute
    assert acts["full"] < acts["every2"] < acts["none"] and acts["selective"] < acts["none"], acts
    assert "ckpt full on 8 GPUs" in runs["full"][1]
    assert "ckpt selective on 8 GPUs" in runs["selective"][1]
    assert "ckpt full every2 on 8 GPUs" in runs["every2"][1]


def test_the_search_tries_selective_and_every_n_recompute(tmp_path):
    """Where a layout does not fit in one pass, the search tries it with full, selective,
    full on every 2nd and selective on every 2nd block recomputed (layouts.RECOMPUTE_CHOICES),
    each at the smallest grad_accum that fits; where it fits in one pass, none (they only
    add compute). 4 x 128 on 2 GPUs of 0.02 GB: plan.out holds all four modes."""
    import json
    from config import load_config
    from planner.layouts import RECOMPUTE_CHOICES
    from planner.report import plan
    out = tmp_path / "plan.json"
    plan(load_config(["mode=plan", "plan.nodes=1", "plan.gpus_per_node=2", "plan.gpu=A100-80GB",
                      "plan.gpu_memory_gb=0.025", "trainer.batch_size=64", f"plan.out={out}"], 1))
    items = json.loads(out.read_text())
    modes = {(o.get("trainer.activation_checkpointing_mode", "full"),
              o.get("trainer.activation_checkpointing_every", 1))
             for o in items if o["trainer.activation_checkpointing"]}
    print(sorted(modes), len(items))
    assert modes == set(RECOMPUTE_CHOICES), modes
    plain = {o["layout"]: o for o in items if not o["trainer.activation_checkpointing"]}
    for o in items:
        if o["trainer.activation_checkpointing"]:
            base = o["layout"].split(" ckpt")[0]
            base = " ".join(w for w in base.split() if not w.startswith("ga"))
            assert any(" ".join(w for w in k.split() if not w.startswith("ga")) == base
                       and (v["trainer.grad_accum"] > 1 or not v["fits"]) for k, v in plain.items()), o["layout"]


LLAMA_8B = dict(n_layer=32, n_head=32, n_embd=4096, vocab=128256, block=8192, batch=16,
                precision="bf16", bias=False, kv_heads=8, ffn_hidden=14336, gated=True, untied=True)


def test_another_systems_block_is_counted_as_its_parameters():
    """plan.kv_heads / ffn_hidden / gated_ffn / untied_head (replaying Llama 3.1 8B): the
    census holds its 8,030,261,248 parameters (Meta's model card) plus GPT-2's learned
    positions (8,192 x 4,096: RoPE is not modelled), every rank's share under TP sums to
    them, and the MFU's FLOPs count the head once (the untied embedding is a lookup)."""
    from planner.census import census
    w = Workload(**LLAMA_8B)
    total = sum(q.numel for q in census(w.shape, 1))
    assert total == 8_030_261_248 + 8192 * 4096, total
    split = census(w.shape, 8)
    assert sum(q.numel for q in split if q.replicated) + 8 * sum(
        q.numel for q in split if not q.replicated) == total
    n_flops = w.flops_per_token() - 12 * 32 * 4096 * 8192
    assert n_flops == 6 * (total - 8192 * 4096 - 128256 * 4096), n_flops


def test_the_cp_ring_moves_keys_and_values_at_their_own_width():
    """Context parallelism exchanges K and V around the ring: their width is K/V heads x
    head size, so 8 K/V heads of 32 move a quarter of the bytes (and time) of 32; the
    model's own width (GPT-2: K/V heads = heads) is the same as before."""
    from planner.traffic import comm_by_dim
    mha = Workload(**dict(LLAMA_8B, kv_heads=0, untied=False))
    gqa = Workload(**dict(LLAMA_8B, untied=False))
    L = Layout(dp_kind="fsdp", zero_stage=3, dp=2, cp=4)
    sent = {w.kv_heads: comm_by_dim(w, L, 0, 0)[("cp", "send")] for w in (mha, gqa)}
    assert sent[8] * 4 == sent[0], sent
    pcfg = PlanConfig(gpus_per_node=8)
    t = {w.kv_heads: step_time(w, L, rank_figures(w, L)["fullest"], H100, pcfg)["cp"] for w in (mha, gqa)}
    assert 0 < t[8] < t[0] / 3, t


@pytest.mark.parametrize("keys,message", [
    (["plan.untied_head=true", "parallel.pp=2"], "plan.untied_head is not modelled under a pipeline"),
    (["plan.kv_heads=3"], "plan.kv_heads=3 must divide model.n_head=4"),
    (["plan.gated_ffn=true", "model.moe_experts=4"], "replay dense blocks only"),
])
def test_what_the_block_keys_cannot_express_is_refused_in_one_line(keys, message):
    from config import load_config
    from errors import UserError
    from planner.report import plan
    with pytest.raises(UserError, match=message):
        plan(load_config(["mode=plan", "plan.search=false", *keys], 1))


def test_the_dry_run_refuses_another_systems_block():
    """model.py builds GPT-2's block only: mode=dryrun with plan.kv_heads (or the other
    replay keys) is one line, not a step of a model that is not the one planned."""
    from config import load_config
    from errors import UserError
    from planner.dryrun import dryrun
    with pytest.raises(UserError, match="another system's block, which model.py does not build"):
        dryrun(load_config(["mode=dryrun", "plan.kv_heads=2"], 1))


def _exposed_dp(nics, tp, gpu="A100-80GB", G=8):
    """The exposed data-parallel time (ms) of GPT-2 small on 2 nodes of G, ZeRO-1: its
    parameter all-gather after the step (its reduce-scatter hides behind the backward of
    64 sequences a rank), with `nics` network cards a node; the hops' latencies made
    negligible, to see the bandwidth alone."""
    w = Workload(**dict(GPT2, batch=1024 // tp), precision="bf16")
    L = Layout(dp_kind="fsdp", zero_stage=1, dp=16 // tp, tp=tp)
    pcfg = PlanConfig(gpus_per_node=G, nics_per_node=nics)
    from planner.machines import machine
    m = machine(PlanConfig(gpu=gpu, nics_per_node=nics, inter_latency_us=1e-6,
                           intra_latency_us=1e-6))
    return step_time(w, L, rank_figures(w, L)["fullest"], m, pcfg)["dp"]


def test_a_cross_node_group_drives_as_many_network_cards_as_it_has_ranks_on_a_node():
    """NCCL runs one ring per network card: a tp = 1 data-parallel group with 8 ranks on
    each of 2 A100 nodes drives the node's cards, so doubling them (4 -> 8, both under the
    NVLink the ring also crosses) halves its exposed cross-node time; with tp = 8 each
    node's 8 data-parallel groups (1 rank a node each) share the cards, one each; a node's
    cards past NVLink's speed buy nothing (H100: 8 x 50 GB/s x 0.9 = NVLink's 450 x 0.8)."""
    four, eight = _exposed_dp(4, 1), _exposed_dp(8, 1)
    print(f"tp1 dp16 across 2 A100 nodes: exposed dp {four:.3f} ms with 4 cards, {eight:.3f} with 8")
    assert four > 0 and abs(four / eight - 2) < 0.03, (four, eight)
    # the old model's one card a GPU: 8 ranks of the group on a node are ~8 x faster than 1
    from planner.machines import PRESETS
    from planner.step_time import _link
    a100 = PRESETS["A100-80GB"]
    one_rank = _link(Layout(dp_kind="fsdp", zero_stage=1, dp=2, tp=8), "dp", a100, 8)
    all_eight = _link(Layout(dp_kind="fsdp", zero_stage=1, dp=16), "dp", a100, 8)
    assert math.isclose(all_eight[0] * all_eight[2], 8 * one_rank[0] * one_rank[2], rel_tol=1e-9)
    h100_8, h100_16 = _exposed_dp(8, 1, "H100-80GB"), _exposed_dp(16, 1, "H100-80GB")
    assert math.isclose(h100_8, h100_16, rel_tol=1e-9), (h100_8, h100_16)


def _mfu(gpu, stack="eager", **shape):
    """The MFU `mode=plan plan.search=false` predicts for one shape on 8 GPUs of `gpu`
    (ZeRO-3, one node, bf16; its gathers hide behind compute)."""
    from planner.machines import PRESETS
    w = Workload(**{**GPT2, **shape}, precision="bf16")
    L = Layout(dp_kind="fsdp", zero_stage=3, dp=8)
    pcfg = PlanConfig(gpus_per_node=8, stack=stack)
    return step_time(w, L, rank_figures(w, L)["fullest"], PRESETS[gpu], pcfg)["mfu"]


def test_an_h100_runs_the_same_shape_at_a_lower_mfu_than_an_a100():
    """Per GPU generation (efficiency.MATMUL_EFF, FA2_FWD_EFF; machines' HBM): the H100's
    peak is 3.17 x the A100's, but its products reach a smaller share of it (MAMF 80.3%
    against 86.9%), FlashAttention-2 35% against 50%, and its memory is only 1.64 x
    faster: the same shape runs at a lower MFU than on an A100 (llm-foundry's MPT-7B at
    2048 tokens on 8 GPUs measured 64.2% on A100s, 46.4% on H100s), for every stack."""
    for stack in ("fused", "compiled", "eager"):
        for shape in (dict(n_layer=32, n_head=32, n_embd=4096, block=2048, batch=48),
                      dict(block=1024, batch=64)):
            a100, h100 = _mfu("A100-80GB", stack, **shape), _mfu("H100-80GB", stack, **shape)
            print(f"{stack} {shape.get('n_embd', 768)} wide: MFU A100 {a100:.3f}, H100 {h100:.3f}")
            assert h100 < 0.9 * a100, (stack, shape, a100, h100)


def test_attentions_backward_is_priced_below_its_forwards_rate():
    """Fused causal attention (FlashAttention-2): forward at FA2_FWD_EFF of the peak (A100
    50%, H100 35%), the backward's 2.5 x FLOPs at ATTN_BWD_RATIO (0.66) of that rate, so
    the backward takes 2.5 / 0.66 = 3.8 x the forward's time, not 2.5 x; recomputing the
    forward (full checkpointing) adds one forward."""
    from planner.efficiency import ATTN_BWD_RATIO, FA2_FWD_EFF
    from planner.machines import PRESETS
    w = Workload(**dict(GPT2, block=8192, batch=8), precision="bf16")
    L = Layout()
    for name in ("A100-80GB", "H100-80GB"):
        m = PRESETS[name]
        once, twice = (attention_seconds(w, L, 1, 8192, fwd, True, m) for fwd in (1, 2))
        forward = twice - once
        backward = once - forward
        flops = 2 * 12 * 8192 * 8192 * 64  # one sequence, 12 heads of 64: causal 2 h s^2 d
        assert math.isclose(forward, flops / (m.peak["bf16"] * FA2_FWD_EFF[m.generation]), rel_tol=1e-9)
        assert math.isclose(backward / forward, 2.5 / ATTN_BWD_RATIO, rel_tol=1e-9), name
    assert FA2_FWD_EFF["hopper"] < FA2_FWD_EFF["ampere"]


def test_eager_pytorch_moves_more_bytes_than_fused_kernels_and_small_widths_feel_it_most():
    """plan.stack: eager PyTorch's element-wise ops each read and write their tensors
    (LayerNorm in fp32, the casts, fp32 residual adds, the loss's upcast and log-softmax),
    fused and compiled kernels once: eager moves more bytes a token and is slower; the
    gap is widest where element-wise work and the loss weigh most against the products,
    at small widths (768 against 4096 wide)."""
    from planner.efficiency import elementwise_bytes, loss_bytes
    w = Workload(**GPT2, precision="bf16")
    fused, eager = elementwise_bytes(w, "fused"), elementwise_bytes(w, "eager")
    assert sum(eager) > 1.2 * sum(fused) and elementwise_bytes(w, "compiled") == fused
    assert loss_bytes(w) == 36 and loss_bytes(dataclasses.replace(w, loss="fused")) == 12
    gap = {}
    for width, heads in ((768, 12), (4096, 32)):
        shape = dict(n_embd=width, n_head=heads, block=2048, batch=64)
        gap[width] = _mfu("A100-80GB", "fused", **shape) / _mfu("A100-80GB", "eager", **shape)
        assert _mfu("A100-80GB", "compiled", **shape) == _mfu("A100-80GB", "fused", **shape)
    print(f"fused / eager MFU: {gap}")
    assert gap[768] > gap[4096] > 1.0, gap


def test_a_bf16_models_residual_stream_and_a_fused_losss_logits_are_two_bytes():
    """Memory (issue 53, item 6: runs that ran on 80 GB were predicted at 86-89 GB):
    this product keeps fp32 parameters under autocast, so its residual stream and its
    loss's log-softmax are fp32; a bf16 model (plan.param_gather_bytes=2: FSDP's
    param_dtype, Megatron's bf16 parameters) keeps the residual stream, the LayerNorms'
    inputs and ZeRO-3's gathered units in bf16, and a fused loss kernel (flash-attn's,
    Megatron's, llm.c's) keeps the logits and writes their gradient in bf16: each term
    halves, and nothing else moves."""
    from planner.memory import end_activations, memory_need
    from planner.shapes import logit_bytes, res_bytes
    w = Workload(**GPT2, precision="bf16")
    L = Layout(dp_kind="fsdp", zero_stage=3, dp=8)
    bf16 = dataclasses.replace(w, model_bytes=2)
    fused = dataclasses.replace(w, loss="fused")
    assert (res_bytes(w), res_bytes(bf16), logit_bytes(w), logit_bytes(fused)) == (4, 2, 4, 2)
    rows, n, V = 8, 8 * 1024, 50304
    logits = end_activations(w, L, rows, False, True) - end_activations(fused, L, rows, False, True)
    assert logits == n * V * 2, logits  # the saved log-softmax, fp32 -> the logits, bf16
    need = {k: memory_need(x, L, rank_figures(x, L)["fullest"]) for k, x in
            (("fp32 model", w), ("bf16 model", bf16), ("fused loss", fused))}
    print({k: round(v / 1e9, 2) for k, v in need.items()})
    assert need["fused loss"] == need["fp32 model"] - 2 * n * V * 2  # saved and gradient, halved
    assert need["bf16 model"] < need["fp32 model"]


def test_the_search_chooses_interleaveds_virtual_stages(tmp_path):
    """Interleaved 1F1B's virtual stages are a searched choice (layouts.SCHEDULE_CHOICES:
    2, 3 and 4 chunks a rank, where parallel/layout.py's rules let the blocks split so):
    12 blocks on 2 pipeline ranks get all three, and more chunks a rank shrink the
    simulator's bubble at the same micro-batches."""
    import json
    from config import load_config
    from planner.report import plan
    from planner.step_time import bubble
    out = tmp_path / "plan.json"
    plan(load_config(["mode=plan", "plan.nodes=1", "plan.gpus_per_node=2", "model.n_layer=12",
                      "trainer.batch_size=16", f"plan.out={out}"], 1))
    Vs = {o["parallel.pp_virtual_stages"] for o in json.loads(out.read_text())
          if o.get("parallel.pp_schedule") == "interleaved"}
    assert Vs == {2, 3, 4}, Vs
    assert bubble("interleaved", 2, 4, 4) < bubble("interleaved", 2, 4, 3) < bubble("interleaved", 2, 4, 2)


def test_a_prediction_is_printed_with_the_spread_of_its_kind_on_published_runs():
    """mode=plan states its uncertainty: beside the step, the range the published runs of
    its kind (GPU generation and stack: planner/residuals.py) put around it, the step over
    their highest and lowest predicted / published ratios; a GPU without published runs
    or measured efficiencies says so in one line."""
    import re
    from planner.residuals import BANDS
    row, text = _given("trainer.activation_checkpointing=false")
    lo, hi, runs = BANDS[("ampere", "eager")]
    ms = row["time"]["step_ms"]
    line = next(ln for ln in text.splitlines() if ln.startswith("step "))
    print(line)
    got = re.search(r"likely ([\d.]+)-([\d.]+) ms \(published runs of this kind \(A100s, eager "
                    rf"kernels, {runs} runs\) were predicted at {lo:.2f}-{hi:.2f}x", line)
    assert got and math.isclose(float(got.group(1)), ms / hi, rel_tol=1e-3) \
        and math.isclose(float(got.group(2)), ms / lo, rel_tol=1e-3), line
    _, l4 = _given("plan.gpu=L4", "plan.gpu_memory_gb=80")
    assert "no published run of this kind" in l4 and "L4: no published efficiency" in l4
