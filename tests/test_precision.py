"""trainer.precision (bf16, fp16 + loss scaler), parallel.reduce_dtype=bf16 and
trainer.activation_checkpointing, on every kind of layout.

- tests/precision_worker.py on 2 ranks (one torchrun job for all of it):
  bf16 and fp16 parity of ddp_naive, ddp_bucket with the ring, fsdp 1, 2 and 3,
  tp=2 with sequence parallelism and a 1F1B pipeline against `single` in the
  same precision over 30 steps (losses and gradient norms within rtol 2e-2,
  fp16 skipping the same steps on every rank); bf16 gradient reduction
  halving exactly the gradient collectives' bytes; activation checkpointing
  with dropout on giving bitwise the same gradients and losses as without
  (TP random streams, fsdp stage-3 gathers, pipeline stages);
- through main.py: bf16 reduction's halved comm_bytes in metrics.jsonl;
  the fp16 scaler's own rules, in process. (An fp16 run that crashes and
  resumes continues exactly, the scaler's state coming from the snapshot:
  tests/test_resume.py::test_fp16_loss_scale_is_saved_and_loaded.)
"""

import json

import pytest

from harness import layout_session, layout_worker_result, read_metrics, run_job, snapshot_model, \
    worker_result

PRECISION_SESSION = ("precision_worker.py", 2, 400)
pytestmark = pytest.mark.worker_sessions(PRECISION_SESSION, layout_session(4))  # prefetch.py


def worker():
    return worker_result(*PRECISION_SESSION)


LAYOUTS = ["ddp_naive", "ddp_bucket-ring", "fsdp1", "fsdp2", "fsdp3", "tp2-sp", "pp2-1f1b-m2"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_low_precision_matches_single_in_the_same_precision(layout, precision):
    r = worker()["precision"][precision][layout]
    print(f"{precision} {layout}: loss {r['loss_rel_diff']:.3g}, grad norm {r['norm_rel_diff']:.3g}, "
          f"skipped {r['skipped']} (single {r['ref_skipped']})")
    assert r["loss_rel_diff"] <= 2e-2, r
    assert r["norm_rel_diff"] <= 2e-2 and r["norm_steps"] >= 10, r  # the unscaled norm
    assert r["skip_agreed"], f"ranks skipped different steps: {r}"
    if precision == "bf16":
        assert not r["skipped"], r
    elif layout.startswith(("tp", "pp")):  # the same tokens per backward as single: same overflows
        assert r["skipped"] and r["skipped"] == r["ref_skipped"], r
    else:
        # data parallelism: each rank's loss is the mean over its half of the batch, so the
        # gradients inside its backward are 2x single's and overflow fp16 at half the scale
        # (averaging comes after, in the all-reduce): the same scaler skips earlier
        assert r["skipped"] and r["skipped"][0] <= r["ref_skipped"][0], r


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_single_stays_near_fp32(precision):
    """The reference itself: 30 steps of bf16/fp16 against fp32. Clipping or logging
    the norm of fp16 gradients before unscaling them moves both far off."""
    r = worker()["precision"][precision]["single_vs_fp32"]
    print(f"single {precision} vs fp32: loss {r['loss_rel_diff']:.3g}, grad norm {r['norm_rel_diff']:.3g}")
    assert r["loss_rel_diff"] <= 2e-2 and r["norm_rel_diff"] <= 5e-2, r


GRADIENT_KIND = {"ddp_naive": "all_reduce", "ddp_bucket-ring": "send", "fsdp1": "reduce_scatter",
                 "fsdp2": "reduce_scatter", "fsdp3": "reduce_scatter",
                 "hsdp2x1-fsdp2": "all_reduce"}  # across the replica groups (one rank each)


@pytest.mark.parametrize("layout", list(GRADIENT_KIND))
def test_bf16_reduction_halves_exactly_the_gradient_traffic(layout):
    r = worker()["reduce"][layout]
    fp32, bf16, kind = r["comm_fp32"], r["comm_bf16"], GRADIENT_KIND[layout]
    print(f"{layout}: {kind} bytes {fp32[f'comm_{kind}_bytes']} -> {bf16[f'comm_{kind}_bytes']}, "
          f"total {fp32['comm_bytes']} -> {bf16['comm_bytes']}; loss vs fp32 reduction "
          f"{r['loss_rel_diff']:.2g}")
    assert bf16[f"comm_{kind}_bytes"] * 2 == fp32[f"comm_{kind}_bytes"] > 0
    for key in fp32:  # the calls, and everything else (parameter gathers, the norm), unchanged
        if key.endswith("_calls") or (key.startswith("comm_") and key not in
                                      (f"comm_{kind}_bytes", "comm_bytes")):
            assert bf16[key] == fp32[key], (key, fp32, bf16)
    assert 0 < r["loss_rel_diff"] <= 2e-2, r  # rounded, so not identical; but close


def test_sequence_parallel_activations_travel_in_bf16_under_bf16():
    """tp2 + sequence parallelism, 4 blocks, one step: the all-gathers (LayerNorm outputs into the
    column-parallel matmuls) and their backward reduce-scatters move bf16 under bf16, as
    Megatron's do: at most 0.55x fp32's bytes (0.78x when they went in fp32; what stays
    fp32 is the vocabulary-parallel embedding's reduce-scatter into the fp32 residual
    stream and its backward). bf16 parity of tp2-sp: test_low_precision_matches_single_in_the_same_precision."""
    r = worker()["sp_bytes"]
    total = {p: sum(r[p].values()) for p in r}
    ratio = total["bf16"] / total["fp32"]
    print(f"tp2-sp all-gather + reduce-scatter bytes: fp32 {total['fp32']}, bf16 {total['bf16']} "
          f"({ratio:.3f}x); {r}")
    assert ratio <= 0.55, r


@pytest.mark.parametrize("variant", ["full", "selective", "selective-every2"])
@pytest.mark.parametrize("layout", ["single", "fsdp1", "fsdp3", "ddp_bucket", "tp2", "tp2-sp",
                                    "pp2-1f1b-m2", "tp2-accum2"])
def test_activation_checkpointing_recomputes_the_same_gradients(layout, variant):
    r = worker()["recompute"][layout][variant]
    assert all(r["losses_equal"]), r
    assert r["grads_bitwise_equal_on_every_rank"], r


@pytest.mark.parametrize("variant", ["full", "selective", "selective-every2"])
def test_activation_checkpointing_under_tp_x_pp_1f1b_leaves_the_tp_stream_where_it_was(variant):
    """4 ranks, tp=2 x pp=2, 1F1B with 2 micro-batches, dropout 0.1: the last stage
    runs micro-batch 1's forward after micro-batch 0's recompute, so a recompute that
    leaves the TP rank's own random stream rewound changes its attention masks
    (layout_worker.py's 4-rank session measures it)."""
    r = layout_worker_result(4)["recompute4"]["tp2-pp2-1f1b-m2"][variant]
    assert all(r["losses_equal"]), r
    assert r["grads_bitwise_equal_on_every_rank"], r


@pytest.mark.parametrize("precision,dtype", [("bf16", "torch.bfloat16"), ("fp16", "torch.float16")])
def test_every_pipeline_stage_computes_in_the_low_precision(precision, dtype):
    """bf16's parity tolerance (2e-2) cannot tell a stage left in fp32 from bf16: look at
    the dtype of every Linear's output on both stages instead."""
    for rank, seen in enumerate(worker()["stage_dtypes"][precision]):
        assert seen == [dtype], f"rank {rank}'s stage computed in {seen} under {precision}"


# ---------------------------------------------------------------- through main.py

def test_bf16_reduction_shows_in_metrics(tmp_path):
    """ddp_bucket on 2 ranks: the all-reduce carries 2 bytes a parameter, not 4."""
    workdir = tmp_path / "job"
    result = run_job(workdir, 2, ["parallel.dp=ddp_bucket", "parallel.reduce_dtype=bf16",
                                  "trainer.max_steps=3"])
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = workdir / "runs" / "default"
    phi = sum(t.numel() for t in snapshot_model(run_dir / "snapshot").values())
    for r in read_metrics(run_dir):
        assert r["comm_all_reduce_bytes"] == 2 * phi, (r, phi)


# ---------------------------------------------------------------- the scaler, in process

def test_loss_scaler_backs_off_on_overflow_and_grows_after_good_steps():
    from parallel.precision import LossScaler
    s = LossScaler(init_scale=8.0, growth_interval=2)
    s.update(found_inf=True)
    assert (s.scale, s.good_steps, s.skipped_steps) == (4.0, 0, 1)
    s.update(False)
    s.update(False)
    assert (s.scale, s.good_steps) == (8.0, 0)
    t = LossScaler()
    t.load_state(json.loads(json.dumps(s.state())))  # JSON-able: it lives in the manifest
    assert t.state() == s.state()


def test_unscaling_comes_before_the_norm_and_an_overflow_skips_the_step():
    import torch
    from parallel.precision import Precision
    p = Precision("fp16", init_scale=1024.0)
    grads = [torch.full((3,), 1024.0 * 2), torch.full((2,), 1024.0 * 3)]
    p.unscale_and_check(grads)
    assert not p.skip_step and torch.equal(grads[0], torch.full((3,), 2.0))
    p.unscale_and_check([torch.tensor([1.0, float("inf")])])
    assert p.skip_step and p.scaler.scale == 1024.0 / 2
    assert Precision("bf16").loss_scale == 1.0 and Precision("bf16").metrics() == {}


def test_loss_scaler_follows_torch_grad_scaler_over_a_pattern_of_overflows():
    """Our scaler against torch.amp.GradScaler (the same defaults, growth every 3 good
    steps) over a fixed pattern of overflows: the same scale after every step. An
    overflow must restart the count of good steps, or the scale grows straight back
    into the overflow (two good steps, an overflow, one good step would grow it)."""
    import torch
    from parallel.precision import LossScaler
    pattern = [0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0]
    ours = LossScaler(init_scale=1024.0, growth_interval=3)
    ref = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.0)
    scales = []
    for overflow in pattern:
        ref.scale(torch.ones(()))  # (GradScaler starts its state at the first scale())
        param.grad = torch.tensor([float("inf") if overflow else 1.0, 0.0])
        ref.step(opt)
        ref.update()
        ours.update(found_inf=bool(overflow))
        scales.append((ours.scale, ref.get_scale()))
    assert all(a == b for a, b in scales), scales
    assert ours.skipped_steps == sum(pattern)
