"""Pipeline parallelism (parallel.pp): schedules, the tied embedding, composition on the grid.

- in process: every schedule (gpipe, 1f1b, interleaved) for P up to 4, M up to
  12, V up to 3 runs to the end when each rank blocks on its receives
  (pp_simulator.simulate), every pair of ranks receives in the order the
  other sends, each forward and backward runs once, and 1F1B holds at most
  P - rank micro-batches where GPipe holds M; the executor's own batching
  (p2p_plan.plan) finishes under NCCL's rules for P <= 8, M <= 32, V <= 4;
  the device clock reads CUDA events on CUDA;
- tests/layout_worker.py on 2, 4 and 8 ranks: pp 2 and 4; M 1, 2, 4, 8 (M < P
  included); every schedule; uneven splits (5 layers on 2 stages, pp_layers);
  dp=2 x pp=2 with ddp_naive, ddp_bucket, fsdp 1 and 2; tp=2 x pp=2 (with
  sequence parallelism); dp=2 x pp=2 x tp=2; accumulation on top: per-step
  losses and pre-clip gradient norms equal to a single process's, the tied
  embedding's two copies bitwise equal after every step, and exactly the
  point-to-point traffic a pipeline needs;
- through main.py: validation loss under every schedule, the bubble and the
  timeline in the run directory, 1F1B's activation memory against GPipe's,
  resume across layouts, sampling, and the layouts it refuses.
"""

import json
from types import SimpleNamespace

import pytest

from harness import (LAYOUT_SESSIONS, assert_layout_matches, assert_parity, layout_worker_result,
                     run_job, run_metrics, save_then_resume)
from layout_worker import BATCH, BLOCK, CASES, N_EMBD
from parallel.pipeline_parallel import schedules as pp_schedules
from parallel.pipeline_parallel import simulator as pp_simulator
from parallel.rules import PIPELINE, Facts, refusal
from training.config import TrainerConfig

pytestmark = pytest.mark.worker_sessions(*LAYOUT_SESSIONS)  # prefetch.py

# ---------------------------------------------------------------- schedules, in process

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 1), ("interleaved", 2), ("interleaved", 3),
             ("zb1p", 1), ("zbv", 2)]


@pytest.mark.parametrize("schedule,V", SCHEDULES, ids=[f"{s}-v{v}" for s, v in SCHEDULES])
def test_schedule_never_deadlocks_and_pairs_messages_in_order(schedule, V):
    for P in range(1, 5):
        for M in range(1, 13):
            if schedule == "interleaved" and M % P:
                continue  # refused by config.py
            sent, received = pp_simulator.simulate(schedule, P, M, V)  # raises on deadlock
            assert sent == received, f"{schedule} P={P} M={M} V={V}: a pair's order differs"
            ranks = pp_schedules.chunk_ranks(schedule, P, V)
            kinds = "FBW" if pp_schedules.SCHEDULES[schedule].split_backward else "FB"
            for rank in range(P):
                actions = pp_schedules.build(schedule, P, M, V, rank)
                chunks = [c for c in range(P * V) if ranks[c] == rank]
                assert sorted(actions) == sorted((k, c, m) for k in kinds for c in chunks
                                                 for m in range(M))


NCCL_SCHEDULES = [(s, v) for s in pp_schedules.SCHEDULES
                  for v in {"interleaved": (1, 2, 3, 4), "zbv": (2,)}.get(s, (1,))]


@pytest.mark.parametrize("schedule,V", NCCL_SCHEDULES, ids=[f"{s}-v{v}" for s, v in NCCL_SCHEDULES])
def test_executor_batching_never_hangs_under_nccl_rules(schedule, V):
    """NCCL runs a group's batches in order and a send completes only when its receive
    is posted; gloo buffers sends, so no run here can see such a hang. The executor's
    own plan (p2p_plan.plan, not a copy) must finish under NCCL's rules."""
    for P in range(1, 9):
        for M in range(1, 33):
            if refused(schedule, P, M, V):
                continue
            sent, received = pp_simulator.simulate(schedule, P, M, V, mode="nccl")  # raises on a hang
            assert sent == received, f"{schedule} P={P} M={M} V={V}: a pair's order differs"


def old_plan(schedule, P, M, V=1):
    """The executor's batching before the rounds (commit 94ecfab's p2p_plan.plan): each
    action's output sent in one batch with the receive of the rank's next action's input
    (and a first batch receiving the first action's input)."""
    from parallel.pipeline_parallel.p2p_plan import Step
    ranks = pp_schedules.chunk_ranks(schedule, P, V)
    steps = []
    for r in range(P):
        actions = pp_schedules.build(schedule, P, M, V, r)
        first = pp_schedules.messages(actions[0], ranks)[0] if actions else []
        mine = [Step(None, [], first)] if first else []
        for k, action in enumerate(actions):
            following = pp_schedules.messages(actions[k + 1], ranks)[0] if k + 1 < len(actions) else []
            mine.append(Step(action, pp_schedules.messages(action, ranks)[1], following))
        steps.append(mine)
    return steps


def test_nccl_mode_sees_the_old_batchings_hang_that_gloo_hides():
    """Negative control: the batching the executor had before the rounds hangs under
    NCCL's rules for interleaved P=2, M=4, V=2 (rank 0 waits on its gradient send, rank 1
    on a batch whose receive is in rank 0's next batch), finishes buffered (gloo), and
    today's plan finishes under both."""
    steps = old_plan("interleaved", 2, 4, 2)
    sent, received = pp_simulator.simulate("interleaved", 2, 4, 2, mode="buffered", steps=steps)
    assert sent == received
    with pytest.raises(RuntimeError, match=r"interleaved P=2 M=4 V=2 \(nccl\) hangs"):
        pp_simulator.simulate("interleaved", 2, 4, 2, mode="nccl", steps=steps)
    for mode in pp_simulator.MODES:
        pp_simulator.simulate("interleaved", 2, 4, 2, mode=mode)


def refused(schedule, P, M, V):
    """What config.py refuses (parallel/rules.py's PIPELINE rows), for P*V layers."""
    cfg = SimpleNamespace(model=SimpleNamespace(n_layer=P * V), parallel=SimpleNamespace(
        microbatches=M, pp_virtual_stages=V, pp_schedule=schedule, pp_layers=[]),
        trainer=TrainerConfig())  # the real defaults: a rule on a new trainer key sees it
    return bool(refusal(PIPELINE, Facts(cfg, {"pp": P})))


def in_flight(actions):
    """The most chunk micro-batches a rank holds activations of: from F to the end of
    their backward (B, or W where the backward is split: W needs the graph)."""
    split = any(kind == "W" for kind, _, _ in actions)
    live = peak = 0
    for kind, _, _ in actions:
        live += {"F": 1, "B": 0 if split else -1, "W": -1}[kind]
        peak = max(peak, live)
    return peak


def test_1f1b_holds_at_most_P_minus_rank_micro_batches_and_gpipe_holds_M():
    for P in range(1, 5):
        for M in range(1, 13):
            for rank in range(P):
                assert in_flight(pp_schedules.one_f_one_b(P, M, rank)) == min(P - rank, M)
                assert in_flight(pp_schedules.gpipe(P, M, rank)) == M


def test_zero_bubble_schedules_hold_at_most_P_micro_batches_and_cut_the_bubble():
    """ZB-H1 and ZB-V hold 1F1B's stage-0 memory on every rank (P whole-stage micro-batches;
    zbv's chunks are half a stage), and in the textbook's unit-time model (F = B = W)
    ZB-H1's step is 3M + P - 1 long against 1F1B's 3M + 3(P - 1): a third of the bubble;
    ZB-V's is shorter still once M >= 2P."""
    for P in range(2, 5):
        for M in range(1, 13):
            for rank in range(P):
                assert in_flight(pp_schedules.zb1p(P, M, rank)) <= min(P, M)
                assert in_flight(pp_schedules.zbv(P, M, rank)) <= min(2 * P, 2 * M)
            one_f_one_b, _ = pp_simulator.unit_time("1f1b", P, M)
            zb1p, _ = pp_simulator.unit_time("zb1p", P, M)
            zbv, _ = pp_simulator.unit_time("zbv", P, M, 2)
            assert one_f_one_b == 3 * M + 3 * (P - 1)
            if M >= P:
                assert zb1p == 3 * M + P - 1, (P, M, zb1p)
            if M >= 2 * P:
                assert zbv / 2 < zb1p, (P, M, zbv, zb1p)  # half-size chunks: units of half a stage


def test_balanced_and_explicit_splits():
    assert pp_schedules.chunk_blocks(5, 2) == [[0, 1, 2], [3, 4]]
    assert pp_schedules.chunk_blocks(5, 2, [1, 4]) == [[0], [1, 2, 3, 4]]
    assert pp_schedules.chunk_blocks(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]


class FakeCudaEvent:
    """Stands in for torch.cuda.Event on this CPU-only build: it records the 'device'
    time `now` (which the test advances while the host clock barely moves), and can be
    read only after a synchronize, as a CUDA event only once the GPU has passed it."""
    now, synchronized = 0.0, False

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = FakeCudaEvent.now
        FakeCudaEvent.synchronized = False

    def synchronize(self):
        FakeCudaEvent.synchronized = True

    def elapsed_time(self, end):
        assert FakeCudaEvent.synchronized, "read before the device got there"
        return 1000 * (end.at - self.at)  # ms, as CUDA's


def test_pipeline_clock_reads_device_events_on_cuda_and_the_host_clock_on_cpu():
    """On CUDA the host returns before the kernels run: busy/idle must come from
    events on the stream, not from host timers around launches."""
    import time

    import torch

    from parallel.pipeline_parallel.clock import DeviceClock
    clock = DeviceClock(torch.device("cuda"), event_class=FakeCudaEvent)
    origin = clock.mark()
    FakeCudaEvent.now = 0.25
    first = clock.mark()
    FakeCudaEvent.now = 0.75
    second = clock.mark()
    assert clock.seconds(origin, [first, second]) == [0.25, 0.75]
    host = DeviceClock(torch.device("cpu"))
    origin = host.mark()
    time.sleep(0.02)
    (elapsed,) = host.seconds(origin, [host.mark()])
    assert 0.02 <= elapsed < 1


# ---------------------------------------------------------------- torchrun workers

PP_CASES = [(world, case.name) for world in CASES for case in CASES[world]
            if case.pp > 1 and case.cp == 1 and not case.hybrid]


@pytest.mark.parametrize("world,name", PP_CASES, ids=[n for _, n in PP_CASES])
def test_pp_layout_matches_single_process(world, name):
    r = layout_worker_result(world)["cases"][name]
    print(f"{name}: loss {r['loss_rel_diff']:.3g}, grad norm {r['norm_rel_diff']:.3g}, val loss {r['eval_rel_diff']:.3g}, "
          f"final parameters {r['param_max_abs_diff']:.3g}")
    assert_layout_matches(r)
    if r["parallel"]["pp_schedule"] == "zbv":  # both ends on rank 0: one parameter, no copy
        assert not any(r["tied_equal"]), r["tied_equal"]
    else:
        assert r["tied_equal"] and all(r["tied_equal"]), \
            f"the first and last stage's copies of the tied embedding differ: {r['tied_equal']}"


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_stages_draw_their_own_dropout_masks(world):
    """Every stage seeded alike would give layer 0 and the first layer of stage 1 the
    same masks (a single process draws a fresh one per layer)."""
    r = layout_worker_result(world)["random"]["pp"]
    assert all(n > 0 for n in r["dropout_calls_per_stage"]), r
    assert r["states_on_two_stages"] == 0, r


PURE_PP = [(world, case.name) for world in CASES for case in CASES[world]
           if case.pp > 1 and case.dp == case.tp == case.cp == 1 and not case.hybrid]


@pytest.mark.parametrize("world,name", PURE_PP, ids=[n for _, n in PURE_PP])
def test_pure_pp_sends_each_activation_and_gradient_once(world, name):
    """Rank 0 (stage 0) per step: an activation forward from each of its V chunks and a
    gradient back from each but chunk 0, per micro-batch; one all-reduce of the tied
    embedding's gradient with the last stage; one scalar for the gradient norm. Under
    zbv rank 0 holds the first and the last chunk: one activation out (chunk 0) and one
    in (the last chunk's input), one gradient each way, and the tie needs no collective."""
    r = layout_worker_result(world)["cases"][name]
    V, M, accum = r["parallel"].get("pp_virtual_stages", 1), r["parallel"]["microbatches"], r["accum"]
    zbv = r["parallel"]["pp_schedule"] == "zbv"
    crossings = 2 if zbv else 2 * V - 1
    expected = {"comm_send_calls": accum * M * crossings, "comm_recv_calls": accum * M * crossings,
                "comm_send_bytes": crossings * BATCH * BLOCK * N_EMBD * 4,
                "comm_all_reduce_calls": 1 if zbv else 2,
                "comm_all_reduce_bytes": 4 if zbv else 4 * r["vocab"] * N_EMBD + 4}
    for step, got in enumerate(r["comm"]):
        assert {k: got.get(k) for k in expected} == expected, f"step {step}: {got}"


# ---------------------------------------------------------------- through main.py

FOUR = ["model.n_layer=4", "trainer.eval_every=3"]


@pytest.fixture(scope="module")
def single4(tmp_path_factory):
    return run_metrics(tmp_path_factory.mktemp("single"), 1, ["parallel.dp=single"] + FOUR)


@pytest.mark.parametrize("schedule,M,V", [
    ("gpipe", 4, 1), ("1f1b", 3, 1), ("interleaved", 2, 2), ("zb1p", 4, 1), ("zbv", 4, 2)])
def test_schedule_through_main_matches_single_with_validation_and_bubble(
        tmp_path, single4, schedule, M, V):
    extra = [f"parallel.microbatches={M}"] + (["parallel.pp_virtual_stages=2"] if V > 1 else [])
    got = run_metrics(tmp_path, 2, ["parallel.dp=single", "parallel.pp=2",
                                    f"parallel.pp_schedule={schedule}"] + extra + FOUR)
    assert_parity(single4, got)
    ref_val = [r["val_loss"] for r in single4 if "val_loss" in r]
    val = [r["val_loss"] for r in got if "val_loss" in r]
    assert len(val) == len(ref_val) == 2
    assert all(abs(a - b) <= 1e-5 * a for a, b in zip(ref_val, val)), (ref_val, val)
    for r in got:  # both stages report busy and idle time every step
        assert r["pp_busy_ms_stage0"] > 0 and r["pp_busy_ms_stage1"] > 0
        assert 0 < r["pp_bubble"] < 1
    run_dir = next(tmp_path.glob("job-*")) / "runs" / "default"
    with open(run_dir / "pipeline_timeline.json") as f:
        timeline = json.load(f)
    for stage, actions in enumerate(timeline["stages"]):
        # the executor ran exactly the schedule's order, one action after another
        assert [tuple(a[:3]) for a in actions] == pp_schedules.build(schedule, 2, M, V, stage)
        starts, ends = [a[3] for a in actions], [a[4] for a in actions]
        assert all(s <= e for s, e in zip(starts, ends))
        assert all(e <= s for e, s in zip(ends, starts[1:]))


def test_torch_pipelining_reference_matches_single(tmp_path, single4):
    """The benchmark's reference: torch.distributed.pipelining's schedules on our split."""
    got = run_metrics(tmp_path, 2, ["parallel.pp_impl=torch", "parallel.pp=2",
                                    "parallel.pp_schedule=interleaved", "parallel.microbatches=2",
                                    "parallel.pp_virtual_stages=2"] + FOUR)
    assert_parity(single4, got)


def test_1f1b_holds_fewer_activations_than_gpipe(tmp_path):
    """Measured (telemetry/activation_meter.py): with M=6 micro-batches on 2 stages, stage 0 holds
    6 micro-batches' activations under GPipe, at most 2 under 1F1B."""
    common = ["parallel.dp=single", "parallel.pp=2", "parallel.microbatches=6",
              "trainer.measure_activations=true", "trainer.max_steps=2"]
    peak = {s: run_metrics(tmp_path, 2, common + [f"parallel.pp_schedule={s}"])[-1]
            ["activation_peak_mb"] for s in ("gpipe", "1f1b")}
    print(f"stage 0 activation peak, M=6: gpipe {peak['gpipe']:.3f} MiB, 1f1b {peak['1f1b']:.3f} MiB")
    assert peak["1f1b"] < 0.5 * peak["gpipe"]


def test_state_bytes_is_the_fullest_stage_s(tmp_path):
    """metrics.jsonl's state_bytes (parameters, gradients, AdamW state: 16 bytes a
    parameter in fp32) is the fullest rank's: with 1 block on stage 0 and 3 on stage 1,
    stage 1's, which rank 0 (stage 0) does not hold."""
    from model import GPT, GPTConfig
    got = run_metrics(tmp_path, 2, ["parallel.dp=single", "parallel.pp=2", "model.n_layer=4",
                                    "parallel.pp_layers=[1,3]", "trainer.max_steps=2"])
    from checkpoint.snapshot_reader import open_snapshot
    snapshot = next(tmp_path.glob("job-*")) / "runs" / "default" / "snapshot"
    gpt = GPT(GPTConfig(**open_snapshot(str(snapshot)).meta["gpt_config"]))
    sizes = {n: p.numel() for n, p in gpt.named_parameters()}
    blocks = lambda ids: sum(v for n, v in sizes.items() if any(n.startswith(f"transformer.h.{i}.")
                                                                 for i in ids))
    wte, wpe = sizes["transformer.wte.weight"], sizes["transformer.wpe.weight"]
    ln_f = sizes["transformer.ln_f.weight"] + sizes["transformer.ln_f.bias"]
    stage0, stage1 = wte + wpe + blocks([0]), wte + ln_f + blocks([1, 2, 3])
    state = got[-1]["state_bytes"]
    print(f"state_bytes {state}: stage 0 ~{16 * stage0}, stage 1 ~{16 * stage1}")
    assert abs(state / (16 * stage1) - 1) < 0.01, (state, 16 * stage0, 16 * stage1)


MB2 = ["parallel.microbatches=2"]
LAYOUTS = {
    "single": (1, ["parallel.dp=single"]),
    "pp2": (2, ["parallel.dp=single", "parallel.pp=2"] + MB2),
    "dp2pp2": (4, ["parallel.dp=ddp_bucket", "parallel.pp=2"] + MB2),
    "dp2pp2tp2": (8, ["parallel.dp=ddp_bucket", "parallel.pp=2", "parallel.tp=2"] + MB2),
    "fsdp4": (4, ["parallel.dp=fsdp", "parallel.zero_stage=3"]),
}
CONSTANT = ["trainer.warmup_steps=0", "trainer.lr=0.003", "trainer.min_lr=0.003",
            "trainer.grad_clip=0", "trainer.batch_size=16"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_metrics(tmp_path_factory.mktemp("ref"), 1,
                       LAYOUTS["single"][1] + CONSTANT + ["trainer.max_steps=6"])


@pytest.mark.parametrize("saved_under,resumed_under", [
    ("pp2", "single"), ("single", "dp2pp2"), ("dp2pp2tp2", "fsdp4")])
def test_resume_across_pipeline_layouts(tmp_path, uninterrupted, saved_under, resumed_under):
    resumed = save_then_resume(tmp_path, LAYOUTS[saved_under], LAYOUTS[resumed_under], CONSTANT)
    assert_parity(uninterrupted[3:], resumed)


ZB = ["parallel.pp=2", "parallel.microbatches=2"]
LAYOUTS4 = {  # 4 layers: zbv's two chunks per rank need P * 2 of them
    "single": (1, ["parallel.dp=single"]),
    "zbv-pp2": (2, ["parallel.dp=single", "parallel.pp_schedule=zbv"] + ZB),
    "zb1p-dp2pp2": (4, ["parallel.dp=ddp_bucket", "parallel.pp_schedule=zb1p"] + ZB),
    "1f1b-pp2": (2, ["parallel.dp=single", "parallel.pp_schedule=1f1b"] + ZB),
    "torch_pp-pp2": (2, ["parallel.pp_impl=torch", "parallel.pp_schedule=1f1b"] + ZB),
    "torch_tp-tp2": (2, ["parallel.tp_impl=torch", "parallel.tp=2"]),
}


@pytest.fixture(scope="module")
def uninterrupted4(tmp_path_factory):
    return run_metrics(tmp_path_factory.mktemp("ref4"), 1, LAYOUTS4["single"][1] + CONSTANT
                       + ["model.n_layer=4", "trainer.max_steps=6"])


@pytest.mark.parametrize("saved_under,resumed_under", [
    ("zbv-pp2", "single"), ("zb1p-dp2pp2", "1f1b-pp2"),
    ("torch_pp-pp2", "torch_pp-pp2"), ("torch_tp-tp2", "torch_tp-tp2")])
def test_resume_from_zero_bubble_and_torch_references(tmp_path, uninterrupted4, saved_under,
                                                      resumed_under):
    """A zero-bubble run's snapshot (the split backward's W ran before it was taken)
    resumes under another layout and schedule; PyTorch's pipelining and DTensor TP
    references save and load their AdamW state like our own strategies (constant lr:
    a lost optimizer state would change every resumed step)."""
    resumed = save_then_resume(tmp_path, LAYOUTS4[saved_under], LAYOUTS4[resumed_under],
                               CONSTANT + ["model.n_layer=4"])
    assert_parity(uninterrupted4[3:], resumed)


def test_pp_snapshot_samples_like_the_run_that_wrote_it(tmp_path):
    sample = ["sample.length=60", "sample.seed=5"]
    train = run_job(tmp_path, 2, LAYOUTS["pp2"][1] + ["trainer.max_steps=3"] + sample)
    assert train.returncode == 0, train.stderr[-3000:]
    after_training = train.stdout.split("---- sample ----\n", 1)[1]
    sampled = run_job(tmp_path, 1, ["mode=sample"] + sample)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert sampled.stdout == after_training and after_training.strip()


BAD_PP = [
    (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2",
         "model.n_layer=4", "parallel.microbatches=3"], "must be a multiple of it"),
    (2, ["parallel.pp=2", "parallel.dp=fsdp", "parallel.zero_stage=3"], "zero_stage=3 with parallel.pp"),
    (2, ["parallel.pp=2", "model.n_layer=1"], "more stages than layers"),
    (2, ["parallel.pp=2", "parallel.pp_layers=[2,1]"], "pp_layers"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=3",
         "model.n_layer=6"], "zbv always runs 2 chunks per rank"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=zbv", "model.n_layer=3"], "more stages than layers"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=zb1p", "trainer.activation_checkpointing=true"],
     "use one of them"),
    (4, ["parallel.pp=2", "parallel.allreduce=ring", "trainer.device=cuda"], "refused on CUDA"),
]


@pytest.mark.parametrize("nproc,overrides,needle", BAD_PP)
def test_bad_pipeline_layout_is_one_clear_error(nproc, overrides, needle):
    """Every rank runs these checks (config.validate) before any process group exists."""
    from config import load_config
    from errors import UserError
    with pytest.raises(UserError, match=needle):
        load_config(overrides, nproc)


def test_bad_pipeline_layout_stops_every_rank_with_one_line(tmp_path):
    """...and in a job that is one line on every rank and status 2 (a strategy's refusal:
    parallel/layout.py asks fsdp; served, as test_tp's)."""
    from test_bad_input import assert_clean_failure
    nproc, overrides, needle = BAD_PP[1]
    assert_clean_failure(run_job(tmp_path, nproc, overrides, timeout=120), needle)
