"""fsdp (ZeRO 1/2/3) and torch_fsdp must compute the same training run as one process
(the parity rule), and fsdp's per-rank memory must follow the ZeRO formulas.

Each job also leaves its final snapshot, so besides the per-step losses we
compare the final parameters and the canonical optimizer state with the
single-process run's: that checks the shard gathering of state_dict() /
optimizer_state_dict() and catches errors too small to move a 6-step loss.
Validation losses (after steps 3 and 6; under stage 3 evaluation gathers and
frees every unit with no backward) must match too.
Half the cases train without gradient clipping: clipping to a norm (active in
these runs) followed by Adam hides a wrong gradient scale (a missing 1/N)
completely, and the unclipped runs expose it in the optimizer state.
"""

import os
import uuid

import pytest

from harness import assert_parity, max_rel_diff, read_metrics, run_job, snapshot_state

_runs = {}  # (nproc, overrides) -> (metrics, snapshot): the memory test reuses parity runs


def run(tmp_path_factory, nproc, overrides):
    key = (nproc, tuple(overrides))
    if key not in _runs:
        workdir = os.path.join(str(tmp_path_factory.getbasetemp()), f"job-{uuid.uuid4().hex[:8]}")
        result = run_job(workdir, nproc, list(overrides) + ["trainer.eval_every=3"])
        assert result.returncode == 0, f"job failed ({result.returncode}): {overrides}\n" \
                                       f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        run_dir = os.path.join(workdir, "runs", "default")
        snapshot = snapshot_state(os.path.join(run_dir, "snapshot"))
        _runs[key] = read_metrics(run_dir), snapshot
    return _runs[key]


NO_CLIP = "trainer.grad_clip=0"


def fsdp(stage, accum=1, prefetch=True, reshard=True, clip=True):
    return ["parallel.dp=fsdp", f"parallel.zero_stage={stage}", f"trainer.grad_accum={accum}",
            f"parallel.prefetch={str(prefetch).lower()}",
            f"parallel.reshard_after_forward={str(reshard).lower()}"] + ([] if clip else [NO_CLIP])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference run for a job's overrides: clipped or not, like the job."""
    return lambda overrides: run(tmp_path_factory, 1, ["parallel.dp=single"]
                                 + [o for o in overrides if o == NO_CLIP])


def assert_same_run(ref, got):
    (ref_metrics, ref_snap), (got_metrics, got_snap) = ref, got
    assert_parity(ref_metrics, got_metrics)
    ref_val, got_val = ({r["step"]: r["val_loss"] for r in m if "val_loss" in r}
                        for m in (ref_metrics, got_metrics))
    assert list(ref_val) == list(got_val) == [3, 6]
    val = max_rel_diff(list(ref_val.values()), list(got_val.values()))
    assert val <= 1e-5, f"validation losses differ by {val:.3g}: {ref_val} vs {got_val}"
    # every step sends the same: evaluation's gathers (after step 3) are not training traffic
    assert len({r["comm_bytes"] for r in got_metrics}) == 1
    params = max((got_snap["model"][n] - p).abs().max().item() for n, p in ref_snap["model"].items())
    assert params <= 1e-5, f"final parameters differ by up to {params:.3g}"
    ref_opt, got_opt = ref_snap["optimizer"], got_snap["optimizer"]
    assert set(got_opt["state"]) == set(ref_opt["state"])
    opt = max(((got_opt["state"][n][k] - s[k]).norm() / s[k].norm()).item()
              for n, s in ref_opt["state"].items() for k in ("exp_avg", "exp_avg_sq"))
    assert opt <= 1e-4, f"optimizer state differs by up to {opt:.3g} (relative norm)"
    assert all(float(s["step"]) == float(ref_opt["state"][n]["step"]) for n, s in got_opt["state"].items())
    print(f"val loss {val:.3g}, final parameters max abs difference {params:.3g}, "
          f"optimizer state {opt:.3g}")


# every stage; 2, 3 (uneven shards) and 4 ranks; accumulation; prefetch and resharding on/off
MATRIX = [
    (2, fsdp(1)),
    (3, fsdp(1, accum=2, clip=False)),
    (2, fsdp(2, accum=3, clip=False)),
    (4, fsdp(2)),
    (2, fsdp(3)),
    (3, fsdp(3, accum=2, clip=False)),
    (2, fsdp(3, accum=2, prefetch=False)),
    (4, fsdp(3, accum=3, reshard=False, clip=False)),
]




def case_id(case):
    nproc, overrides = case
    values = dict(o.split("=") for o in overrides)
    return (f"stage{values['parallel.zero_stage']}-{nproc}ranks-accum{values['trainer.grad_accum']}"
            + ("" if values["parallel.prefetch"] == "true" else "-noprefetch")
            + ("" if values["parallel.reshard_after_forward"] == "true" else "-noreshard")
            + ("-noclip" if NO_CLIP in overrides else ""))


@pytest.mark.parametrize("nproc,overrides", MATRIX, ids=[case_id(c) for c in MATRIX])
def test_fsdp_matches_single(single, tmp_path_factory, nproc, overrides):
    assert_same_run(single(overrides), run(tmp_path_factory, nproc, overrides))


def unclipped_case(stage):
    """The first unclipped parity case of `stage` (its run is cached, shared with the above)."""
    return next(c for c in MATRIX if f"parallel.zero_stage={stage}" in c[1] and NO_CLIP in c[1])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fsdp_gradients_are_averaged_not_summed(single, tmp_path_factory, stage):
    """Unclipped, Adam's first moment is linear in the gradient: a reduction that sums
    instead of averaging makes every exp_avg N times the single-process one (clipping
    and Adam's scale invariance hide it from the losses)."""
    nproc, overrides = unclipped_case(stage)
    ref, got = (snap["optimizer"]["state"] for _, snap in
                (single(overrides), run(tmp_path_factory, nproc, overrides)))
    ratios = {n: (got[n]["exp_avg"].norm() / s["exp_avg"].norm()).item() for n, s in ref.items()}
    worst = max(ratios, key=lambda n: abs(ratios[n] - 1))
    assert abs(ratios[worst] - 1) <= 1e-4, \
        f"stage {stage}, {nproc} ranks: exp_avg of {worst} is {ratios[worst]:.6g}x single's"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fsdp_grad_norm_is_global_not_local_shard(single, tmp_path_factory, stage):
    """The logged pre-clip norm (and so the clipping) must be the norm of the whole
    gradient: the square sums of all shards, summed over the dp group."""
    nproc, overrides = unclipped_case(stage)
    ref, got = ([r["grad_norm"] for r in m] for m, _ in
                (single(overrides), run(tmp_path_factory, nproc, overrides)))
    diff = max_rel_diff(ref, got)
    assert diff <= 1e-5, f"stage {stage}, {nproc} ranks: grad norms {got} vs single's {ref}"


@pytest.mark.parametrize("nproc,extra", [(2, []), (3, ["trainer.grad_accum=2", NO_CLIP])],
                         ids=["2ranks", "3ranks-accum2-noclip"])
def test_torch_fsdp_matches_single(single, tmp_path_factory, nproc, extra):
    overrides = ["parallel.dp=torch_fsdp"] + extra
    assert_same_run(single(overrides), run(tmp_path_factory, nproc, overrides))


ZERO1 = [c for c in MATRIX if "parallel.zero_stage=1" in c[1]]


@pytest.mark.parametrize("nproc,overrides", ZERO1, ids=[case_id(c) for c in ZERO1])
def test_zero1_sends_what_ddp_sends(tmp_path_factory, nproc, overrides):
    """Stage 1 steps on its own shard, so per optimizer step (whatever grad_accum) it
    needs one reduce-scatter of each unit's full gradient and one all-gather of each
    unit's updated shard, nothing more: on the wire, 1.00x DDP's all-reduce of the
    gradient (bench/run_engine/stats.py's textbook), up to the padding that makes a unit divide
    by N. Exact bytes in parallel/comm.py's convention (reduce-scatter: its input,
    all-gather: its output, both the padded flat unit; plus the norm's scalar)."""
    from bench.run_engine import stats
    metrics, snapshot = run(tmp_path_factory, nproc, overrides)
    units = {}
    for name, t in snapshot["model"].items():  # a block per unit, the rest is the root
        unit = ".".join(name.split(".")[:3]) if name.startswith("transformer.h.") else "root"
        units[unit] = units.get(unit, 0) + t.numel()
    phi = sum(units.values())
    padded = sum(nproc * -(-numel // nproc) for numel in units.values())
    expected = {"comm_reduce_scatter_calls": len(units), "comm_reduce_scatter_bytes": 4 * padded,
                "comm_all_gather_calls": len(units), "comm_all_gather_bytes": 4 * padded,
                "comm_all_reduce_calls": 1, "comm_all_reduce_bytes": 4,  # the norm's square sum
                "comm_calls": 2 * len(units) + 1, "comm_bytes": 8 * padded + 4}
    for r in metrics:
        assert {k: v for k, v in r.items() if k.startswith("comm_")} == expected, r["step"]
    wire = stats.comm_per_step(metrics, nproc)["wire_bytes_est"] - 2 * (nproc - 1) / nproc * 4
    textbook = stats.textbook(phi, nproc, 1)["wire_bytes"]
    print(f"ZeRO-1 on {nproc} ranks: gradient wire {wire / textbook:.6f}x DDP's "
          f"(padding {padded - phi} of {phi} elements)")
    assert wire == pytest.approx(textbook * padded / phi, rel=1e-12)
    assert padded - phi <= len(units) * (nproc - 1)  # padding: < 1 element per rank and unit


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_bytes_follow_zero_formulas(tmp_path_factory, stage):
    """fp32 AdamW, Φ params, N ranks: 8Φ+8Φ/N, 4Φ+12Φ/N, 16Φ/N bytes (within 10%)."""
    n = 2  # reuse the 2-rank parity run of this stage (accumulation does not change the end state)
    overrides = next(o for nproc, o in MATRIX if nproc == n and f"parallel.zero_stage={stage}" in o)
    metrics, snapshot = run(tmp_path_factory, n, overrides)
    phi = sum(t.numel() for t in snapshot["model"].values())
    expected = {1: 8 * phi + 8 * phi / n, 2: 4 * phi + 12 * phi / n, 3: 16 * phi / n}[stage]
    got = metrics[-1]["state_bytes"]
    print(f"stage {stage}: state_bytes {got} vs formula {expected:.0f} ({got / expected:.4f}x)")
    assert abs(got / expected - 1) < 0.10
