"""The planner (mode=plan) and the dry run (mode=dryrun) on mixture-of-experts models
(model.moe_experts, parallel.ep), in process, no process group but the fake backend's:

- the plan searches parallel.ep (each divisor of the experts that divides dp x cp, under
  ddp_bucket and fsdp), prints ep and the all-to-all's milliseconds as columns and the
  imbalance it assumes, and writes `comm_all_to_all_bytes` (4 x N x k x C x 4 bytes a
  block and micro-batch in fp32) and `moe_imbalance` to plan.out;
- its MFU counts k of the E experts (telemetry/mfu.py's active parameters);
- expert state per rank: the experts' parameters, gradients and AdamW state divided by ep
  (ddp_bucket), and by the expert shard group under ZeRO;
- the all-to-all's time: at the link of the ep group (NVLink when it fits a node, else
  the network), the busiest rank's: MOE_IMBALANCE x the even split's;
- an MoE block's saved activations equal the activation meter's (one process);
- every collective kind a dry-run rank counts (parallel/comm.py, under the fake backend,
  with the even split of the routed rows) equals the planner's bytes, exactly.

Real runs (gloo, 2 and 4 ranks, uneven routing) are tests/test_planner.py's (planner_worker's
`ep` cases); a dry run at full size (64 x 8) is tests/test_dryrun.py's.
"""

import json
import math
import os
import re

import pytest

from harness import REPO
from planner.config import PlanConfig
from planner.efficiency import MOE_IMBALANCE, collective_seconds
from planner.figures import rank_figures
from planner.machines import PRESETS
from planner.memory import activation_bytes, state_bytes
from planner.shapes import Layout, Workload
from planner.step_time import model_flops, step_time
from planner.traffic import comm_by_dim, comm_bytes

H100 = PRESETS["H100-80GB"]
SMALL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "data.block_size=16",
         "trainer.batch_size=64", "model.moe_hidden=48"]


def moe_workload(**more):
    shape = dict(n_layer=4, n_head=4, n_embd=64, vocab=96, block=32, batch=64, experts=8, top_k=2,
                 hidden=96)
    return Workload(**{**shape, **more})


def expert_numel(w: Workload) -> int:
    """The experts' parameters of the whole model, counted on the model itself."""
    from model import GPT, GPTConfig, shapes_only
    with shapes_only():
        gpt = GPT(GPTConfig(n_layer=w.n_layer, n_head=w.n_head, n_embd=w.n_embd, vocab_size=w.vocab,
                            block_size=w.block, moe_experts=w.experts, moe_top_k=w.top_k,
                            moe_hidden=w.hidden, moe_every=w.every))
    return sum(p.numel() for n, p in gpt.named_parameters() if ".mlp.experts." in n)


def test_the_plan_searches_ep_and_states_the_all_to_all(tmp_path, capsys):
    """8 experts, top 2, on 8 GPUs: plan.out holds layouts of every ep dividing 8 under
    ddp_bucket and fsdp 1-3, each ep > 1 one with the all-to-all's bytes (rank 0's even
    split: 4 x N x k x C x 4 per MoE block and micro-batch) and the imbalance; the table
    has the ep and all-to-all columns; a dense model's plan has neither."""
    from config import load_config
    from planner.report import plan
    out = tmp_path / "plan.json"
    plan(load_config(["mode=plan", "model.moe_experts=8", "model.moe_top_k=2", "plan.nodes=1",
                      "plan.gpus_per_node=8", "plan.top=40", f"plan.out={out}"], 1))
    text = capsys.readouterr().out
    print(text)
    items = json.loads(out.read_text())
    eps = {(o["parallel.dp"], o.get("parallel.zero_stage"), o.get("parallel.ep", 1)) for o in items}
    for kind, stage in (("ddp_bucket", None), ("fsdp", 1), ("fsdp", 2), ("fsdp", 3)):
        assert {e for k, s, e in eps if (k, s) == (kind, stage)} == {1, 2, 4, 8}, (kind, stage)
    assert all(o["parallel.dp"] in ("ddp_bucket", "fsdp") for o in items if o.get("parallel.ep"))
    C, k, blocks, T = 128, 2, 4, 128  # the default model: 4 blocks x 128, 128 tokens
    for o in items:
        dp = 8 // (o["parallel.tp"] * o["parallel.pp"] * o["parallel.cp"])
        micro = o["trainer.grad_accum"] * o.get("parallel.microbatches", 1)
        N = 32 // (dp * micro) * (T // o["parallel.cp"]) // o["parallel.tp"]  # tokens a TP rank routes
        forwards = 2 if o["trainer.activation_checkpointing"] else 1  # the recompute's exchange
        expected = (2 + 2 * forwards) * N * k * C * 4 * blocks // o["parallel.pp"] * micro
        assert o.get("comm_all_to_all_bytes", 0) == (expected if o.get("parallel.ep") else 0), o
        assert ("moe_imbalance" in o) == ("parallel.ep" in o)
        if o.get("parallel.ep") and "step_ms" in o:
            assert o["moe_imbalance"] == MOE_IMBALANCE and o["step_ms_parts"]["ep"] > 0
    assert re.search(r"the busiest ep rank takes 1\.25 x the even split", text)
    head = next(ln for ln in text.splitlines() if ln.split()[:2] == ["rank", "layout"])
    assert re.search(r"MFU +ep +a2a ms +state GB", head), head
    rows = [re.split(r"\s{2,}", ln.strip()) for ln in text.splitlines() if re.match(r"\s+\d+\s{2}", ln)]
    # rank, layout, step ms, likely ms, MFU, ep, a2a ms, ...
    assert any(" ep" in r[1] and float(r[6]) > 0 for r in rows), "no ep layout in the table"
    for r in rows:  # the ep column is the layout's
        assert r[5] == (re.search(r" ep(\d+)", r[1]) or [None, "1"])[1], r
    dense = tmp_path / "dense.json"
    capsys.readouterr()
    plan(load_config(["mode=plan", "plan.nodes=1", "plan.gpus_per_node=8", "plan.top=3",
                      f"plan.out={dense}"], 1))
    assert "a2a ms" not in capsys.readouterr().out
    assert not any("parallel.ep" in o or "comm_all_to_all_bytes" in o
                   for o in json.loads(dense.read_text()))


def test_the_plans_mfu_counts_k_of_the_experts():
    """The step's model FLOPs: 6 x the parameters a token meets (the router, k of E experts)
    + attention, per token: fewer than with all E experts counted, as many as a dense
    model whose MLP is k experts wide plus the router."""
    from telemetry.mfu import active_params, flops_per_token
    w = moe_workload()
    tokens = w.batch * w.block
    assert model_flops(w) == flops_per_token(w.gpt_config()) * tokens
    every = active_params({**w.gpt_config(), "moe_top_k": w.experts})  # all experts counted
    C, E, k, H, L = w.n_embd, w.experts, w.top_k, w.hidden, w.n_layer
    assert every - active_params(w.gpt_config()) == L * (E - k) * (2 * C * H + H + C)
    L_ = Layout(dp_kind="ddp_bucket", dp=8)
    t = step_time(w, L_, rank_figures(w, L_)["fullest"], H100, PlanConfig(gpus_per_node=8))
    assert math.isclose(t["mfu"], model_flops(w) / (t["step_ms"] / 1e3 * 8 * H100.peak["fp32"]))


@pytest.mark.parametrize("kind,stage", [("ddp_bucket", 0), ("fsdp", 1), ("fsdp", 2), ("fsdp", 3)])
def test_expert_state_is_divided_by_ep(kind, stage):
    """On 8 ranks, ep 1 -> 2 -> 4 -> 8: ddp_bucket's state loses 16 bytes (parameter,
    gradient, two moments) for each expert element no longer held: all but 1/ep of them;
    under ZeRO the experts' shard over N / ep ranks holds as many elements as before (and
    the dense part is unchanged), ZeRO-1's full parameters and gradients of the experts
    (8 bytes an element) are divided by ep."""
    w = moe_workload()
    experts = expert_numel(w)
    base = {ep: state_bytes(w, Layout(kind, stage, dp=8, ep=ep), 0, 0) for ep in (1, 2, 4, 8)}
    print(kind, stage, base)
    for ep in (2, 4, 8):
        dropped = experts - experts // ep
        if kind == "ddp_bucket":
            assert base[1] - base[ep] == 16 * dropped, (ep, base)
        elif stage == 1:
            assert abs(base[1] - base[ep] - 8 * dropped) <= 64 * 8, (ep, base)  # padding, steps
        elif stage == 2:
            assert abs(base[1] - base[ep] - 4 * dropped) <= 64 * 8, (ep, base)
        else:
            assert abs(base[1] - base[ep]) <= 64 * 8, (ep, base)


def test_the_all_to_all_takes_the_ep_groups_link_and_the_imbalance():
    """ep 8 on 8 GPUs a node: the all-to-all's part is MOE_IMBALANCE x its collectives over
    NVLink (the group fits a node); with 4 GPUs a node the same group spans 2 nodes and
    pays the network's bandwidth and latency instead: each GPU's share of the node's
    network cards (an all-to-all's sends leave through the sender's own)."""
    from planner.efficiency import LINK_EFF, NET_EFF
    w = moe_workload(batch=256)
    L = Layout("ddp_bucket", dp=8, ep=8)
    fig = rank_figures(w, L)["fullest"]
    by_dim = comm_by_dim(w, L, 0, 0)
    moe, passes = 4, 1
    from planner.step_time import nic_share
    for G, gbps, latency, eff in ((8, H100.intra_node_gbps, H100.intra_latency_us, LINK_EFF),
                                  (4, nic_share(H100, 4), H100.inter_latency_us, NET_EFF)):
        t = step_time(w, L, fig, H100, PlanConfig(gpus_per_node=G))
        seconds = collective_seconds("all_to_all", by_dim["ep", "all_to_all"], 8, 4 * passes * moe,
                                     gbps, latency, eff) \
            + collective_seconds("all_to_all_counts", by_dim["ep", "all_to_all_counts"], 8,
                                 passes * moe, gbps, latency, eff)
        print(f"{G} GPUs a node: all-to-all {t['ep']:.4f} ms")
        assert math.isclose(t["ep"], 1e3 * MOE_IMBALANCE * seconds, rel_tol=1e-9), (G, t["ep"])
    near = step_time(w, L, fig, H100, PlanConfig(gpus_per_node=8))["ep"]
    far = step_time(w, L, fig, H100, PlanConfig(gpus_per_node=4))["ep"]
    assert far > 3 * near


@pytest.mark.parametrize("experts,top_k,hidden,every,bias", [
    (4, 2, 48, 1, True), (8, 1, 0, 1, True), (16, 4, 32, 2, False)])
def test_moe_activations_equal_the_meters(experts, top_k, hidden, every, bias):
    """One process (`single`, fp32): a model with MoE blocks, its state exactly and its
    saved activations within 1% of the activation meter's peak."""
    import torch
    from dp_worker import OneRank
    from model import GPT, GPTConfig
    from parallel.config import ParallelConfig
    from parallel.parallelize import parallelize
    from telemetry.activation_meter import ActivationMeter
    from training.config import TrainerConfig
    torch.manual_seed(0)
    moe = dict(moe_experts=experts, moe_top_k=top_k, moe_hidden=hidden, moe_every=every)
    gpt = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=65, block_size=16, bias=bias, **moe))
    strategy = parallelize(gpt, OneRank(), ParallelConfig(dp="single"))
    tcfg = TrainerConfig()
    strategy.configure_compute(tcfg)
    strategy.configure_optimizer(tcfg)
    data = torch.randint(0, 65, (16, 17))
    meter = ActivationMeter()
    with meter:
        strategy.forward_backward([(data[:, :-1], data[:, 1:])])
    strategy.optimizer_step(1e-3)
    w = Workload(n_layer=2, n_head=4, n_embd=32, vocab=65, block=16, batch=16, bias=bias,
                 experts=experts, top_k=top_k, hidden=hidden, every=every)
    planned = activation_bytes(w, Layout(), 0)
    print(f"planned {planned}, measured {meter.peak_bytes} ({planned / meter.peak_bytes:.4f}x)")
    assert state_bytes(w, Layout(), 0, 0) == strategy.last_state_bytes
    assert abs(planned / meter.peak_bytes - 1) <= 0.01


@pytest.mark.parametrize("layout", [
    ["parallel.dp=ddp_bucket", "parallel.ep=4"],
    ["parallel.dp=fsdp", "parallel.zero_stage=3", "parallel.ep=2", "parallel.tp=2",
     "trainer.grad_accum=2"],
    ["parallel.dp=fsdp", "parallel.zero_stage=1", "parallel.ep=4", "parallel.cp=2",
     "parallel.tp=2", "parallel.sequence_parallel=true"],
    ["parallel.dp=ddp_bucket", "parallel.ep=2", "parallel.pp=2", "parallel.microbatches=4",
     "model.moe_every=2"],
], ids=["dp16ep4-ddp", "dp8tp2ep2-fsdp3-ga2", "dp4tp2spcp2ep4-fsdp1", "dp8pp2ep2-every2"])
def test_dry_run_ranks_count_the_planned_bytes(layout, monkeypatch):
    """A dry run on 2 x 8 ranks (the fake backend: the routed rows the even split): every
    collective kind a rank hands parallel/comm.py in its step, the data-parallel sync,
    TP's token shares and partial gradients, the counts' all-reduce over cp x tp, the
    all-to-all's counts and rows, equals planner/traffic.py's bytes for that rank; its
    state exactly and its activations within 2% of the planner's."""
    from config import load_config
    from planner import dryrun as module
    from training import step
    counted, real = {}, step.compute_step

    def counting(strategy, *args):
        strategy.comm_stats()  # start-up traffic (the broadcasts) is not the step's
        out = real(strategy, *args)
        counted[strategy.grid.rank] = {k[len("comm_"):-len("_bytes")]: v for k, v in
                                       strategy.comm_stats().items()
                                       if k.endswith("_bytes") and k != "comm_bytes" and v}
        return out
    monkeypatch.setattr(step, "compute_step", counting)
    cfg = load_config(["mode=dryrun", *SMALL, "model.moe_experts=8", "plan.nodes=2",
                       "plan.gpus_per_node=8", *layout], 1)
    items = module.dryrun(cfg, device="cpu")
    w, L = module.workload(cfg), module.layout_of(cfg, 16)
    assert L.ep == cfg.parallel.ep > 1 and items
    routed = 0
    for r in items:
        planned = comm_bytes(w, L, r["pp_rank"], r["shard_rank"])
        print(f"rank {r['rank']}: counted {counted[r['rank']]}, planned {planned}")
        assert counted[r["rank"]] == planned
        routed += planned.get("all_to_all", 0)  # (a pipeline stage may hold no MoE block)
        assert r["state_bytes"] == r["plan_state_bytes"]
        assert abs(r["activation_bytes"] / r["plan_activation_bytes"] - 1) <= 0.02, r
    assert routed > 0


def test_plan_search_false_takes_the_configured_ep(capsys):
    """plan.search=false: the layout's ep from parallel.ep, and its all-to-all part printed."""
    from config import load_config
    from planner.report import plan
    row = plan(load_config(["mode=plan", "plan.search=false", "model.moe_experts=8",
                            "parallel.dp=fsdp", "parallel.ep=4", "plan.nodes=1",
                            "plan.gpus_per_node=8"], 1))
    text = capsys.readouterr().out
    print(text)
    assert row["layout"].ep == 4 and "layout: dp8 ep4 fsdp3 on 8 GPUs" in text
    assert re.search(r"^  expert all-to-all +[\d.e+-]+ ms$", text, re.M)


def test_docs_name_the_imbalance():
    """docs/experts.md (planning experts) states the imbalance the plan assumes, as the code has it."""
    text = open(os.path.join(REPO, "docs", "experts.md")).read()
    assert f"`moe_imbalance` = {MOE_IMBALANCE:g}" in text
