"""`python -m bench.snapshot_async`: training time lost per snapshot, synchronous against
asynchronous (trainer.snapshot_async), and what the staging copy costs in host memory.

    python -m bench.snapshot_async                 # mid-size model, 3 rounds: ~8 min on 2 cores
    python -m bench.snapshot_async --model small --steps 12 --save-every 4 --warmup 2 --rounds 1 --out "$(mktemp -d)"   # smoke test, ~30 s

Each round runs three 2-rank torchrun jobs of main.py's training (gloo, 1 thread per
rank, `ddp_bucket`, the embedded corpus, a snapshot directory on local disk), in an
order that rotates between rounds so a noisy neighbour hits every mode alike:

- `none`: no periodic save (only the last step's, which every job makes);
- `sync`: a save every --save-every steps, every rank waiting for its write;
- `async`: the same saves with trainer.snapshot_async=true.

Every rank stamps each step's metrics record (written after the step and its save);
an interval runs from one stamp to the next, so it holds everything between: the
step, its save, the stop check, a commit. Training time lost per save, two ways:

- within the job (the headline: other users' load drifts between jobs more than
  within one): for each position of the save period (the save step, the step
  after, ...) the median interval over the job's periods, minus the job's baseline,
  the median interval of the period's second half (by then a background write is
  done); lost per save = the sum over the first half. On `none` (no save) the same
  sum is the noise floor;
- against `none`: (the job's window - the `none` window of the same round) / the
  periodic saves in it. A window runs from the end of step --warmup to the end of
  the run, the last step's save included (synchronous in every mode, after the
  async job drained its write in flight, so it cancels out).

The async/sync ratio is taken within a round, both ways. Reported: medians and ranges
over rounds, the time by period position, the save step's own cost (snapshot_ms: the
whole save, or staging plus any wait; snapshot_wait_ms), the median step time
(compute only), each rank's peak RSS (with the staging copy: async), and each rank's
part file of the last snapshot (bytes written per rank and save). Results: --out's
results.json (every job) and results.md, written by bench/report.py.
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import report  # noqa: E402

MODELS = {  # few tokens a step: a save is large next to a step (the state, not the batch)
    "mid": ["model.n_layer=8", "model.n_head=12", "model.n_embd=768", "data.block_size=32",
            "trainer.batch_size=2"],  # 56.8M parameters: 650 MiB of weights and AdamW state
    "small": ["model.n_layer=2", "model.n_head=4", "model.n_embd=128", "data.block_size=32",
              "trainer.batch_size=4"],
}
COMMON = ["parallel.dp=ddp_bucket", "trainer.log_every=1", "trainer.eval_every=0",
          "trainer.warmup_steps=2", "trainer.keep_snapshots=1", "sample.length=0",
          "wandb.mode=disabled", "parallel.timeout_s=300"]
MODES = {"none": ["trainer.save_every=0"], "sync": [], "async": ["trainer.snapshot_async=true"]}
NPROC = 2


# ---------------------------------------------------------------- inside the jobs

def worker(overrides):
    """One torchrun rank: main.main with each metrics record stamped (this rank's clock),
    then this rank's peak RSS and stamps to a file. Leaves as main.py does."""
    import main
    from launch.exit import flush_and_exit
    from telemetry.metrics import MetricsLog
    rank = int(os.environ["RANK"])
    stamps, write = {}, MetricsLog.write

    def stamped(self, record, total, console):
        stamps[record["step"]] = time.perf_counter()
        write(self, record, total, console)
    MetricsLog.write = stamped
    main.main(overrides, rank, int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    out = {"rank": rank, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "stamps": stamps}
    with open(os.path.join(os.environ["BENCH_RESULTS"], f"rank-{rank}.json"), "w") as f:
        json.dump(out, f)  # a file each: ranks printing at once can share a line
    flush_and_exit(0)


# ---------------------------------------------------------------- the launcher

def saves_in_window(args):
    return [s for s in range(args.warmup + 1, args.steps) if s % args.save_every == 0]


def job(mode, args, tmp):
    run_dir, results = os.path.join(tmp, f"run-{mode}"), os.path.join(tmp, f"results-{mode}")
    for d in (run_dir, results):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    overrides = (MODELS[args.model] + COMMON + [f"trainer.max_steps={args.steps}",
                 f"trainer.save_every={args.save_every}"] + MODES[mode] + [f"trainer.run_dir={run_dir}"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
           "-m", "bench.snapshot_async", "--worker", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=REPO,
               WANDB_SILENT="true", BENCH_RESULTS=results)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    ranks = []
    for r in range(NPROC):
        path = os.path.join(results, f"rank-{r}.json")
        if out.returncode or not os.path.exists(path):
            raise SystemExit(f"{mode} job failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        with open(path) as f:
            ranks.append(json.load(f))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    last = os.path.join(run_dir, "snapshot", f"step-{args.steps:08d}")
    part_bytes = [os.path.getsize(os.path.join(last, f"part-{r:05d}.bin")) for r in range(NPROC)]
    shutil.rmtree(run_dir)  # 2 x the state on disk per job otherwise
    stamps = {int(k): v for k, v in ranks[0]["stamps"].items()}
    saved = set(saves_in_window(args)) if mode != "none" else set()
    measured = [r for r in records if r["step"] > args.warmup]
    at_saves = [r for r in measured if r["step"] in saved]
    return {"mode": mode, "window_s": stamps[args.steps] - stamps[args.warmup],
            "intervals_s": {s: stamps[s] - stamps[s - 1] for s in range(args.warmup + 1, args.steps)},
            "saves": len(saved), "rss_mb": [r["rss_mb"] for r in ranks], "part_bytes": part_bytes,
            "step_ms": statistics.median(r["step_ms"] for r in measured if r["step"] != args.steps),
            "snapshot_ms": [r["snapshot_ms"] for r in at_saves],
            "snapshot_wait_ms": [r.get("snapshot_wait_ms", 0.0) for r in at_saves],
            "records": records}


def offset_extra_ms(job, save_every):
    """Where a save period's time goes, within one job (so load that drifts between jobs
    cancels): for each position o of the period (0: the save step, 1: the step after, ...)
    the median interval at o over the job's periods, minus the job's baseline, the median
    interval over the period's second half (a background write is done by then)."""
    k, iv = save_every, {int(s): v for s, v in job["intervals_s"].items()}
    base = statistics.median(v for s, v in iv.items() if s % k >= k // 2)
    return [1000 * (statistics.median(v for s, v in iv.items() if s % k == o) - base) for o in range(k)]


def within_lost_ms(job, save_every):
    """Lost per save within the job: the extra time of the period's first half. For the
    `none` job (no save) the same sum is the noise floor."""
    return sum(offset_extra_ms(job, save_every)[:save_every // 2])


def summarize(jobs, save_every):
    """Per mode: medians (and ranges) over rounds of what results.md shows. Lost per save
    two ways: within each job (within_lost_ms), and against the same round's `none`
    window (every second counts, load drifting between the jobs too). The async/sync
    ratio is taken within each round, both ways."""
    rounds = sorted({j["round"] for j in jobs})
    by = {(j["round"], j["mode"]): j for j in jobs}
    rng = lambda xs: {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}  # noqa: E731
    out = {}
    for mode in MODES:
        mine = [by[i, mode] for i in rounds]
        s = {"window_s": rng([j["window_s"] for j in mine]), "step_ms": rng([j["step_ms"] for j in mine]),
             "rss_mb": [statistics.median(j["rss_mb"][r] for j in mine) for r in range(NPROC)],
             "part_bytes": mine[0]["part_bytes"], "saves": mine[0]["saves"],
             "within_lost_ms": rng([within_lost_ms(j, save_every) for j in mine]),
             "offset_extra_ms": [statistics.median(offset_extra_ms(j, save_every)[o] for j in mine)
                                 for o in range(save_every)]}
        if mode != "none":
            s["window_lost_ms"] = rng([1000 * (by[i, mode]["window_s"] - by[i, "none"]["window_s"])
                                       / by[i, mode]["saves"] for i in rounds])
            s["snapshot_ms"] = statistics.median(x for j in mine for x in j["snapshot_ms"])
            s["snapshot_wait_ms"] = statistics.median(x for j in mine for x in j["snapshot_wait_ms"])
        out[mode] = s
    out["async_vs_sync"] = rng([within_lost_ms(by[i, "async"], save_every)
                                / within_lost_ms(by[i, "sync"], save_every) for i in rounds])
    out["async_vs_sync_window"] = rng([(by[i, "async"]["window_s"] - by[i, "none"]["window_s"])
                                       / (by[i, "sync"]["window_s"] - by[i, "none"]["window_s"])
                                       for i in rounds])
    return out


def fmt_range(r, fmt="{:.0f}"):
    return f"{fmt.format(r['median'])} ({fmt.format(r['min'])} to {fmt.format(r['max'])})"


def tables(s):
    """results.md's tables and ratio line, from summarize()'s figures (results.json's "summary")."""
    step = s["none"]["step_ms"]["median"]
    rows, where = [], []
    for mode in MODES:
        m = s[mode]
        saving = ["-"] * 3
        if mode != "none":
            saving = [fmt_range(m["window_lost_ms"]), f"{m['snapshot_ms']:.0f}",
                      f"{m['snapshot_wait_ms']:.0f}" if mode == "async" else "-"]
        rows.append([mode, m["saves"], fmt_range(m["within_lost_ms"]),
                     f"{m['within_lost_ms']['median'] / step:.2f}", *saving, f"{m['step_ms']['median']:.0f}"])
        where.append([mode, *(f"{x:+.0f}" for x in m["offset_extra_ms"])])
    time_table = report.table(
        ["mode", "saves in window", "lost per save ms, within the job (range)", "in step times",
         "lost per save ms, vs none's window (range)", "snapshot_ms at a save", "snapshot_wait_ms",
         "step_ms (compute)"], rows, "lrrrrrrr")
    k = len(s["none"]["offset_extra_ms"])
    where_table = report.table(["mode", "save step", *(f"+{o}" for o in range(1, k))], where, "l" + "r" * k)
    mem_rows = [[mode, *(f"{x:.0f}" for x in s[mode]["rss_mb"]),
                 f"{max(s[mode]['rss_mb']) - max(s['none']['rss_mb']):+.0f}",
                 " / ".join(f"{b / 2**20:.1f}" for b in s[mode]["part_bytes"])] for mode in MODES]
    mem_table = report.table(["mode", *(f"peak RSS rank {r} MiB" for r in range(NPROC)),
                              "largest rank vs none MiB", "MiB written per rank and save"], mem_rows, "lrrrr")
    pct = "{:.0%}"
    ratio = (f"async lost / sync lost, per round (target < 10%): **{fmt_range(s['async_vs_sync'], pct)}** "
             f"within the jobs; {fmt_range(s['async_vs_sync_window'], pct)} against `none`'s windows")
    return time_table, where_table, mem_table, ratio


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.snapshot_async", description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="mid", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=36, help="steps per job")
    p.add_argument("--save-every", type=int, default=6)
    p.add_argument("--warmup", type=int, default=4, help="steps before the window (not a save step)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="runs/bench/snapshot_async")
    args, overrides = p.parse_known_args(argv)
    if args.worker:
        return worker(overrides)
    if args.warmup % args.save_every == 0 or len(saves_in_window(args)) < 2 or args.save_every < 2:
        p.error("--warmup must not be a save step, the window must hold 2 saves, --save-every >= 2")

    command, load_before, jobs = report.command_line("-m bench.snapshot_async", argv), os.getloadavg(), []
    with tempfile.TemporaryDirectory(prefix="bench-snapshot-async-") as tmp:
        modes = list(MODES)
        for i in range(args.rounds):
            for mode in modes[i % 3:] + modes[:i % 3]:
                j = job(mode, args, tmp)
                jobs.append({"round": i, **j})
                print(f"round {i} {mode}: window {j['window_s']:.2f} s, {j['saves']} saves, step "
                      f"{j['step_ms']:.0f} ms, RSS {[round(x) for x in j['rss_mb']]} MiB", flush=True)
    summary = summarize(jobs, args.save_every)
    env = report.environment(load_before)
    time_table, where_table, mem_table, ratio = tables(summary)
    text = "\n".join(report.header("Asynchronous snapshots: training time lost per save", command, [
        f"{NPROC} ranks x 1 thread, gloo, `ddp_bucket`, model `{args.model}` "
        f"({' '.join(MODELS[args.model])}), {args.steps} steps, a save every {args.save_every} "
        f"(none: only the last step's), window after step {args.warmup}, {args.rounds} rounds; "
        "snapshots on local disk"], env)
        + ["", *time_table, "", ratio, "",
           "Where a save period's time goes: median ms per step position against the job's own "
           "baseline (the period's second half); the first half's sum is 'within the job' above "
           "(for `none`, which saves nothing, it is the noise floor).", "", *where_table, "",
           *mem_table, ""])
    report.write_results(args.out, {"command": command, "environment": env, "settings": vars(args),
                                    "summary": summary, "jobs": jobs}, text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
