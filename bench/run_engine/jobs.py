"""One bench.run job: the overrides every job shares, whether this checkout accepts a
variant's, and running main.py (alone, or under torchrun) to collect what it logged."""

import json
import os
import subprocess
import sys
import time

from bench.run_engine import stats
from bench.run_engine.variants import MODELS

MAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "main.py")


def common_overrides(model, data, steps):
    """What every job shares: model, data, steps, and nothing that costs time but the step."""
    return (MODELS[model] + ([f"data.path={data}"] if data else [])
            + [f"trainer.max_steps={steps}", "trainer.log_every=1", "trainer.eval_every=0",
               "trainer.save_every=0", "sample.length=0", "wandb.mode=disabled",
               "parallel.timeout_s=120"])  # a hung collective fails the job, not the bench


def check(overrides, ranks):
    """Why main.py would refuse these overrides on `ranks` processes, or None.
    The same load_config main.py runs, so 'not merged yet' needs no list of its own."""
    from config import load_config
    from errors import UserError
    try:
        return None, load_config(overrides, ranks)
    except UserError as e:
        return str(e), None


def run_job(ranks, threads, overrides, run_dir, timeout, cache_dir=None):
    """One training job; returns its exit status, wall time, logged records and error tail.
    cache_dir: inductor's kernel cache for trainer.compile (None: beside run_dir)."""
    os.makedirs(run_dir, exist_ok=True)
    launcher = [sys.executable, MAIN] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", MAIN]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)  # an outer torchrun's variables would hijack the job's rendezvous
    # trainer.compile: inductor's kernels in a cache of the caller's (bench.run: one per variant
    # and invocation), so a first job compiles from nothing whatever the machine's cache holds
    env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir or os.path.join(os.path.abspath(run_dir), "inductor-cache")
    started = time.perf_counter()
    try:
        proc = subprocess.run(launcher + overrides + [f"trainer.run_dir={run_dir}"], cwd=run_dir,
                              env=env, capture_output=True, text=True, timeout=timeout)
        # keep plenty: torchrun's banner comes after the ranks' own error lines
        code, tail = proc.returncode, (proc.stderr or proc.stdout)[-20000:]
    except subprocess.TimeoutExpired:
        code, tail = None, f"hung: killed after {timeout:.0f}s"
    timeline = os.path.join(run_dir, "pipeline_timeline.json")  # pipeline jobs' last step
    records = stats.read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    return {"returncode": code, "seconds": round(time.perf_counter() - started, 2),
            "records": records,
            "timeline": json.load(open(timeline)) if os.path.exists(timeline) else None,
            "error": "" if code == 0 else tail}
