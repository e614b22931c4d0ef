"""Context parallelism (parallel.cp): every sequence split over ranks, attention as a ring.

- tests/layout_worker.py: every cp layout (cp 2 and 4, with ddp_naive, ddp_bucket native
  and ring, fsdp 1-3, torch_ddp, torch_fsdp, tp with and without sequence parallelism,
  every pipeline schedule: gpipe, 1f1b, interleaved, zb1p, zbv; the 4-D dp2 x cp2 x tp2
  on 8 ranks) against a single-process replica: per-step losses and pre-clip gradient
  norms within rtol 1e-5, and under a pipeline the tied embedding's two copies bitwise equal;
  with dropout, cp ranks drawing their own masks (no generator state on two ranks);
- through main.py: cp2 x pp2 with accumulation against `single` including the final
  validation loss; a dropout run that resumes exactly; resume across layouts, optimizer
  state included; mode=sample from a cp snapshot; a block size the zigzag cannot cut refused;
- the balanced split, in process: each rank computes exactly the unmasked blocks of
  its chunks, and all ranks the same amount of work;
- the ring's dropout masks, in process: none repeats under another (seed, query part,
  key part, source rank), and backward regenerates forward's.
"""

import pytest

from harness import (LAYOUT_SESSIONS, assert_layout_matches, assert_parity, layout_worker_result,
                     run_job, run_metrics, save_then_resume)
from layout_worker import CASES
from parallel.context_parallel.ring_attention import blocks, zigzag_chunks, zigzag_positions
from test_bad_input import assert_clean_failure

pytestmark = pytest.mark.worker_sessions(*LAYOUT_SESSIONS)  # prefetch.py

CP_CASES = [(world, case.name) for world in CASES for case in CASES[world]
            if case.cp > 1 and not case.hybrid]


@pytest.mark.parametrize("world,name", CP_CASES, ids=[n for _, n in CP_CASES])
def test_cp_layout_matches_single_process(world, name):
    r = layout_worker_result(world)["cases"][name]
    print(f"{name}: loss {r['loss_rel_diff']:.2g}, grad norm {r['norm_rel_diff']:.2g}, val loss {r['eval_rel_diff']:.2g}, "
          f"params {r['param_max_abs_diff']:.2g}")
    assert_layout_matches(r)
    if r["pp"] > 1 and r["parallel"]["pp_schedule"] != "zbv":  # zbv: both ends on rank 0, one copy
        assert r["tied_equal"] and all(r["tied_equal"]), \
            f"the first and last stage's copies of the tied embedding differ: {r['tied_equal']}"


@pytest.mark.parametrize("world", [2, 4])
def test_cp_ranks_draw_their_own_dropout_masks(world):
    """cp ranks hold other tokens of the same sequences: seeded alike, rank 1 would draw
    rank 0's masks (embedding, residual, MLP, and the ring's attention blocks) at every
    call site. No generator state may be met on two ranks or at two call sites."""
    r = layout_worker_result(world)["random"]["cp"]
    assert len(set(r["calls_per_rank"])) == 1 and r["calls_per_rank"][0] > 0, r
    print(f"cp{world}: {r['calls_per_rank'][0]} calls a rank, "
          f"{sum(r['same_across_cp'])} shared across ranks, {r['states_met_twice']} met twice")
    assert not any(r["same_across_cp"]), r
    assert r["states_met_twice"] == 0, r


@pytest.mark.parametrize("N", [1, 2, 3, 4, 8])
def test_zigzag_split_computes_every_unmasked_block_once_and_balances_ranks(N):
    """Rank r holds chunks r and 2N-1-r; over the N ring steps it must compute exactly
    the (query chunk, key chunk) pairs with key <= query, none masked away, and every
    rank the same work (a causal diagonal block is half a full one)."""
    work = set()
    for me in range(N):
        mine = zigzag_chunks(me, N)
        done = []
        for src in range(N):
            theirs = zigzag_chunks(src, N)
            for qp, kp, causal in blocks(me, src, N):
                q, k = mine[qp], theirs[kp]
                assert (k == q) == causal and k <= q, (me, src, qp, kp)
                done.append((q, k))
        assert sorted(done) == sorted({(q, k) for q in mine for k in range(2 * N) if k <= q})
        work.add(sum(0.5 if q == k else 1.0 for q, k in done))
    assert len(work) == 1, work
    positions = sorted(p for r in range(N) for p in zigzag_positions(r, N, 4).tolist())
    assert positions == list(range(4 * N))  # every token on exactly one rank



@pytest.mark.parametrize("N", [2, 4])
def test_ring_dropout_masks_differ_per_block_source_and_seed(N):
    """The ring draws its attention dropout from a private generator seeded per block
    (`_keep`), which the stream test (digests of the default generator) cannot see.
    Every mask `_keep` returns over N ranks' forward and backward, two calls (layers)
    a rank, p=0.5 on 256 entries: each forward mask is a function of (seed, query part,
    key part, source rank), so no mask may repeat under another such key (a key part
    dropped from the seed: tail x head draws tail x tail's mask; the drawn seed dropped:
    every layer and step draws the same masks), and backward regenerates each one."""
    import hashlib
    from types import SimpleNamespace
    from unittest import mock

    import torch
    from parallel.context_parallel import ring_attention as ring
    real, drawn = ring._keep, []

    def spy(seed, qp, kp, src, shape, p, device):
        mask = real(seed, qp, kp, src, shape, p, device)
        drawn.append(((seed, qp, kp, src), hashlib.sha1(mask.numpy().tobytes()).hexdigest()))
        return mask

    torch.manual_seed(0)
    forward = {}  # sha -> the (seed, qp, kp, src) keys that drew it
    seeds = set()
    with mock.patch.object(ring, "_keep", spy):
        for me in range(N):
            # no communication: every ring step gets this rank's own keys back (the masks
            # depend on the block's identity and shape only)
            cp = SimpleNamespace(rank=me, size=N, pass_on=lambda t: (lambda: t))
            for call in range(2):
                q, k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(3))
                drawn.clear()
                out = ring.ring_attention(q, k, v, 0.5, cp)
                fwd = list(drawn)
                out.sum().backward()
                bwd = drawn[len(fwd):]
                expected = sorted((qp, kp, src) for src in range(N) for qp, kp, _ in ring.blocks(me, src, N))
                assert sorted(key[1:] for key, _ in fwd) == expected, (me, call, fwd)
                assert sorted(bwd) == sorted(fwd), f"rank {me} call {call}: backward regenerated other masks"
                assert len({key[0] for key, _ in fwd}) == 1
                seeds.add(fwd[0][0][0])
                for key, sha in fwd:
                    forward.setdefault(sha, set()).add(key)
    assert len(seeds) == 2 * N, f"{2 * N} calls drew {len(seeds)} seeds"
    repeated = {sha: sorted(keys) for sha, keys in forward.items() if len(keys) > 1}
    print(f"cp{N}: {sum(len(k) for k in forward.values())} forward masks, {len(forward)} distinct, "
          f"{len(seeds)} seeds")
    assert not repeated, ("one mask under several (seed, query part, key part, source) keys: " +
                          "; ".join(str(keys) for keys in list(repeated.values())[:3]))

CONSTANT = ["trainer.warmup_steps=0", "trainer.lr=0.003", "trainer.min_lr=0.003",
            "trainer.grad_clip=0"]
LAYOUTS = {
    "single": (1, ["parallel.dp=single"]),
    "cp2": (2, ["parallel.dp=ddp_bucket", "parallel.cp=2"]),
    "dp2tp2": (4, ["parallel.dp=ddp_bucket", "parallel.tp=2"]),
    "cp2tp2": (4, ["parallel.dp=fsdp", "parallel.zero_stage=2", "parallel.cp=2", "parallel.tp=2"]),
    "cp2pp2": (4, ["parallel.dp=ddp_bucket", "parallel.cp=2", "parallel.pp=2",
                   "parallel.microbatches=2"]),
}


def test_cp2_pp2_through_main_matches_single_with_validation(tmp_path):
    """A composition through main.py, with accumulation: training losses, grad norms and
    the final validation loss (evaluated through the pipeline on each rank's zigzag
    chunks, averaged over dp x cp) against single's."""
    evaluate = ["trainer.eval_every=6"]
    ref = run_metrics(tmp_path, 1, LAYOUTS["single"][1] + evaluate)
    got = run_metrics(tmp_path, 4, LAYOUTS["cp2pp2"][1] + ["trainer.grad_accum=2"] + evaluate)
    assert_parity(ref, got)
    diff = abs(ref[-1]["val_loss"] - got[-1]["val_loss"]) / ref[-1]["val_loss"]
    print(f"val_loss {ref[-1]['val_loss']:.7f} vs {got[-1]['val_loss']:.7f}: rel diff {diff:.2g}")
    assert diff <= 1e-5


@pytest.fixture(scope="module")
def uninterrupted_single(tmp_path_factory):
    return run_metrics(tmp_path_factory.mktemp("ref"), 1,
                       LAYOUTS["single"][1] + CONSTANT + ["trainer.max_steps=6"])


@pytest.mark.parametrize("saved_under,resumed_under", [
    ("cp2", "single"), ("single", "cp2"), ("dp2tp2", "cp2tp2")])
def test_resume_across_cp_layouts(tmp_path, uninterrupted_single, saved_under, resumed_under):
    resumed = save_then_resume(tmp_path, LAYOUTS[saved_under], LAYOUTS[resumed_under], CONSTANT)
    assert_parity(uninterrupted_single[3:], resumed)


def test_dropout_under_cp_resumes_exactly(tmp_path):
    """Dropout masks (embedding, residual, MLP, and the ring's attention masks) come
    from the step and the rank's coordinates: a resumed cp run draws the same ones."""
    dropout = ["model.dropout=0.1"]
    reference = run_metrics(tmp_path, 2, LAYOUTS["cp2"][1] + CONSTANT + dropout +
                            ["trainer.max_steps=6"])
    resumed = save_then_resume(tmp_path, LAYOUTS["cp2"], LAYOUTS["cp2"], CONSTANT + dropout)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference[3:]]


def test_cp_snapshot_samples_like_a_single_process_snapshot(tmp_path):
    """mode=sample on a cp2 snapshot prints what the single-process run of the same
    steps printed from its own model after training."""
    sample = ["sample.length=60", "sample.seed=3", "trainer.max_steps=3"]
    single = run_job(tmp_path / "single", 1, LAYOUTS["single"][1] + sample)
    assert single.returncode == 0, single.stderr[-3000:]
    trained = run_job(tmp_path / "cp2", 2, LAYOUTS["cp2"][1] + sample)
    assert trained.returncode == 0, trained.stderr[-3000:]
    sampled = run_job(tmp_path / "cp2", 1, ["mode=sample"] + sample)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    after_training = single.stdout.split("---- sample ----\n", 1)[1]
    assert sampled.stdout == after_training and len(after_training.strip()) > 0


def test_block_size_the_zigzag_cannot_cut_is_refused_on_every_rank(tmp_path):
    result = run_job(tmp_path, 2, LAYOUTS["cp2"][1] + ["data.block_size=18"])
    assert_clean_failure(result, "is not divisible by 2 x parallel.cp = 4")
