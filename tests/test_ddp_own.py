"""Our own data parallelism: ddp_naive, ddp_bucket and the ring all-reduce.

Three layers of evidence (the parity rule, docs/parallelism.md):
- end to end through main.py (tests/harness.py): per-step losses equal to
  `single` for 1, 2, 3 and 4 ranks, native and ring all-reduce, with
  gradient accumulation and with a tiny bucket cap that forces ~20 buckets;
  the same jobs' metrics.jsonl must show exactly the collectives the design
  promises (one all-reduce per parameter / per bucket, one gradient's worth
  of bytes per step, a single start-up broadcast);
- a hand-built strategy in torchrun workers (tests/dp_worker.py): ranks start
  from different weights, and after every step all ranks hold bit-identical
  parameters; gradients, losses and parameters match a single-process
  replica; gradients live inside the buckets; all buckets but the last start
  their all-reduce while backward still runs; unused parameters are refused;
  the ring all-reduce equals dist.all_reduce on uneven sizes, world 2 and 3;
- plain in-process checks of the bucket plan and the config keys.
"""

import os
import uuid

import pytest

from harness import (assert_parity, layout_session, layout_worker_result, read_metrics, run_job,
                     run_metrics, snapshot_model, worker_result)
from config import load_config
from errors import UserError
from model import GPT, GPTConfig
from parallel.data_parallel.bucket import plan_buckets

DP3_SESSION = ("dp_worker.py", 3, 240)  # world 2's checks run in layout_worker's 2-rank session
pytestmark = pytest.mark.worker_sessions(layout_session(2), DP3_SESSION)  # prefetch.py

TINY_CAP = "parallel.bucket_cap_mb=0.001"  # ~262 floats: nearly one bucket per parameter


# ---------------------------------------------------------------- end to end, main.py

@pytest.fixture(scope="module")
def single_losses(tmp_path_factory):
    return run_metrics(tmp_path_factory.mktemp("single"), 1, ["parallel.dp=single"])


def run_with_snapshot(tmp_path, nproc, overrides):
    """Run main.py; return metrics.jsonl records and the final snapshot's canonical params."""
    workdir = os.path.join(str(tmp_path), f"job-{uuid.uuid4().hex[:8]}")
    result = run_job(workdir, nproc, overrides)
    assert result.returncode == 0, f"job failed ({result.returncode}): {overrides}\n" \
                                   f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    run_dir = os.path.join(workdir, "runs", "default")
    return read_metrics(run_dir), snapshot_model(os.path.join(run_dir, "snapshot"))


def expected_traffic(params, nproc, dp, allreduce, cap_mb):
    """What every step must hand to the collectives on rank 0: {key: value}."""
    if nproc == 1:
        return {"comm_calls": 0}
    grad_bytes = 4 * sum(p.numel() for p in params.values())
    if dp == "ddp_naive":
        units = len(params)  # one all-reduce per parameter tensor (tied weight once)
    else:  # one per bucket, planned like the strategy: reverse order, capped bytes
        units = len(plan_buckets(reversed(list(params.items())), int(cap_mb * 2**20)))
    if allreduce == "native":
        return {"comm_calls": units, "comm_all_reduce_calls": units,
                "comm_all_reduce_bytes": grad_bytes, "comm_bytes": grad_bytes}
    # ring: 2(W-1) sends and receives per unit (every unit here has >= W elements);
    # bytes sent = 2(W-1)/W of the gradient, give or take one element per chunk
    sends = 2 * (nproc - 1) * units
    return {"comm_send_calls": sends, "comm_recv_calls": sends,
            "ring_bytes": (2 * (nproc - 1) / nproc * grad_bytes, 4 * sends)}


JOBS = [  # (nproc, dp, allreduce, extra overrides): 1, 2, 3, 4 ranks; accumulation; tiny buckets; ring
    (1, "ddp_bucket", "native", []),
    (2, "ddp_naive", "native", []),
    (3, "ddp_naive", "ring", ["trainer.grad_accum=2"]),
    (2, "ddp_bucket", "native", []),                      # everything in one 25 MB bucket
    (2, "ddp_bucket", "ring", ["trainer.grad_accum=3"]),
    (3, "ddp_bucket", "ring", [TINY_CAP, "trainer.grad_accum=2"]),
    (4, "ddp_bucket", "native", [TINY_CAP, "trainer.grad_accum=3"]),
    (4, "ddp_bucket", "ring", [TINY_CAP]),
]


def job_id(nproc, dp, allreduce, extra):
    short = {TINY_CAP: "tinycap"}
    return "-".join([f"{nproc}x{dp}", allreduce] +
                    [short.get(e, e.split(".")[-1].replace("=", "")) for e in extra])


@pytest.mark.parametrize("nproc,dp,allreduce,extra", JOBS, ids=[job_id(*job) for job in JOBS])
def test_losses_match_single_and_traffic_is_counted(single_losses, tmp_path,
                                                    nproc, dp, allreduce, extra):
    records, params = run_with_snapshot(
        tmp_path, nproc, [f"parallel.dp={dp}", f"parallel.allreduce={allreduce}", *extra])
    assert_parity(single_losses, records)

    cap_mb = float(next((e.split("=")[1] for e in extra if "bucket_cap_mb" in e), 25.0))
    expected = expected_traffic(params, nproc, dp, allreduce, cap_mb)
    grad_bytes = 4 * sum(p.numel() for p in params.values())
    for r in records:
        got = dict(r)
        if nproc > 1:
            # rank 0's weights are broadcast once, as one flat fp32 tensor, counted in step 1
            start = (got.pop("comm_broadcast_calls", 0), got.pop("comm_broadcast_bytes", 0))
            assert start == ((1, grad_bytes) if r["step"] == 1 else (0, 0)), (r["step"], start)
            got["comm_calls"] -= start[0]
            got["comm_bytes"] -= start[1]
        for key, want in expected.items():
            if key == "ring_bytes":
                ideal, slack = want
                assert abs(got["comm_send_bytes"] - ideal) <= slack, (r["step"], got, ideal)
            else:
                assert got.get(key) == want, f"step {r['step']}: {key}={got.get(key)}, expected {want}"


# ---------------------------------------------------------------- torchrun workers



def dp_result(world):
    """tests/dp_worker.py's RESULT on `world` ranks, once per test session (on 2 ranks
    tests/layout_worker.py's session runs it, sharing that launch)."""
    if world == 2:
        return layout_worker_result(2)["dp"]
    assert world == 3, world
    return worker_result(*DP3_SESSION)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_all_reduce_equals_dist_all_reduce(world):
    ring = dp_result(world)["ring"]
    print(f"ring vs dist.all_reduce, world {world}: relative differences {ring['rel_diff']}")
    assert ring["rel_diff"]["torch.int64"] == 0.0
    assert ring["rel_diff"]["torch.float64"] < 1e-14
    assert ring["rel_diff"]["torch.float32"] < 1e-6
    assert ring["identical_across_ranks"], "ranks disagree on a ring all-reduce result"
    assert ring["sends"] > 0 and ring["recvs"] > 0, "the ring must go through CommCounter"


@pytest.mark.parametrize("world", [2, 3])
def test_hand_built_strategies_keep_ranks_identical_and_match_single(world):
    for name, r in dp_result(world)["train"].items():
        print(f"world {world} {name}: loss {r['loss_rel_diff']:.2g}, grad {r['grad_rel_diff']:.2g}, "
              f"param {r['param_max_abs_diff']:.2g}")
        assert all(r["identical_each_step"]), f"{name}: ranks' parameters differ: {r}"
        assert r["broadcast"] == 1, f"{name}: expected one start-up broadcast: {r}"
        assert r["loss_rel_diff"] < 1e-5, f"{name}: {r}"
        assert r["param_max_abs_diff"] < 5e-5, f"{name}: parameters drift from single: {r}"
        assert r["grads_in_buckets"], f"{name}: a .grad is not a view into its bucket: {r}"
        if r["buckets"] and "native" in name:
            assert r["all_reduce_calls"] == [r["buckets"]] * len(r["all_reduce_calls"]), name


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_bucket_all_reduces_start_while_backward_runs(world):
    """A spy on start_all_reduce: every bucket but the last starts its all-reduce
    while some gradient is still missing, i.e. while backward still runs."""
    bucketed = {n: r for n, r in dp_result(world)["train"].items() if r["buckets"] > 1}
    assert bucketed, "no case with several buckets"
    for name, r in bucketed.items():
        steps = len(r["identical_each_step"])
        assert r["early_launches"] == (r["buckets"] - 1) * steps, \
            f"{name}: {r['early_launches']} of {r['buckets']} buckets x {steps} steps started before " \
            f"backward ended, expected all but the last bucket of each step"


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_are_averaged_not_summed(world):
    """After the sync every rank's gradient equals the single-process gradient of the
    whole global batch: a sum instead of a mean is `world` times too large."""
    for name, r in dp_result(world)["train"].items():
        assert r["grad_rel_diff"] < 1e-5, \
            f"{name}: gradients after the sync differ from single by {r['grad_rel_diff']:.3g} (relative)"


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_not_parameter_values_are_all_reduced(world):
    for name, r in dp_result(world)["train"].items():
        assert not r["params_changed_in_backward"], \
            f"{name}: forward_backward changed the parameters (values all-reduced instead of gradients?)"
        assert r["grad_rel_diff"] < 1e-5, f"{name}: gradients after the sync differ from single: {r}"


@pytest.mark.parametrize("world", [2, 3])
def test_parameter_without_gradient_is_refused_by_name(world):
    for name, message in dp_result(world)["unused"].items():
        assert message and "spare" in message, f"{name}: expected a UserError naming 'spare', got {message!r}"


# ---------------------------------------------------------------- in process

def test_bucket_plan_reverse_order_capped_and_complete():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=16))
    named = list(model.named_parameters())
    cap = 1048
    plan = plan_buckets(reversed(named), cap)
    assert [n for b in plan for n, _ in b] == [n for n, _ in reversed(named)]
    assert plan[-1][-1][0] == "transformer.wte.weight"  # tied weight once, ready last
    for bucket in plan:
        nbytes = sum(4 * p.numel() for _, p in bucket)
        assert nbytes <= cap or len(bucket) == 1
    assert len(plan_buckets(reversed(named), 25 * 2**20)) == 1



@pytest.mark.parametrize("accum", [1, 2, 3])
def test_step_loss_and_gradients_are_the_whole_global_batchs(accum):
    """The reference every parity test trusts, checked against plain autograd: `single`'s
    forward_backward over `accum` micro-batches returns the mean loss over the whole
    global batch, F.cross_entropy of every token, and leaves that loss's gradient in
    .grad. Parity cannot see a fault here that every strategy shares (layout_worker's
    reference runs this same code): the last micro-batch's loss logged (4.7e-3 off at
    accumulation 2), or each micro-batch's backward not divided by their number (the
    gradient `accum` times too large; AdamW hides the scale from the losses)."""
    import torch
    import torch.nn.functional as F
    from dp_worker import OneRank
    from parallel.config import ParallelConfig
    from parallel.parallelize import parallelize
    from training.config import TrainerConfig
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=16)
    torch.manual_seed(0)
    plain = GPT(config)
    torch.manual_seed(0)
    strategy = parallelize(GPT(config), OneRank(), ParallelConfig(dp="single"))
    strategy.configure_compute(TrainerConfig())
    data = torch.randint(0, 65, (12, 17), generator=torch.Generator().manual_seed(1))
    x, y = data[:, :-1], data[:, 1:]
    loss = strategy.forward_backward(list(zip(x.chunk(accum), y.chunk(accum))))
    logits, _ = plain(x)
    expected = F.cross_entropy(logits.reshape(-1, 65), y.reshape(-1))
    expected.backward()
    print(f"accum {accum}: loss {loss:.7f}, F.cross_entropy of the global batch {expected.item():.7f}")
    assert abs(loss - expected.item()) <= 1e-6 * expected.item()
    for (name, p), q in zip(strategy.module.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")

def test_allreduce_key_is_validated():
    assert load_config(["parallel.dp=ddp_bucket", "parallel.allreduce=ring"], 2).parallel.allreduce == "ring"
    assert load_config([], 2).parallel.allreduce == "native"
    with pytest.raises(UserError, match="parallel.allreduce must be native or ring"):
        load_config(["parallel.allreduce=tree"], 2)
    with pytest.raises(UserError, match="bucket_cap_mb"):
        load_config(["parallel.bucket_cap_mb=0"], 2)
