"""The planner (mode=plan, planner/) against real runs, and the command itself.

- tests/planner_worker.py trains a matrix of real layouts under torchrun on 2 and 4
  ranks (ddp_bucket, fsdp stages 1-3, tp with and without sequence parallelism, every
  pipeline schedule, cp, checkpointing, hybrid sharding and offload, compositions
  of dp, tp, pp and cp, and expert parallelism with fsdp and tp): for every rank, the
  planner's state bytes (device and host) and bytes per collective kind equal what the
  run counts (exactly; the all-to-all's routed rows summed over the ranks), and its
  activation bytes are within 10% of the meter's; plan.out's collectives are rank 0's.
- every layout of tests/layout_worker.py's parity matrix the planner models: plan.out's
  byte figures equal, as integers, what the run logs.
- `python main.py mode=plan` on a laptop-sized job: no process group, seconds, the
  table and `plan.out` JSON; bad input is one line and exit status 2;
- in process: the step-time model's bubble is the simulator's idle share for every
  schedule, and equal step times rank by bytes moved, then memory (docs/planner.md's example).
"""

import json
import os
import re

import pytest

from harness import REPO, job_env, layout_session, layout_worker_result, python, run_tree, worker_result
from planner_worker import BATCH, BLOCK, CASES, N_EMBD, N_HEAD
from planner.memory import activation_bytes, host_state_bytes, state_bytes
from planner.shapes import Layout, Workload
from planner.traffic import comm_bytes

pytestmark = pytest.mark.worker_sessions(layout_session(2), layout_session(4))  # prefetch.py



def planner_result(world):
    """tests/planner_worker.py's RESULT on `world` ranks, once per session (2 and 4:
    tests/layout_worker.py's session runs it, sharing that launch)."""
    if world in (2, 4):
        return layout_worker_result(world)["planner"]
    return worker_result("planner_worker.py", world, 300)


def planned(world, name):
    fields, n_layer, vocab, *moe = CASES[world][name]
    w = Workload(n_layer=n_layer, n_head=N_HEAD, n_embd=N_EMBD, vocab=vocab, block=BLOCK,
                 batch=BATCH, **(moe[0] if moe else {}))
    return w, Layout(**fields)


ROUTED = "all_to_all"  # rows to the experts' ranks: as many as the router sends (uneven)


def routed_apart(comm):
    """(the bytes of every kind but the all-to-all's rows, the all-to-all's)."""
    return {k: v for k, v in comm.items() if k != ROUTED}, comm.get(ROUTED, 0)


ALL = [(world, name) for world in CASES for name in CASES[world]]


@pytest.mark.parametrize("world,name", ALL, ids=[n for _, n in ALL])
def test_planner_equals_what_the_run_counts(world, name):
    """Per rank: state bytes and each collective kind's bytes exactly; activations
    within 10% of the meter's peak."""
    w, L = planned(world, name)
    ranks = planner_result(world)[name]
    routed = [0, 0]  # the all-to-all's rows, over all ranks: (planned, counted)
    for got in ranks:
        p, r = got["coords"]["pp"], got["shard_rank"]
        comm = {k[len("comm_"):-len("_bytes")]: v for k, v in got["comm"].items()
                if k.endswith("_bytes") and k != "comm_bytes" and v}
        # the rows an expert-parallel rank sends depend on the routing; the even split the
        # planner counts is their mean: every other kind exactly, their sum over the ranks
        (plan_rest, plan_routed), (rest, counted) = routed_apart(comm_bytes(w, L, p, r)), \
            routed_apart(comm)
        assert plan_rest == rest, f"rank {got['rank']}: planned vs counted"
        routed = [routed[0] + plan_routed, routed[1] + counted]
        act = activation_bytes(w, L, p)
        measured = got["activation_peak_bytes"]
        print(f"{name} rank {got['rank']}: activations planned {act} measured {measured} "
              f"({act / measured:.3f}x)")
        assert abs(act / measured - 1) <= 0.10, (act, measured)
    assert routed[0] == routed[1] and (routed[0] > 0) == (L.ep > 1), routed
    # state_bytes (host_state_bytes) in metrics.jsonl: the max over ranks (Strategy.state_figures)
    for measured, planner in (("state_bytes", state_bytes), ("host_state_bytes", host_state_bytes)):
        planned_max = max(planner(w, L, got["coords"]["pp"], got["shard_rank"]) for got in ranks)
        assert {got[measured] for got in ranks} == {planned_max}, measured
    # plan.out's collectives: rank 0's, the rank that logs them
    from planner.figures import metrics_names, rank_figures
    rank0 = next(got for got in ranks if got["rank"] == 0)
    logged = {k: v for k, v in rank0["comm"].items() if k.endswith("_bytes") and v}
    plan_out = {k: v for k, v in metrics_names(rank_figures(w, L)["fullest"]).items()
                if k.startswith("comm_") and v}
    if L.ep > 1:  # rank 0's routed rows and their sum in comm_bytes: its routing's, not the mean
        for d in (plan_out, logged):
            d.pop("comm_bytes"), d.pop(f"comm_{ROUTED}_bytes")
    assert plan_out == logged, f"plan.out {plan_out}, rank 0 logged {logged}"


def modelled(case):
    """A tests/layout_worker.py Case as the planner's (Workload, Layout), or None where the
    planner does not model it (PyTorch's references count no traffic; the ring all-reduce,
    an explicit pp_layers split and cp_impl=allgather are not planned; Muon's state is not
    planned yet: test_muon.py holds its traffic to this plan's)."""
    from layout_worker import BATCH as L_BATCH, BLOCK as L_BLOCK, N_EMBD as L_EMBD, N_HEAD as L_HEAD
    p = case.parallel
    if case.trainer.get("optimizer", "adamw") != "adamw":
        return None
    if case.dp_kind.startswith("torch") or p.get("allreduce") == "ring" \
            or p.get("pp_layers") or p.get("cp_impl", "ring") != "ring" \
            or p.get("reduce_dtype", "fp32") != "fp32":
        return None
    R, schedule = p.get("dp_replicate", 1), p.get("pp_schedule", "1f1b")
    V = {"zbv": 2, "interleaved": p.get("pp_virtual_stages", 1)}.get(schedule, 1)
    fsdp = case.dp_kind == "fsdp"
    L = Layout(dp_kind=case.dp_kind, zero_stage=p.get("zero_stage", 3) if fsdp else 0,
               dp=case.dp * R, pp=case.pp, cp=case.cp, tp=case.tp,
               sp=p.get("sequence_parallel", False), schedule=schedule if case.pp > 1 else "1f1b",
               V=V if case.pp > 1 else 1, M=p.get("microbatches", 1) if case.pp > 1 else 1,
               grad_accum=case.accum, R=R, offload=p.get("offload", False))
    return Workload(n_layer=case.n_layer, n_head=L_HEAD, n_embd=L_EMBD, vocab=case.vocab,
                    block=L_BLOCK, batch=L_BATCH), L


def layout_matrix():
    from layout_worker import CASES as MATRIX
    return [(world, case.name) for world in MATRIX for case in MATRIX[world] if modelled(case)]


@pytest.mark.parametrize("world,name", layout_matrix(), ids=[n for _, n in layout_matrix()])
def test_plan_out_equals_metrics_of_the_layout_matrix(world, name):
    """plan.out's figures under metrics.jsonl's names (planner/figures.metrics_names) equal,
    as integers, what a run of that layout logs: every layout of tests/layout_worker.py's
    matrix the planner models, on its 2, 4 or 8 ranks (results shared with test_tp, test_pp,
    test_cp and test_hsdp). A run logs rank 0's collectives (`comm_<kind>_bytes`,
    `comm_bytes`) and the fullest rank's `state_bytes` (and `host_state_bytes`)."""
    from harness import layout_worker_result
    from layout_worker import CASES as MATRIX
    from planner.figures import metrics_names, rank_figures
    case = next(c for c in MATRIX[world] if c.name == name)
    w, L = modelled(case)
    got = layout_worker_result(world)["cases"][name]
    logged = {k: v for k, v in got["comm"][-1].items() if k.endswith("_bytes") and v}
    logged.update(got["state"])
    planned = metrics_names(rank_figures(w, L)["fullest"])
    planned = {k: v for k, v in planned.items() if k.endswith("_bytes") and v}
    assert planned == logged, f"{L.name()}: planned {planned}, logged {logged}"


RECOMPUTES = {"plain": (False, "full", 1), "checkpointed": (True, "full", 1),
              "selective": (True, "selective", 1), "selective-every2": (True, "selective", 2)}


@pytest.mark.parametrize("recompute", list(RECOMPUTES))
def test_planner_equals_one_process_counts(recompute):
    """In this process (no group): `single`'s state bytes exactly, its activations within
    10%, without activation checkpointing, full, selective, and selective on every 2nd
    block (the meter sees selective's kept matmul outputs through ActivationMeter.hold)."""
    ckpt, mode, every = RECOMPUTES[recompute]
    import torch
    from dp_worker import OneRank
    from model import GPT, GPTConfig
    from parallel.parallelize import parallelize
    from parallel.config import ParallelConfig
    from telemetry.activation_meter import ActivationMeter
    from training.config import TrainerConfig
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, n_head=N_HEAD, n_embd=N_EMBD, vocab_size=65, block_size=BLOCK))
    strategy = parallelize(gpt, OneRank(), ParallelConfig(dp="single"))
    tcfg = TrainerConfig(activation_checkpointing=ckpt, activation_checkpointing_mode=mode,
                         activation_checkpointing_every=every)
    strategy.configure_compute(tcfg)
    strategy.configure_optimizer(tcfg)
    data = torch.randint(0, 65, (BATCH, BLOCK + 1))
    meter = ActivationMeter()
    with meter:
        strategy.forward_backward([(data[:, :-1], data[:, 1:])])
    strategy.optimizer_step(1e-3)
    w = Workload(n_layer=2, n_head=N_HEAD, n_embd=N_EMBD, vocab=65, block=BLOCK, batch=BATCH)
    L = Layout(ckpt=ckpt, ckpt_mode=mode, ckpt_every=every)
    assert state_bytes(w, L, 0, 0) == strategy.last_state_bytes
    print(f"{recompute}: planned {activation_bytes(w, L, 0)}, measured {meter.peak_bytes}")
    assert abs(activation_bytes(w, L, 0) / meter.peak_bytes - 1) <= 0.10


def test_selective_activations_lie_between_none_and_full():
    """The planner's saved bytes: full < selective every 2nd block < selective < none."""
    w = Workload(n_layer=4, n_head=4, n_embd=256, vocab=65, block=128, batch=16)
    got = [activation_bytes(w, Layout(ckpt=ckpt, ckpt_mode=mode, ckpt_every=every), 0)
           for ckpt, mode, every in RECOMPUTES.values()]
    plain, full, selective, every2 = got
    assert full < selective < every2 < plain, got


def test_census_is_the_models_parameters_under_tp():
    """planner/census.py's per-rank parameters are the benchmark's TP split (stats.tp_parameters,
    the placements TP gives rank 0) and the model's own count without TP."""
    from types import SimpleNamespace
    from bench.run_engine import stats
    from model import ModelConfig
    from planner.census import census
    cfg = SimpleNamespace(model=ModelConfig(n_layer=2, n_head=4, n_embd=32),
                          data=SimpleNamespace(tokenizer="char", path="", block_size=16))
    vocab = stats.meta_gpt(cfg).config.vocab_size
    shape = (2, 4, 32, vocab, 16, True)
    assert sum(q.numel for q in census(shape, 1)) == stats.count_params(cfg)
    split = stats.tp_parameters(cfg, 2)
    got = census(shape, 2)
    assert sum(q.numel for q in got if q.replicated) == split["replicated"]
    assert sum(q.numel for q in got if not q.replicated) == split["split"]



PIPELINES = [(schedule, P, M, V) for schedule, Vs in
             [("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (2, 4)), ("zb1p", (1,)), ("zbv", (2,))]
             for V in Vs for P in (2, 4) for M in (P, 2 * P, 4 * P)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb1p", "zbv"])
def test_step_time_bubble_is_the_simulators_idle_share(schedule):
    """The step-time model stretches compute by the schedule's bubble b (the idle share of
    all ranks' time): bubble_ms = compute_ms x b / (1 - b), so the bubble is b of compute
    plus bubble, exactly the simulator's unit_time for (schedule, P, M, V). `compute x b`
    would make it b / (1 + b): a pipeline's cost understated, most for large bubbles."""
    from parallel.pipeline_parallel.schedules import SCHEDULES
    from parallel.pipeline_parallel.simulator import unit_time
    from planner.config import PlanConfig
    from planner.figures import rank_figures
    from planner.machines import PRESETS
    from planner.step_time import step_time
    assert {s for s, *_ in PIPELINES} == set(SCHEDULES)  # every schedule of the registry
    w = Workload(n_layer=16, n_head=4, n_embd=64, vocab=65, block=32, batch=64)
    cases = [c for c in PIPELINES if c[0] == schedule]
    for _, P, M, V in cases:
        L = Layout(dp_kind="single", pp=P, schedule=schedule, V=V, M=M)
        t = step_time(w, L, rank_figures(w, L)["fullest"], PRESETS["H100-80GB"], PlanConfig())
        idle = unit_time(schedule, P, M, V)[1]
        share = t["bubble"] / (t["compute"] + t["bubble"])
        assert idle > 0 and t["compute"] > 0, (P, M, V, idle, t)
        assert abs(share - idle) <= 1e-9 * idle, \
            f"{schedule} P={P} M={M} V={V}: bubble {share:.6f} of compute + bubble, simulator {idle:.6f}"
    print(f"{schedule}: {len(cases)} (P, M, V), bubble shares equal the simulator's")


@pytest.mark.parametrize("schedule,P,M,V", [("gpipe", 8, 520, 1), ("1f1b", 8, 520, 1),
                                            ("interleaved", 8, 264, 2), ("zb1p", 8, 520, 1),
                                            ("zbv", 8, 264, 2)])
def test_long_pipelines_bubble_is_the_simulators_too(schedule, P, M, V):
    """Past P x M x V = 4096 the model takes the bubble from closed forms instead of running
    the simulator: they must be its idle share too (interleaved: (P-1) / (V M + P-1), not
    the 1F1B bubble over V; zbv: (P-1) / (3 V M + P-1))."""
    from parallel.pipeline_parallel.simulator import unit_time
    from planner.step_time import bubble
    assert P * M * V > 4096
    idle = unit_time(schedule, P, M, V)[1]
    got = bubble(schedule, P, M, V)
    print(f"{schedule} P={P} M={M} V={V}: model {got:.6f}, simulator {idle:.6f}")
    assert abs(got - idle) <= 1e-9 * idle, (got, idle)

def plan_command(tmp_path, *overrides, timeout=120):
    cmd = [python(), os.path.join(REPO, "main.py"), "mode=plan", *overrides]
    return run_tree(cmd, timeout, f"mode=plan {overrides}", cwd=str(tmp_path), env=job_env())


def test_plan_command_ranks_layouts_and_writes_every_one(tmp_path):
    """GPT-2 small's shape on 2 nodes of 8 A100s: no torchrun, no process group, seconds;
    the table, and plan.out's objects carry a run's config keys and metrics.jsonl's names,
    and the first one passes the rules a training run checks."""
    out = tmp_path / "plan.json"
    result = plan_command(tmp_path, "config=" + os.path.join(REPO, "configs", "gpt2-124m.yaml"),
                          "plan.nodes=2", "plan.gpus_per_node=8", "plan.gpu=A100-40GB",
                          "trainer.precision=bf16", f"plan.out={out}", "plan.top=5")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(ln.split()[:2] == ["rank", "layout"] for ln in lines), result.stdout
    assert "fastest" in result.stdout and "run the first: torchrun --nnodes=2 " in result.stdout
    seconds = float(re.search(r"planned in ([\d.]+) s", result.stdout).group(1))
    assert seconds < 60, seconds
    items = json.loads(out.read_text())
    assert items[0]["rank"] == 1 and items[0]["fits"]
    for key in ("parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp", "trainer.grad_accum",
                "trainer.activation_checkpointing", "state_bytes", "comm_bytes",
                "activation_peak_mb", "step_ms"):
        assert key in items[0], key
    assert all(o["comm_bytes"] == sum(v for k, v in o.items() if re.fullmatch(r"comm_\w+_bytes", k)
                                      and k != "comm_bytes") for o in items)
    from config import load_config
    overrides = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in items[0].items()
                 if k.startswith(("parallel.", "trainer."))]
    load_config(["config=" + os.path.join(REPO, "configs", "gpt2-124m.yaml")] + overrides, 16)



def test_a_small_model_is_not_split_and_fewer_gpus_are_named(capsys):
    """The default model (4 x 128, 0.8M parameters) on 4 nodes of 8 H100s, in process: its
    kernels are bound by launches, not FLOPs, so splitting it (tp, pp, cp) only adds
    collectives: the first choice has tp = pp = cp = 1, and the plan says that fewer
    GPUs would be as fast (within 5%)."""
    from config import load_config
    from planner.report import plan
    best = plan(load_config(["mode=plan", "plan.nodes=4", "plan.gpus_per_node=8",
                             "plan.gpu=H100-80GB", "plan.top=3"], 1))
    out = capsys.readouterr().out
    print(out)
    L = best["layout"]
    assert (L.tp, L.pp, L.cp) == (1, 1, 1), L.name()
    fewer = re.search(r"fewer GPUs would be as fast: (\d+) \(.*\) at ([\d.]+) ms a step against "
                      r"([\d.]+) on 32", out)
    assert fewer and int(fewer.group(1)) < 32, out
    assert float(fewer.group(2)) <= 1.05 * float(fewer.group(3))


def test_the_first_choice_is_printed_as_commands_that_run_it(tmp_path, capsys, monkeypatch):
    """The plan ends with the whole command to paste (torchrun, the config file, every key
    given that shapes the run, the precision it priced, the layout) and the dry run of it.
    Through the config loader, each gives the first choice's layout and the planned
    precision and keeps the given keys; a given parallel.* key is the search's to replace.
    The dry-run line runs, in process (a small model, 1 x 4, bf16)."""
    import shlex
    from config import load_config
    from planner.dryrun import layout_of
    from planner.report import plan
    small = ["model.n_layer=2", "model.n_embd=64", "data.block_size=64", "trainer.batch_size=16"]
    best = plan(load_config(["mode=plan", *small, "trainer.max_steps=7", "parallel.dp=ddp_naive",
                             "trainer.precision=bf16", "plan.nodes=1", "plan.gpus_per_node=4",
                             "plan.gpu=A100-80GB", "plan.top=1"], 1))
    out = capsys.readouterr().out
    lines = {ln.split(": ", 1)[0]: shlex.split(ln.split(": ", 1)[1]) for ln in out.splitlines()
             if ln.startswith(("run the first: ", "try it here first: "))}
    run, dry = lines["run the first"], lines["try it here first"]
    print(shlex.join(run), shlex.join(dry), sep="\n")
    assert run[:3] == ["torchrun", "--standalone", "--nproc_per_node=4"] and run[3] == "main.py"
    assert dry[:3] == ["python", "main.py", "mode=dryrun"]
    for cfg, world in ((load_config(run[4:], 4), 4), (load_config(dry[2:], 1), None)):
        world = world or cfg.plan.nodes * cfg.plan.gpus_per_node
        assert world == 4 and layout_of(cfg, world) == best["layout"], best["layout"].name()
        assert (cfg.trainer.precision, cfg.trainer.max_steps, cfg.model.n_layer) == ("bf16", 7, 2)
    monkeypatch.chdir(tmp_path)
    import main
    main.main(dry[2:], 0, 1, 0)
    assert f"{best['layout'].name()} on 1 x 4 ranks" in capsys.readouterr().out


def test_plan_search_false_evaluates_exactly_the_configured_layout(tmp_path, capsys):
    """`plan.search=false`, in process: one layout, the one the parallel.* and trainer.*
    keys give (no search, its grad_accum kept), printed part by part with its MFU and
    memory per rank, and written to plan.out under the run's keys."""
    import json
    from config import load_config
    from planner.report import plan
    out = tmp_path / "one.json"
    keys = ["parallel.dp=fsdp", "parallel.zero_stage=1", "parallel.dp_replicate=2", "parallel.tp=2",
            "parallel.sequence_parallel=true", "parallel.pp=2", "parallel.pp_schedule=interleaved",
            "parallel.pp_virtual_stages=2", "parallel.microbatches=4", "trainer.grad_accum=2",
            "trainer.activation_checkpointing=true"]
    plan(load_config(["config=" + os.path.join(REPO, "configs", "gpt2-124m.yaml"), "mode=plan",
                      "plan.search=false", "plan.nodes=2", "plan.gpus_per_node=8",
                      "plan.gpu=A100-80GB", "trainer.precision=bf16", "trainer.batch_size=512",
                      f"plan.out={out}", *keys], 1))
    text = capsys.readouterr().out
    print(text)
    assert "layout: dp2x2 tp2sp pp2 fsdp1 interleaved V2 M4 ga2 ckpt full on 16 GPUs\n" in text
    assert re.search(r"step [\d.]+ ms, MFU [\d.]+%", text)
    for part in ("compute", "pipeline bubble", "TP collectives", "pipeline sends",
                 "exposed gradient sync"):
        assert re.search(rf"^  {part} +[\d.e+-]+ ms$", text, re.M), part
    assert re.search(r"memory per rank .*: state [\d.]+ GB \+ activations [\d.]+ GB, needs", text)
    assert "rank  layout" not in text  # no ranking table: nothing was searched
    items = json.loads(out.read_text())
    assert len(items) == 1
    got = {k: v for k, v in items[0].items() if k.startswith(("parallel.", "trainer."))}
    for kv in keys:
        k, v = kv.split("=")
        assert str(got[k]).lower() == v, (k, got[k], v)
    from errors import UserError
    with pytest.raises(UserError, match="plan.search=false: tp x pp x cp = 3 does not divide the 8"):
        plan(load_config(["mode=plan", "plan.search=false", "parallel.tp=3"], 1))


def readme_plan_example():
    """docs/planner.md's first example: its overrides and its table's layouts, in order."""
    text = open(os.path.join(REPO, "docs", "planner.md")).read()
    command = re.search(r"```bash\n(python main.py mode=plan .*?)\n```", text, re.S).group(1)
    overrides = command.replace("\\\n", " ").split()[2:]
    table = text[text.index("```", text.index(command) + len(command) + 3) + 3:]
    table = table[:table.index("```")]
    layouts = [re.split(r"\s{2,}", line.strip())[1] for line in table.splitlines()
               if re.match(r"\s+\d+\s{2}", line)]
    return overrides, layouts


def test_plan_breaks_ties_by_bytes_moved_then_memory(tmp_path, capsys):
    """Layouts are ranked by predicted step time, then by the bytes a step moves, then by
    memory: in process, the example of docs/planner.md (GPT-2 small on 2 x 8 A100s) ranks
    as the page shows it (dp16 fsdp3 first: ZeRO-3's sharded optimizer step is shorter
    than ddp_bucket's, its gathers hide behind compute), and every pair of ranked layouts
    in plan.out is in (step_ms, the fullest rank's comm_bytes, memory_bytes)
    order, with ties in step time
    (fsdp stages 1 and 2 of one layout, whose optimizer shards are the same) that the
    bytes or the memory decide."""
    from config import load_config
    from planner.report import plan
    overrides, readme_layouts = readme_plan_example()
    assert "mode=plan" in overrides and readme_layouts[:2] == ["dp16 fsdp3", "dp16 ddp_bucket"]
    out = tmp_path / "plan.json"
    overrides = [("config=" + os.path.join(REPO, o.split("=", 1)[1])) if o.startswith("config=")
                 else o for o in overrides if not o.startswith("plan.out=")] + [f"plan.out={out}"]
    plan(load_config(overrides, 1))
    printed = [re.split(r"\s{2,}", line.strip())[1] for line in capsys.readouterr().out.splitlines()
               if re.match(r"\s+\d+\s{2}", line)]
    assert printed == readme_layouts, f"docs/planner.md's example ranks {readme_layouts}, the plan {printed}"
    ranked = [o for o in json.loads(out.read_text()) if o["rank"]]
    # the bytes the fullest rank moves (plan.out's comm_bytes are rank 0's, as a run logs them)
    keys = [(o["step_ms"], o["fullest_rank"]["comm_bytes"], o["memory_bytes"]) for o in ranked]
    for i, (a, b) in enumerate(zip(keys, keys[1:])):
        assert a <= b, f"rank {i + 1} {ranked[i]['layout']} {a} before rank {i + 2} {ranked[i + 1]['layout']} {b}"
    decided = sum(a[0] == b[0] and a[1:] != b[1:] for a, b in zip(keys, keys[1:]))
    assert decided > 0
    print(f"{len(ranked)} layouts ranked, {decided} adjacent ties in step time decided by bytes or memory")

def counterpart_key(item):
    """A plan.out layout's keys without hybrid sharding, offload and grad_accum (which the
    planner picks per layout): what names the same layout sharded over all dp ranks."""
    return tuple(sorted((k, v) for k, v in item.items() if k.startswith(("parallel.", "trainer."))
                        and k not in ("parallel.dp_replicate", "parallel.offload",
                                      "trainer.grad_accum")))


def planned_items(tmp_path, *overrides):
    from config import load_config
    from planner.report import plan
    out = tmp_path / f"plan-{len(list(tmp_path.iterdir()))}.json"
    plan(load_config(["config=" + os.path.join(REPO, "configs", "gpt2-124m.yaml"),
                      "trainer.precision=bf16", f"plan.out={out}", *overrides], 1))
    return json.loads(out.read_text())


def test_plan_proposes_hsdp_across_nodes_where_it_wins_and_offload_where_nothing_else_fits(
        tmp_path):
    """In process. GPT-2 small on 2 x 8 A100s (docs/planner.md's example): HSDP layouts are
    proposed, one replica group per node, each faster than the same layout sharded over
    both nodes (its all-gathers on NVLink, one all-reduce of a shard across); on 1 x 8,
    none. GPT-2 XL on 2 L4s of 16 GB: nothing fits without offload; every ranked layout
    is offloaded, the same layout without it refused, and most of its state on the host."""
    two = planned_items(tmp_path, "plan.nodes=2", "plan.gpus_per_node=8", "plan.gpu=A100-80GB")
    by_key = {counterpart_key(o): o for o in two if "parallel.dp_replicate" not in o}
    hybrid = [o for o in two if o.get("parallel.dp_replicate") and o["rank"]]
    assert hybrid, "no HSDP layout proposed across 2 nodes"
    for o in hybrid:
        plain = by_key[counterpart_key(o)]
        assert o["parallel.dp_replicate"] == 2 and o["step_ms"] < plain.get("step_ms", float("inf"))
        assert o["comm_bytes_by_link"]["inter_node"] < plain["comm_bytes_by_link"]["inter_node"]
        print(f"{o['layout']}: {o['step_ms']:.4g} ms against {plain['layout']}'s "
              f"{plain.get('step_ms', 0):.4g}; across nodes {o['comm_bytes_by_link']['inter_node']:.3g} "
              f"B against {plain['comm_bytes_by_link']['inter_node']:.3g}")
    one = planned_items(tmp_path, "plan.nodes=1", "plan.gpus_per_node=8", "plan.gpu=A100-80GB")
    assert not any("parallel.dp_replicate" in o for o in one)

    xl = planned_items(tmp_path, "model.n_layer=48", "model.n_head=25", "model.n_embd=1600",
                       "plan.nodes=1", "plan.gpus_per_node=2", "plan.gpu=L4",
                       "plan.gpu_memory_gb=16")
    ranked = [o for o in xl if o["rank"]]
    assert ranked and all(o.get("parallel.offload") for o in ranked)
    refused = {counterpart_key(o): o for o in xl if not o["fits"]}
    for o in ranked:  # offloaded because the same layout does not fit
        assert counterpart_key(o) in refused, o["layout"]
        assert o["host_state_bytes"] > o["state_bytes"]


@pytest.mark.parametrize("overrides,message", [
    (["plan.gpu=MI300X"], "plan.gpu='MI300X' is not a preset"),
    (["model.n_layer=48", "model.n_head=25", "model.n_embd=1600", "plan.gpus_per_node=1",
      "plan.gpu=L4", "plan.gpu_memory_gb=16"], "no layout fits in 16 GB per GPU on 1 GPUs"),
    (["plan.nodes=0"], "plan.nodes=0 and plan.gpus_per_node=8 must be >= 1"),
    (["plan.search=false", "parallel.dp=ddp_naive"],
     "plan.search=false models parallel.dp=single, ddp_bucket or fsdp, not 'ddp_naive'"),
    (["plan.search=false", "plan.param_gather_bytes=3"],
     "plan.param_gather_bytes=3 must be 4 (fp32 parameters gathered, as this product does) or 2"),
], ids=["unknown-gpu", "does-not-fit", "no-nodes", "search-false-strategy", "gather-bytes"])
def test_plan_bad_input_is_one_line_and_status_2(tmp_path, overrides, message):
    result = plan_command(tmp_path, *overrides)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert message in result.stderr and result.stderr.startswith("error: "), result.stderr
