"""The benchmark commands: bench.run end to end on a tiny model (its reports carry the jobs'
own numbers), and the committed results read back by the code that writes them."""

import glob
import json
import os
import re
from statistics import median

import pytest

from bench import cp_balance, data, fault_tolerance, snapshot, snapshot_async
from bench.run_engine import experts, jobs, stats, tables
from bench.run_engine.variants import BY_NAME
from harness import REPO, job_env, python, read_metrics, run_tree

STEPS, WARMUP = 6, 2


VARIANTS = "single,torch_ddp,single_compiled,single_compiled_model"


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One bench.run for both tests below (each bench.run and each of its jobs starts
    interpreters): `single` and torch_ddp, and per-block and whole-model compilation
    beside them (backend aot_eager). Returns (out, runs, results.json, results.md)."""
    tmp_path = tmp_path_factory.mktemp("bench")
    out, runs = tmp_path / "out", tmp_path / "runs"
    cmd = [python(), "-m", "bench.run", "--model", "tiny", "--variants", VARIANTS,
           "--set", "trainer.compile_backend=aot_eager", "--rounds", "1", "--steps", str(STEPS),
           "--warmup", str(WARMUP), "--out", str(out), "--runs-dir", str(runs)]
    result = run_tree(cmd, 300, "bench.run", cwd=REPO, env=job_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, runs, json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


@pytest.mark.long  # the long tier: a benchmark command run (tests/README.md)
def test_bench_reports_the_jobs_numbers(bench_run):
    out, runs, doc, md = bench_run
    assert (out / "step_time.png").stat().st_size > 0
    assert f"python -m bench.run --model tiny --variants {VARIANTS}" in md
    # by default the embedded corpus, the same on every machine: no data.path of this one
    assert not [o for o in doc["settings"]["overrides"] if o.startswith("data.path")]

    medians = {}
    for name in ("single", "torch_ddp"):
        metrics = read_metrics(str(runs / f"r1-{name}"))  # what the job itself logged
        assert len(metrics) == STEPS
        medians[name] = median(m["step_ms"] for m in metrics[WARMUP:])
        got = doc["variants"][name]
        assert got["step_ms"] == pytest.approx(medians[name])
        assert got["state_bytes"] == metrics[-1]["state_bytes"]
        assert got["peak_mem_mb"] == max(m["peak_mem_mb"] for m in metrics)
        assert [j["records"] for j in doc["jobs"] if j["variant"] == name] == [metrics]
        assert f"| {name} | " in md and f"| {tables.fmt_ms(medians[name])} |" in md
    ratio = doc["variants"]["torch_ddp"]["vs_single"]["median"]
    assert ratio == pytest.approx(medians["torch_ddp"] / medians["single"])
    assert f"{ratio:.2f}x" in md
    # same run under both layouts (the parity rule), so the ratio compares like with like
    assert doc["variants"]["torch_ddp"]["loss_rel_diff_vs_single"] <= 1e-5


@pytest.mark.long  # the long tier: a benchmark command run (tests/README.md)
def test_bench_reports_compilation_against_eager(bench_run):
    """Per-block and whole-model compilation beside eager on the tiny model (aot_eager):
    the compilation table carries step 1's compile time as the job logged it, the loss
    against eager, and per-block against whole-model compilation."""
    out, runs, doc, md = bench_run
    for name in ("single_compiled", "single_compiled_model"):
        first = read_metrics(str(runs / f"r1-{name}"))[0]
        got = doc["variants"][name]["compile"]
        assert got["compile_s_per_round"] == [first["compile_ms"] / 1000] and first["compile_ms"] > 0
        assert got["loss_rel_diff_vs_reference"] <= 1e-4, got
        assert f"| {name} | " in md.split("## Compilation")[1]
    assert "compile" not in doc["variants"]["single"]
    assert "compile" not in doc["variants"]["torch_ddp"]
    assert doc["variants"]["single_compiled"]["compile"]["vs_whole_model"]["median"] > 0
    assert "per block (`single_compiled`) against the whole model" in md


def test_bench_commands_write_under_runs_by_default(monkeypatch):
    """Without --out every command writes into the git-ignored runs/bench/, never into the
    committed docs/bench/ (publishing results is a step of its own: docs/benchmarks.md)."""
    import argparse
    import inspect
    from bench import gpu_vs_nanogpt, run, shakespeare_curve

    class Parsed(Exception):
        pass

    real, outs = argparse.ArgumentParser.parse_known_args, {"bench.run": run.parse_args([]).out}

    def capture(self, args=None, namespace=None):  # parse_args's too: it calls this
        outs[self.prog] = real(self, args, namespace)[0].out
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    for module, argv in ((cp_balance, []), (data, []), (fault_tolerance, []), (snapshot, []),
                         (snapshot_async, []), (shakespeare_curve, ["--data", "x"])):
        with pytest.raises(Parsed):
            module.main(argv)
    print(outs)
    assert len(outs) == 7 and all(o.startswith(os.path.join("runs", "bench", "")) for o in outs.values()), outs
    assert 'os.path.join("runs", "bench", "gpu-vs-nanogpt"' in inspect.getsource(gpu_vs_nanogpt.main)


def test_unknown_strategy_is_skipped_with_the_configs_reason():
    why, _ = jobs.check(["parallel.dp=no_such_strategy"], 2)
    assert "no_such_strategy" in why
    assert jobs.check(["parallel.dp=torch_ddp"], 2)[0] is None


def test_textbook_figures():
    ddp, zero3 = stats.textbook(1000, 2, 0), stats.textbook(1000, 2, 3)
    assert ddp["wire_bytes"] == 4000  # ring: 2(N-1)/N x 4 bytes x params
    assert zero3["wire_bytes"] == 1.5 * ddp["wire_bytes"]
    assert (ddp["state_bytes"], zero3["state_bytes"]) == (16000, 8000)


def shape_cfg(grad_accum=1, **model):
    """The textbooks' config shape: 2 layers x 8 wide, 16 tokens, global batch 4."""
    from types import SimpleNamespace as NS
    return NS(model=NS(n_layer=2, n_embd=8, **model), data=NS(block_size=16),
              trainer=NS(batch_size=4, grad_accum=grad_accum))


def test_cp_textbook_is_the_hand_count():
    """Context parallelism's textbook bytes, counted by hand for two layouts of a 2-layer,
    8-wide model, 16 tokens, global batch 4, on 4 ranks and 1000 parameters."""
    cfg = shape_cfg()
    # cp 2 x dp 2: 2 sequences of 8 tokens per rank, keys + values 2 x 2 x 8 x 8 x 4 = 1024 bytes;
    # per layer: forward 1 x kv, backward 1 x (kv + their gradients) + the gradients home
    book = stats.cp_textbook(cfg, 1000, cp=2, n=4)
    assert book["send_bytes"] == 2 * (1024 + 2 * 1024 + 1024)
    assert book["all_reduce_bytes"] == 4000 and book["wire_bytes"] == 2 * 3 / 4 * 4000 + 8192
    # cp 4 x dp 1: 4 sequences of 4 tokens, kv = 2 x 4 x 4 x 8 x 4 = 1024; 3 hops each way + 1
    assert stats.cp_textbook(cfg, 1000, cp=4, n=4)["send_bytes"] == 2 * (3 * 1024 + 3 * 2048 + 1024)
    cfg.trainer.grad_accum = 2  # two micro-batches of half the rows: the same bytes
    assert stats.cp_textbook(cfg, 1000, cp=2, n=4)["send_bytes"] == 8192


def test_cp_allgather_textbook_is_the_hand_count():
    """The all-gather reference's textbook bytes (parallel.cp_impl=allgather), by hand on the
    model above: per layer and micro-batch one all-gather forward, counted by its output,
    and one reduce-scatter backward, counted by its input, each cp x this rank's kv."""
    cfg = shape_cfg()
    # cp 2 x dp 2: kv = 2 x 2 sequences x 8 tokens x 8 x 4 = 1024 bytes; gathered 2 x 1024
    book = stats.cp_allgather_textbook(cfg, 1000, cp=2, n=4)
    assert book["kv_bytes"] == {"all_gather": 2 * 2048, "reduce_scatter": 2 * 2048}
    assert book["kv_wire_bytes"] == {"all_gather": 2048, "reduce_scatter": 2048}  # (cp-1)/cp
    assert book["all_reduce_bytes"] == 4000 and book["payload_bytes"] == 4000 + 8192
    assert book["wire_bytes"] == 2 * 3 / 4 * 4000 + 4096
    # cp 4 x dp 1: kv = 2 x 4 x 4 x 8 x 4 = 1024, gathered 4 x 1024; a ring sends 3/4 of it
    book = stats.cp_allgather_textbook(cfg, 1000, cp=4, n=4)
    assert book["all_gather_bytes"] == book["reduce_scatter_bytes"] == 2 * 4096
    assert book["kv_wire_bytes"]["all_gather"] == 2 * 3072
    cfg.trainer.grad_accum = 2  # two micro-batches of half the rows: the same bytes
    assert stats.cp_allgather_textbook(cfg, 1000, cp=2, n=4)["all_gather_bytes"] == 4096
    # the summary picks each variant's textbook by its parallel.cp_impl
    assert stats.context_impl(BY_NAME["cp2_allgather"]) == "allgather"
    assert stats.context_impl(BY_NAME["cp2"]) == "ring"
    assert BY_NAME["cp2"].reference == "cp2_allgather"


def test_ep_textbook_is_the_hand_count():
    """Expert parallelism's per-rank textbook by hand (1000 dense, 800 expert parameters, 2 blocks of
    4 experts x 8 wide, top 2, 32 tokens a rank): rows, counts, gradients, the reference's rows."""
    cfg, book = shape_cfg(moe_every=1, moe_experts=4, moe_top_k=2), experts.ep_textbook
    two, gathers = book(cfg, 1000, 800, 2, 2), book(cfg, 1000, 800, 2, 2, "allgather")["exchange_bytes"]
    assert two["exchange_bytes"] == {"all_to_all": 4 * 32 * 2 * 8 * 4 * 2, "all_to_all_counts": 2 * 4 * 8}
    assert two["exchange_wire_bytes"]["all_to_all"] == 16384 / 2  # (ep-1)/ep
    assert [book(cfg, 1000, 800, 2, n)[k] for n in (2, 4) for k in ("all_reduce_bytes", "state_bytes")] == [
        4000, 16 * 1400, 4000 + 1600, 16 * 1400]
    assert gathers == dict.fromkeys(("all_gather", "reduce_scatter"), 2 * 32 * 3 * 8 * 4 * 2)  # ep x 32 x (1 + k)
    cfg = shape_cfg(moe_every=2, moe_experts=4, moe_top_k=2, grad_accum=2)  # 1 block, counts x 2
    assert book(cfg, 1000, 800, 2, 4)["exchange_bytes"] == {"all_to_all": 4 * 16 * 2 * 8 * 4, "all_to_all_counts": 64}
    assert not book(cfg, 1000, 800, 1, 2)["exchange_bytes"]  # ep 1: every expert on every rank


@pytest.mark.long  # the long tier: a benchmark command run (tests/README.md)
def test_bench_ep_rank0_exchange_bytes_are_the_textbook_count(tmp_path):
    """ep1, ep_allgather, ep (tiny: 2 blocks x 32 wide, 4 experts, top 2, 2 ranks of 32 tokens):
    rank 0's logged exchange at every step is its per-rank textbook count, by hand."""
    out, runs = tmp_path / "out", tmp_path / "runs"
    result = run_tree([python(), "-m", "bench.run", "--model", "tiny", "--variants", "ep1,ep_allgather,ep",
                       "--set", "model.moe_experts=4", "--rounds", "1", "--steps", "4", "--warmup", "1",
                       "--out", str(out), "--runs-dir", str(runs)], 240, "ep", cwd=REPO, env=job_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc, md = json.loads((out / "results.json").read_text()), (out / "results.md").read_text()
    hand = {"ep1": {}, "ep_allgather": dict.fromkeys(("all_gather", "reduce_scatter"), 2 * 32 * 3 * 32 * 4 * 2),
            "ep": {"all_to_all": 4 * 32 * 2 * 32 * 4 * 2, "all_to_all_counts": 2 * 4 * 8}}  # x 4 bytes x 2 blocks
    assert {v: doc["variants"][v]["textbook"]["exchange_bytes"] for v in hand} == hand
    for name, book in hand.items():  # rank 0's metrics, as the job logged them, every step
        got = [{k: m.get(f"comm_{k}_bytes", 0) for k in experts.KINDS}
               for m in read_metrics(str(runs / f"r1-{name}"))]
        assert got == [{k: book.get(k, 0) for k in experts.KINDS}] * 4, name
    assert md.split("## Expert parallelism")[1].count("1.00x (exact)") == 4 and BY_NAME["ep"].reference


@pytest.mark.parametrize("N", [2, 3, 4, 8])
def test_cp_balance_accounting_contiguous_imbalanced_zigzag_balanced(N):
    """bench.cp_balance's block lists: both splits compute every unmasked (query chunk,
    key chunk) pair exactly once; the zigzag gives each rank 2N+1 blocks (2N of causal
    work), the contiguous split rank r 4r+3 (4r+2): rank N-1 does 2N-1 times rank 0's work."""
    wanted = sorted((q, k) for q in range(2 * N) for k in range(q + 1))
    for split in cp_balance.SPLITS:
        done = [b for r in range(N) for b in cp_balance.rank_blocks(split, r, N)]
        assert sorted((q, k) for q, k, _ in done) == wanted, split
        assert all(causal == (q == k) for q, k, causal in done), split
    zigzag = [cp_balance.accounting("zigzag", r, N) for r in range(N)]
    contiguous = [cp_balance.accounting("contiguous", r, N) for r in range(N)]
    assert {(a["blocks"], a["causal_work"]) for a in zigzag} == {(2 * N + 1, 2 * N)}
    assert [(a["blocks"], a["causal_work"]) for a in contiguous] == \
        [(4 * r + 3, 4 * r + 2) for r in range(N)]
    assert contiguous[-1]["causal_work"] / contiguous[0]["causal_work"] == 2 * N - 1


@pytest.mark.long  # the long tier: a benchmark command run (tests/README.md)
def test_cp_balance_times_the_contiguous_blocks_it_claims():
    """The contiguous split's timing runs ring_attention with contiguous_blocks swapped in:
    rank 0 then holds the sequence's first half and computes only its own causal blocks,
    so (communication stood in) its output is plain causal attention of its tokens. If
    ring_attention stopped looking `blocks` up at call time, this would catch the bench
    silently timing the zigzag twice."""
    import torch
    import torch.nn.functional as F
    from parallel.context_parallel import ring_attention as ring
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    with cp_balance.split_blocks("contiguous"):
        got = ring.ring_attention(q, k, v, 0.0, cp_balance.standin(0, 2))
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert ring.blocks is not cp_balance.contiguous_blocks  # swapped back afterwards


@pytest.mark.long  # the long tier: a benchmark command run (tests/README.md)
def test_cp_balance_command_writes_its_tables(tmp_path):
    """`python -m bench.cp_balance` end to end on a tiny sequence (seconds): results.md's rows
    are its table functions' rendering of results.json, every rank of both splits timed."""
    cmd = [python(), "-m", "bench.cp_balance", "--seq", "16", "--cp", "2", "--repeats", "1",
           "--out", str(tmp_path)]
    result = run_tree(cmd, 120, "bench.cp_balance", cwd=REPO, env=job_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert len(doc["rows"]) == 4 and all(r["total_ms"] > 0 for r in doc["rows"])
    assert cp_balance_rows(doc) == table_rows((tmp_path / "results.md").read_text().splitlines())


def cp_balance_rows(doc):
    rows = doc["rows"]
    return (cp_balance.summary_table(cp_balance.summarize(rows)) + cp_balance.rank_table(rows)
            + cp_balance.whole_table(doc["whole"], doc["settings"]["seq"]))


def test_committed_results_name_no_path_of_one_machine():
    """The committed benchmark results and docs record commands and settings a fresh
    clone can run as written: no absolute path of the machine that made them."""
    machine_path = re.compile(r"(?<![\w.<])/(work|tmp|home|Users|root|mnt|opt|srv)/")
    files = glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True) + \
        glob.glob(os.path.join(REPO, "docs", "**", "*.json"), recursive=True) + \
        [os.path.join(REPO, "README.md"), os.path.join(REPO, "bench", "README.md")]
    found = []
    for path in files:
        with open(path) as f:
            found += [f"{os.path.relpath(path, REPO)}:{n}: {m.group(0)}"
                      for n, line in enumerate(f, 1) if (m := machine_path.search(line))]
    assert len(files) > 8 and not found, found


@pytest.mark.long  # the long tier: a benchmark command run (tests/README.md)
def test_bench_data_prepare_reports_what_prepare_wrote(tmp_path):
    """bench.data's prepare step on a 1 MB generated corpus, as the command runs it (a
    worker process): its MB and tokens are the index's own (the full command takes
    minutes; this is the part that reads prepare's output format)."""
    size = data.generate(str(tmp_path / "text"), 1, 1)
    got = data.prepare(str(tmp_path / "text"), str(tmp_path / "tokens"), "char", 1, job_env())
    index = json.loads((tmp_path / "tokens" / "index.json").read_text())
    assert size == 2**20 and got["text_mb"] == pytest.approx(1.0, rel=0.01)
    assert got["tokens"] == index["tokens"] > 0 and got["shards"] == len(index["shards"])


def committed(*parts):
    return os.path.join(REPO, "docs", "bench", *parts)


def table_rows(lines):
    return [ln for ln in lines if ln.startswith("|")]


# the committed results.json that bench.run wrote (the standalone commands' have tests below)
RUN_RESULTS = sorted(os.path.basename(os.path.dirname(p)) for p in glob.glob(committed("*", "results.json"))
                     if json.load(open(p))["command"].startswith("python -m bench.run "))


@pytest.mark.parametrize("name", RUN_RESULTS)
def test_committed_run_results_render_as_committed(name):
    """A committed bench.run results.json still renders through bench/run_engine/tables.py
    into the committed tables, figure for figure (a change of the tables' format fails
    here: the committed results then no longer read as the code writes them)."""
    doc = json.loads(open(committed(name, "results.json")).read())
    md = tables.markdown(doc["command"], doc["settings"], doc["variants"], doc["skipped"],
                         doc["jobs"], "step_time.png").splitlines()
    want = open(committed(name, "results.md")).read().splitlines()
    assert f"    {doc['command']}" in md and table_rows(md) == table_rows(want)


def test_committed_cp_balance_results_render_as_committed():
    """bench.cp_balance's tables, rendered from its committed results.json, are the rows of
    its committed results.md."""
    doc = json.loads(open(committed("cp_balance", "results.json")).read())
    want = open(committed("cp_balance", "results.md")).read().splitlines()
    assert cp_balance_rows(doc) == table_rows(want)


def test_committed_fault_tolerance_results_render_as_committed():
    """bench.fault_tolerance's tables and lines, rendered from its committed results.json,
    are those of its committed results.md."""
    doc = json.loads(open(committed("fault_tolerance", "results.json")).read())
    want = open(committed("fault_tolerance", "results.md")).read()
    assert all(line in want for line in fault_tolerance.tables(doc["summary"]) if line)


def test_committed_snapshot_and_data_results_render_as_committed():
    """bench.snapshot's and bench.data's tables, rendered from their committed results.json,
    are the rows of their committed results.md."""
    snap = json.loads(open(committed("snapshot", "results.json")).read())
    want = open(committed("snapshot", "results.md")).read().splitlines()
    assert snapshot.table(snap["rows"]) == table_rows(want)
    doc = json.loads(open(committed("data", "results.json")).read())
    names = list(dict.fromkeys(r["corpus"] for r in doc["train"]))  # round 0 runs them in order
    want = open(committed("data", "results.md")).read().splitlines()
    assert data.prepare_table(doc["prepare"]) + data.train_table(
        data.train_medians(doc["train"], names)) == table_rows(want)


def synthetic_job(mode, round_, intervals, saves):
    """A bench.snapshot_async job as its results.json holds it (stamps made up)."""
    return {"round": round_, "mode": mode, "window_s": sum(intervals.values()) + 1.0, "saves": saves,
            "intervals_s": {str(s): v for s, v in intervals.items()}, "step_ms": 1000.0,
            "rss_mb": [100.0, 90.0], "part_bytes": [2**20, 2**20],
            "snapshot_ms": [500.0] * saves, "snapshot_wait_ms": [0.0] * saves}


def test_snapshot_async_lost_per_save_is_the_extra_time_of_a_save_period():
    """Steps 5-35 of 1 s; a save every 6 steps adds 0.5 s to the save step (sync) or 0.05 s
    to the step after it (async): 500 and 50 ms lost per save, a ratio of 10%, both within
    the jobs and against `none`'s window. A load spike in one async step moves only the
    window's figure; load that doubles a whole job's steps moves neither within-job one."""
    steps = range(5, 36)
    saves = len([s for s in steps if s % 6 == 0])
    none = {s: 1.0 for s in steps}
    sync = {s: 1.5 if s % 6 == 0 else 1.0 for s in steps}
    async_ = {s: 1.05 if s % 6 == 1 else 1.0 for s in steps}
    jobs = [synthetic_job("none", 0, none, 0), synthetic_job("sync", 0, sync, saves),
            synthetic_job("async", 0, async_, saves)]
    s = snapshot_async.summarize(jobs, 6)
    assert s["sync"]["within_lost_ms"]["median"] == pytest.approx(500)
    assert s["sync"]["window_lost_ms"]["median"] == pytest.approx(500)
    assert s["async"]["within_lost_ms"]["median"] == pytest.approx(50)
    assert s["async"]["offset_extra_ms"] == pytest.approx([0, 50, 0, 0, 0, 0])
    assert s["none"]["within_lost_ms"]["median"] == pytest.approx(0)
    assert s["async_vs_sync"]["median"] == pytest.approx(0.1)
    assert s["async_vs_sync_window"]["median"] == pytest.approx(0.1)
    jobs[2] = synthetic_job("async", 0, {**async_, 10: 3.0}, saves)  # one slow step (position 4)
    jobs[1] = synthetic_job("sync", 0, {s: 2 * v for s, v in sync.items()}, saves)  # a busy job
    s = snapshot_async.summarize(jobs, 6)
    assert s["async"]["window_lost_ms"]["median"] == pytest.approx(50 + 2000 / saves)
    assert s["async"]["within_lost_ms"]["median"] == pytest.approx(50)
    assert s["sync"]["within_lost_ms"]["median"] == pytest.approx(1000)  # its steps took 2 s
    assert "**5% (5% to 5%)** within the jobs" in snapshot_async.tables(s)[3]


def test_committed_snapshot_async_results_render_as_committed():
    """bench.snapshot_async's tables and ratio line, rendered from its committed results.json,
    are those of its committed results.md."""
    doc = json.loads(open(committed("snapshot_async", "results.json")).read())
    want = open(committed("snapshot_async", "results.md")).read().splitlines()
    time_table, where_table, mem_table, ratio = snapshot_async.tables(doc["summary"])
    assert time_table + where_table + mem_table == table_rows(want) and ratio in want


def test_committed_shakespeare_curve_results_render_as_committed():
    """bench.shakespeare_curve's two tables, rendered from its committed results.json, are
    those of its committed results.md."""
    from bench import shakespeare_curve
    for name in ("shakespeare-small", "shakespeare-laptop"):
        doc = json.loads(open(committed(name, "results.json")).read())
        want = open(committed(name, "results.md")).read().splitlines()
        best, curve = shakespeare_curve.tables(doc["runs"], doc["settings"]["size"])[::-1]
        assert best + curve == table_rows(want), name
