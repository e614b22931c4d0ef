"""`python -m bench.run`: own and reference strategies side by side (bench/README.md).

    python -m bench.run --preset ddp                      # -> runs/bench/ddp-default/
    python -m bench.run --preset fsdp --model thin12 --rounds 6
    python -m bench.run --model tiny --variants single,torch_ddp --steps 8 --rounds 1

Every variant is one real training job (main.py, torchrun --standalone, gloo),
all on the same model, data and GLOBAL batch. Jobs alternate in rounds
(A B C, A B C, ...) so a noisy neighbour slows every variant alike, and ratios
are taken within a round before the median over rounds. Variants whose keys
this checkout's config rejects (a strategy not merged yet) are skipped with
the config's own message. Writes results.json (every logged step of every job
too), results.md and step_time.png into --out, through bench/report.py.

This file is the command: options, the plan, the rounds. The engine it drives is
bench/run_engine/ (variants, one job, statistics, tables, charts).
"""

import argparse
import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # also runs as `python bench/run.py`
    sys.path.insert(0, REPO)

from bench import report  # noqa: E402
from bench.run_engine import charts, stats, tables  # noqa: E402
from bench.run_engine.jobs import check, common_overrides, run_job  # noqa: E402
from bench.run_engine.variants import MODELS, PRESETS, pick  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="all", help="which variants (%(default)s)")
    p.add_argument("--variants", default="", help="comma list of variants; replaces --preset")
    p.add_argument("--model", choices=sorted(MODELS), default="default", help="model size (%(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra main.py override for every variant (repeatable)")
    p.add_argument("--data", default="", help="data.path for every job: any fsspec path or URL "
                   "(default: the embedded corpus main.py generates, the same on every machine)")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the multi-process variants (%(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="(%(default)s)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per job (%(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="steps dropped at the start of each job (%(default)s)")
    p.add_argument("--timeout", type=float, default=900, help="seconds before a job counts as hung (%(default)s)")
    p.add_argument("--out", default="", help="output directory (default runs/bench/<preset>-<model>; the committed results: --out docs/bench/...)")
    p.add_argument("--runs-dir", default="", help="keep the jobs' run directories here "
                   "(default: a temporary directory, deleted at the end)")
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    args.out = args.out or os.path.join("runs", "bench",
                                        f"{'custom' if args.variants else args.preset}-{args.model}")
    return args


def write_report(out, cmd, settings, summary, skipped, jobs):
    """results.json (every logged step of every job too), the charts, then results.md."""
    os.makedirs(out, exist_ok=True)
    json_path = report.write_json(os.path.join(out, "results.json"), {
        "command": cmd, "settings": settings, "variants": summary, "skipped": skipped, "jobs": jobs})
    drawn = {name: report.draw(os.path.join(out, name), plot, summary) for name, plot in (
        ("step_time.png", charts.step_time), ("pipeline_timeline.png", charts.pipeline_timeline))}
    md = report.write_markdown(os.path.join(out, "results.md"), tables.markdown(
        cmd, settings, summary, skipped, jobs, drawn["step_time.png"]))
    return {"json": json_path, "md": md, **{n: os.path.join(out, n) for n, ok in drawn.items() if ok}}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    common = common_overrides(args.model, args.data, args.steps)

    # which variants this checkout can run; the others are reported, not fatal
    plan, skipped, cfg = [], {}, None
    for v in pick(args.variants, args.preset):
        ranks, threads = v.ranks or args.nproc, v.threads or args.nproc
        overrides = common + [o.format(nproc=ranks) for o in v.overrides] + args.set
        why, got = (v.unavailable, None) if v.unavailable else check(overrides, ranks)
        if why:
            skipped[v.name] = why
            print(f"skip {v.name}: {why}", flush=True)
        else:
            plan.append((v, ranks, threads, overrides))
            cfg = cfg or got
    if not plan:
        raise SystemExit("nothing to run: every variant was skipped (see above)")
    params = stats.count_params(cfg)

    if args.data and "://" not in args.data:
        print(f"note: --data {args.data} is a local file: the results name it, and a fresh clone "
              "elsewhere cannot re-run the command as it is written there")
    runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="bench-runs-")
    load_before, jobs = os.getloadavg(), []
    if load_before[0] >= 0.5 * (os.cpu_count() or 1):
        print(f"note: load average {load_before[0]:.2f} on {os.cpu_count()} CPUs: other work "
              "is running, so absolute times will be noisy (ratios within a round less so)")
    try:
        for rnd in range(1, args.rounds + 1):
            for v, ranks, threads, overrides in plan:
                run_dir = os.path.join(runs_dir, f"r{rnd}-{v.name}")
                # one inductor cache per variant: its round 1 compiles from nothing, later
                # rounds reuse those kernels (as a second run on one machine would)
                cache = os.path.join(runs_dir, f"inductor-cache-{v.name}")
                job = {"variant": v.name, "round": rnd, "ranks": ranks, "threads": threads,
                       **run_job(ranks, threads, overrides, run_dir, args.timeout, cache)}
                job["ok"] = job["returncode"] == 0 and len(job["records"]) == args.steps
                jobs.append(job)
                ms = stats.job_median_ms(job, args.warmup) if job["ok"] else None
                print(f"round {rnd}/{args.rounds} {v.name:<18} "
                      + (f"{ms:8.1f} ms/step" if ms else f"FAILED ({job['returncode']})")
                      + f"   job {job['seconds']:.0f} s", flush=True)
    finally:
        if not args.runs_dir:
            shutil.rmtree(runs_dir, ignore_errors=True)

    settings = {"model": args.model, "overrides": common + args.set, "params": params,
                "nproc": args.nproc, "rounds": args.rounds, "steps": args.steps,
                "warmup": args.warmup, **report.environment(load_before)}
    variants = [(v, ranks, threads) for v, ranks, threads, _ in plan]
    summary = stats.summarize(jobs, variants, params, args.warmup, cfg)
    cmd = report.command_line("-m bench.run" if __package__ else "bench/run.py", argv)
    paths = write_report(args.out, cmd, settings, summary, skipped, jobs)
    print("\n" + open(paths["md"]).read())
    print("wrote " + ", ".join(paths.values()))
    return 0 if all(j["ok"] for j in jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
