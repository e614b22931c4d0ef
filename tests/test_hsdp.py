"""Hybrid sharding (parallel.dp_replicate), CPU offload (parallel.offload) and building only
what a rank holds (the meta device): each against the single process.

- tests/layout_worker.py (torchrun, 2, 4 and 8 ranks; the same launches as the TP, PP
  and CP tests) trains every hybrid and offload layout of its CASES against a
  single-process replica: losses, pre-clip gradient norms and the validation loss within
  rtol 1e-5, final parameters. HSDP 2 x 2 with ZeRO 1, 2 and 3 and accumulation, offload
  at every stage with accumulation 3 (DeepSpeed #7967: a norm of the last micro-step's
  gradient only), offload under HSDP, HSDP composed with tp (and sequence parallelism),
  pp and cp, hsdp 2x2 x tp2 on 8 ranks, and PyTorch's FSDP2 on a 2-D mesh with
  CPUOffloadPolicy.
- From the same runs: HSDP 2 x 2 gathers and reduce-scatters exactly the bytes of fsdp3
  over 2 ranks and holds exactly its state per rank, plus one all-reduce of its gradient
  shards across the replica groups per step (whatever grad_accum); offload moves the
  shard's state to the host byte for byte.
- Through main.py: HSDP with offload on 4 ranks and ZeRO-1 with offload on 2, with
  accumulation 3, and their metrics.jsonl (bytes of each collective kind, device and
  host state); the setup peak of a ZeRO-3 rank against the single process's
  (setup_peak_rss_mb); bad replica groups stop every rank with one line (the rules
  themselves: tests/test_config.py).
"""

import pytest

from harness import assert_layout_matches, assert_parity, layout_session, layout_worker_result, \
    max_rel_diff, run_job, run_metrics
from test_bad_input import assert_clean_failure
from layout_worker import CASES, gpt_config

pytestmark = pytest.mark.worker_sessions(layout_session(2), layout_session(4))  # prefetch.py

HYBRID = [(world, case.name) for world in CASES for case in CASES[world] if case.hybrid]


@pytest.mark.parametrize("world,name", HYBRID, ids=[n for _, n in HYBRID])
def test_hybrid_and_offload_layouts_match_single_process(world, name):
    r = layout_worker_result(world)["cases"][name]
    print(f"{name}: loss {r['loss_rel_diff']:.3g}, grad norm {r['norm_rel_diff']:.3g}, "
          f"val loss {r['eval_rel_diff']:.3g}, final parameters {r['param_max_abs_diff']:.3g}")
    assert_layout_matches(r)


def shard_elements(vocab, n_layer, shards):
    """Elements of one rank's shard of every fsdp unit (a block each, then the root), padding
    included: what a cross-replica all-reduce sends, per unit."""
    import torch
    from model import GPT
    from parallel import model_plan as plan
    with torch.device("meta"):
        model = GPT(gpt_config(vocab, n_layer))
    numel = dict((n, p.numel()) for n, p in model.named_parameters())
    blocks = plan.block_parameter_names(model)
    in_blocks = {n for names in blocks for n in names}
    units = [sum(numel[n] for n in names) for names in blocks]
    units.append(sum(v for n, v in numel.items() if n not in in_blocks))
    return [-(-u // shards) for u in units]


def test_hsdp_gathers_and_holds_what_fsdp_over_one_group_does():
    """hsdp 2x2 (4 ranks) against fsdp3 over 2 ranks, same model and accumulation (2): per
    step the same all-gathers and reduce-scatters (calls and bytes) and the same state on
    the fullest rank; its all-reduces are the norm's scalar plus one per unit of this
    rank's gradient shard across the replica groups, once a step."""
    hsdp = layout_worker_result(4)["cases"]["hsdp2x2-fsdp3-accum2"]
    plain = layout_worker_result(2)["cases"]["dp2-fsdp3-accum2"]
    shards = shard_elements(hsdp["vocab"], hsdp["n_layer"], 2)
    for step, (h, p) in enumerate(zip(hsdp["comm"], plain["comm"])):
        for key in ("comm_all_gather_calls", "comm_all_gather_bytes", "comm_reduce_scatter_calls",
                    "comm_reduce_scatter_bytes"):
            assert h[key] == p[key], f"step {step}: {key} {h[key]} vs fsdp3's {p[key]}"
        assert p["comm_all_reduce_calls"] == 1 and p["comm_all_reduce_bytes"] == 4  # the norm
        cross = h["comm_all_reduce_bytes"] - 4
        print(f"step {step}: gathered {h['comm_all_gather_bytes']} B, reduce-scattered "
              f"{h['comm_reduce_scatter_bytes']} B, across replicas {cross} B")
        assert h["comm_all_reduce_calls"] == 1 + len(shards)
        assert cross == 4 * sum(shards) > 0
    assert hsdp["state"] == plain["state"], (hsdp["state"], plain["state"])


def test_offload_moves_the_shard_state_to_the_host():
    """fsdp3 with offload against without it (2 ranks, same model): what the host holds
    plus what the device keeps is the state without offload plus the device's copy of
    the shard, which is all the device keeps at the end of a step."""
    off = layout_worker_result(2)["cases"]["dp2-fsdp3-offload-accum4-noclip"]
    plain = layout_worker_result(2)["cases"]["dp2-fsdp3-accum2"]
    shard_bytes = 4 * sum(shard_elements(off["vocab"], off["n_layer"], 2))
    print(f"offload: device {off['state']['state_bytes']} B, host "
          f"{off['state']['host_state_bytes']} B; without: {plain['state']['state_bytes']} B")
    assert off["state"]["state_bytes"] == shard_bytes
    assert off["state"]["host_state_bytes"] == plain["state"]["state_bytes"]
    assert "host_state_bytes" not in plain["state"]


@pytest.mark.parametrize("dp,stage", [("single", 3), ("fsdp", 1), ("fsdp", 3)],
                         ids=["single", "fsdp1", "fsdp3"])
def test_materialized_initial_weights_are_the_models_own(one_rank_grid, dp, stage):
    """In process: a GPT built on the meta device and materialized by a strategy from
    InitialWeights (each parameter from its (seed, name) stream, each rank only its
    regions, as main.py builds every layout) holds exactly GPT(seed)'s values; another
    seed draws other ones. (Every layout's parity with single from step 1, through
    main.py, shows the same across ranks.)"""
    import torch
    from model import GPT
    from parallel.config import ParallelConfig
    from parallel.initial import InitialWeights
    from parallel.parallelize import parallelize
    config = gpt_config(65, 2)
    with torch.device("meta"):
        meta = GPT(config)
    strategy = parallelize(meta, one_rank_grid, ParallelConfig(dp=dp, zero_stage=stage),
                           InitialWeights(meta, seed=7))
    want = dict(GPT(config, seed=7).named_parameters())
    got = strategy.state_dict()
    assert sorted(got) == sorted(want)
    for name, p in want.items():
        assert torch.equal(got[name], p.detach()), name
    assert not torch.equal(want["transformer.h.0.attn.c_attn.weight"],
                           dict(GPT(config, seed=8).named_parameters())["transformer.h.0.attn.c_attn.weight"])


# ---------------------------------------------------------------- through main.py

ACCUM3 = ["trainer.grad_accum=3", "trainer.eval_every=3"]
THROUGH_MAIN = {  # accumulation 3 (DeepSpeed #7967: the norm of one micro-step's gradient)
    "hsdp2x2-fsdp3-offload": (4, ["parallel.dp=fsdp", "parallel.zero_stage=3",
                                  "parallel.dp_replicate=2", "parallel.offload=true"]),
    "dp2-fsdp1-offload": (2, ["parallel.dp=fsdp", "parallel.zero_stage=1", "parallel.offload=true"]),
}


@pytest.fixture(scope="module")
def single_accum3(tmp_path_factory):
    return run_metrics(tmp_path_factory.mktemp("single"), 1, ["parallel.dp=single"] + ACCUM3)


@pytest.mark.parametrize("name", list(THROUGH_MAIN))
def test_offload_through_main_matches_single_and_logs_each_kind(tmp_path, single_accum3, name):
    """main.py, accumulation 3: ZeRO-3 in 2 replica groups of 2 with offload, and ZeRO-1
    with offload on 2 ranks (its full gradient stays on the device, its shard's goes to
    the host once a step). metrics.jsonl: the gathers and reduce-scatters inside a group,
    under HSDP the all-reduce across (beyond the norm's 4 bytes), device and host state
    apart, and the setup peak in the first record."""
    nproc, overrides = THROUGH_MAIN[name]
    ref, got = single_accum3, run_metrics(tmp_path, nproc, overrides + ACCUM3)
    assert_parity(ref, got)
    val = [[r["val_loss"] for r in rs if "val_loss" in r] for rs in (ref, got)]
    assert len(val[0]) == len(val[1]) == 2 and max_rel_diff(*val) <= 1e-5, val
    for r in got:
        assert r["comm_all_gather_bytes"] > 0 and r["comm_reduce_scatter_bytes"] > 0
        # across the replica groups (beyond the norm's scalar), under HSDP only
        assert (r["comm_all_reduce_bytes"] > 4) == ("parallel.dp_replicate=2" in overrides), r
        assert r["host_state_bytes"] > 0 and r["state_bytes"] > 0, r
    assert "setup_peak_rss_mb" in got[0] and all("setup_peak_rss_mb" not in r for r in got[1:])


BIG = ["model.n_layer=8", "model.n_head=8", "model.n_embd=512", "trainer.batch_size=4",
       "trainer.max_steps=1"]


def big_model_params():
    """Parameters of BIG on harness.TINY's data (the embedded corpus's characters)."""
    import torch
    from char_dataset import build_tokenizer, load_text
    from model import GPT, GPTConfig
    vocab = build_tokenizer("char", load_text("")).vocab_size
    with torch.device("meta"):
        return GPT(GPTConfig(n_layer=8, n_head=8, n_embd=512, vocab_size=vocab,
                             block_size=16)).num_params()


def test_a_zero3_rank_builds_only_its_share(tmp_path):
    """Every rank used to build the whole model in fp32 before sharding it. Built on the
    meta device, a ZeRO-3 rank of 4 materializes its shard and one parameter at a time:
    its setup peak is below the single process's by at least half the model's fp32 bytes
    (25M parameters: 96 MiB, half 48)."""
    single = run_metrics(tmp_path, 1, ["parallel.dp=single"] + BIG)[0]["setup_peak_rss_mb"]
    zero3 = run_metrics(tmp_path, 4, ["parallel.dp=fsdp", "parallel.zero_stage=3"] + BIG)[0][
        "setup_peak_rss_mb"]
    half = 4 * big_model_params() / 2 / 2**20
    print(f"setup peak: single {single:.0f} MiB, a ZeRO-3 rank of 4 {zero3:.0f} MiB "
          f"(needs <= {single - half:.0f}: half the model's fp32 bytes is {half:.0f} MiB)")
    assert zero3 <= single - half


def test_replica_groups_that_do_not_divide_the_ranks_stop_every_rank_with_one_line(tmp_path):
    """4 ranks, 3 replica groups: one line naming the keys on every rank that prints, exit
    status 2, before any process group (tests/test_config.py holds every such rule)."""
    result = run_job(tmp_path / "job", 4, ["parallel.dp=fsdp", "parallel.dp_replicate=3"],
                     timeout=120)
    assert_clean_failure(result, "parallel.dp_replicate=3 does not divide the data-parallel degree 4")
