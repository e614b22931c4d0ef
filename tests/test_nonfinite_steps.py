"""A step whose gradients are not finite never reaches the weights (parallel/finite.py,
telemetry/loss_watch.py).

- tests/nonfinite_worker.py (inside tests/layout_worker.py's 2-rank launch): a NaN put
  into rank 1's gradient at one step, under ddp_bucket, fsdp ZeRO-3, tp 2 and pp 2: every
  rank sees that step's norm as not finite and skips it, and the final weights and AdamW
  state equal bitwise those of a run whose update at that step was skipped by hand;
- in process: fused AdamW skips on the flag without reading it (nothing waits for a GPU),
  foreach AdamW reads it; the watch's counts and its run of consecutive skips;
- through main.py: a diverging run skips, says so, and stops after
  trainer.max_skipped_steps in a row with one line; its snapshot holds finite values only.
"""

import pytest
import torch

from errors import UserError
from harness import (LAYOUT_SESSIONS, assert_parity, layout_worker_result, read_metrics, run_job,
                     run_metrics, save_then_resume)
from parallel.finite import not_finite, step_unless
from telemetry.loss_watch import LossWatch

pytestmark = pytest.mark.worker_sessions(*LAYOUT_SESSIONS[:1])  # prefetch.py: the 2-rank one


@pytest.mark.parametrize("layout", ["ddp_bucket", "fsdp3", "tp2", "pp2-1f1b"])
def test_a_nan_in_one_ranks_gradient_is_skipped_by_every_rank(layout):
    ranks = layout_worker_result(2)["nonfinite"][layout]
    print(layout, ranks)
    for rank in ranks:
        assert rank["flags"] == [False, False, True, False], rank  # step 2 only, every rank
        assert rank["same"], "the injected run's state differs from the one skipped by hand"
        assert rank["finite"]


def adamw(fused):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW(params, lr=0.1, fused=fused, foreach=None if fused else True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # state exists
    for p in params:
        p.grad = torch.randn_like(p)
    return params, opt


def snapshot(params, opt):
    return [p.detach().clone() for p in params] + [
        v.clone() for s in opt.state.values() for v in s.values()]


def test_fused_adamw_skips_on_the_flag_without_reading_it(monkeypatch):
    params, opt = adamw(fused=True)
    before = snapshot(params, opt)
    for name in ("item", "__bool__", "tolist", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, **k: pytest.fail("a host read"))
    step_unless(opt, not_finite(torch.tensor(float("nan"))))
    monkeypatch.undo()
    after = snapshot(params, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a skipped step changed state"
    assert not hasattr(opt, "found_inf")
    step_unless(opt, not_finite(torch.tensor(1.0)))  # a finite norm: it steps
    assert not torch.equal(before[0], params[0].detach())


def test_foreach_adamw_reads_the_flag_and_skips():
    params, opt = adamw(fused=False)
    before = snapshot(params, opt)
    step_unless(opt, not_finite(torch.tensor(float("inf"))))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(params, opt)))
    step_unless(opt, not_finite(torch.tensor(2.0)))
    assert not torch.equal(before[0], params[0].detach())


def test_the_watch_counts_skips_and_stops_at_a_run_of_them():
    watch = LossWatch(torch.device("cpu"), max_skipped=2)
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)
    for step, norm in enumerate([one, nan, one, nan], start=1):
        watch.watch(one, norm, step)
    _, _, figures = watch.read(one, one, 4)
    assert figures["skipped_steps"] == 2 and figures["step_skipped"] == 1
    assert "the last at step 4" in figures["skipped_note"]
    watch.watch(one, nan, 5)  # steps 4 and 5: two in a row
    with pytest.raises(UserError, match="in 2 steps in a row, from step 4"):
        watch.read(one, nan, 5)


def test_a_non_finite_loss_of_a_step_that_was_not_skipped_stops_the_run():
    watch = LossWatch(torch.device("cpu"))
    watch.watch(torch.tensor(float("inf")), torch.tensor(1.0), 3)
    with pytest.raises(UserError, match="training loss became inf at step 3"):
        watch.read(torch.tensor(1.0), torch.tensor(1.0), 3)


def test_a_diverging_run_skips_says_so_and_stops_with_its_snapshot_finite(tmp_path):
    result = run_job(tmp_path, 2, ["parallel.dp=ddp_bucket", "trainer.lr=1e9",
                                   "trainer.warmup_steps=0", "trainer.max_steps=20",
                                   "trainer.log_every=1", "trainer.save_every=2",
                                   "trainer.max_skipped_steps=3"])
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error on rank" in line]
    assert errors and all("in 3 steps in a row, from step" in e for e in errors), result.stderr
    assert "skipped (gradients not finite)" in result.stdout
    records = read_metrics(tmp_path / "runs" / "default")
    assert records[-1]["skipped_steps"] >= 1 and records[-1]["step_skipped"] == 1
    from checkpoint.snapshot_reader import open_snapshot
    snap = open_snapshot(str(tmp_path / "runs" / "default" / "snapshot"), -1)
    assert snap is not None
    for key in snap.keys():
        assert torch.isfinite(snap.read_full(key)).all(), key


def test_a_snapshot_of_a_run_whose_every_step_was_skipped_resumes_exactly(tmp_path):
    """fp16 from a scale that overflows steps 1-3: the snapshot of step 3 holds no AdamW
    state (it never stepped). Resumed, steps 4-6 equal the uninterrupted run's (it used to
    stop: "snapshot has no 'optim/.../step'")."""
    args = ["parallel.dp=single", "trainer.precision=fp16", "trainer.fp16_init_scale=1e6",
            "trainer.save_every=3"]
    whole = run_metrics(tmp_path / "whole", 1, args + ["trainer.max_steps=6"])
    assert [r.get("step_skipped") for r in whole] == [1, 1, 1, 0, 0, 0], whole
    resumed = save_then_resume(tmp_path, (1, args), (1, args))
    assert_parity(whole[3:], resumed)


def test_a_gpu_run_gets_fused_adamw_and_the_cpu_keeps_foreach():
    """The no-read skip needs fused AdamW where a read would wait for the device."""
    from parallel.data_parallel.contract import adamw_kind, build_adamw
    from training.config import TrainerConfig
    assert adamw_kind(torch.device("cuda", 3)) == {"fused": True}
    assert adamw_kind(torch.device("cpu")) == {}
    opt = build_adamw([{"params": [torch.nn.Parameter(torch.ones(2))]}], TrainerConfig())
    assert not opt.defaults.get("fused")
    opt = build_adamw([{"params": [torch.nn.Parameter(torch.ones(2))]}], TrainerConfig(), fused=True)
    assert opt.defaults["fused"]


def test_a_live_optimizer_behind_takes_the_step_count_it_loads():
    """A replica group alive but behind heals from a peer's state through load_regions:
    AdamW's step count must become the peer's even though its own state exists (it used to
    be read only into an empty state, leaving the group's own count: other bias
    corrections from then on)."""
    from dp_worker import OneRank
    from model import GPT, GPTConfig
    from parallel.config import ParallelConfig
    from parallel.parallelize import parallelize
    from training.config import TrainerConfig
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=20, block_size=8)
    x = torch.randint(20, (2, 8), generator=torch.Generator().manual_seed(0))

    def trained(steps):
        strategy = parallelize(GPT(config, seed=1), OneRank(), ParallelConfig(dp="single"))
        strategy.configure_optimizer(TrainerConfig())
        for _ in range(steps):
            strategy.forward_backward([(x, x)])
            strategy.optimizer_step(1e-3)
        return strategy
    peer, behind = trained(3), trained(1)

    class Held:  # the peer's state as a reader (fault_tolerance/state_transfer.py's role)
        def __init__(self, pieces):
            self.pieces = {(key, tuple(box)): t for key, _, box, t in pieces}

        def read_box(self, key, box):
            return self.pieces[(key, tuple(box))]
    behind.load_shards(Held(peer.shard_pieces()))
    steps = {float(s["step"]) for s in behind.optimizer.state.values()}
    assert steps == {3.0}, steps
