"""Running nanoGPT's own bench.py from a checkout of karpathy/nanoGPT, for
`python -m bench.gpu_vs_nanogpt` (bench/README.md). Nothing of nanoGPT is copied here:
its bench.py runs as it is, in its own directory, through the few lines of RUNNER.

bench.py reads its options as `--key=value` arguments through configurator.py, opened
relative to the working directory (so it runs with cwd = the checkout), runs 10 burn-in
and 20 timed iterations and prints `time per iteration: X ms, MFU: Y%`, its MFU against
an A100's bf16 peak (312 TFLOP/s) whatever the device.
"""

import os
import re
import subprocess
import sys
import time

# bench.py calls torch.cuda.synchronize() unconditionally, which raises on a torch without
# CUDA; a no-op there is exact (a CPU has nothing to wait for). Everything else is bench.py's.
# `python -c` puts the working directory (the checkout) first on sys.path: `from model import`.
RUNNER = """\
import runpy, sys, torch
if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda *a, **k: None
sys.argv = ['bench.py'] + sys.argv[1:]
runpy.run_path('bench.py', run_name='__main__')
"""

# bench.py's last line: f"time per iteration: {dt/num_steps*1000:.4f}ms, MFU: {mfu*100:.2f}%"
RESULT = re.compile(r"time per iteration: ([0-9.]+)\s*ms, MFU: (-?[0-9.]+)%")
BURN_IN, TIMED = 10, 20     # bench.py's `for stage, num_steps in enumerate([10, 20])`
A100_BF16_PEAK = 312e12     # what bench.py's estimate_mfu divides by


def checkout_error(path):
    """Why `path` is not a nanoGPT checkout this command can run, or None."""
    if not os.path.isdir(path):
        return f"--nanogpt {path}: no such directory (give a checkout of karpathy/nanoGPT)"
    missing = [f for f in ("bench.py", "model.py", "configurator.py")
               if not os.path.isfile(os.path.join(path, f))]
    if missing:
        return (f"--nanogpt {path}: not a nanoGPT checkout (no {', '.join(missing)}); "
                "clone https://github.com/karpathy/nanoGPT and pass its directory")
    return None


COMMIT_FILE = ".commit"  # a copy without .git (scripts/gpu_kit.py's) names its commit here


def checkout_commit(path):
    """The checkout's git commit (short), else the one its COMMIT_FILE names, or "":
    which bench.py ran."""
    try:
        commit = subprocess.run(["git", "-C", path, "rev-parse", "--short=12", "HEAD"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    if not commit and os.path.isfile(os.path.join(path, COMMIT_FILE)):
        with open(os.path.join(path, COMMIT_FILE)) as f:
            commit = f.read().strip()[:12]
    return commit


def options(batch, block, device, dtype, compile_):
    """bench.py's --key=value arguments. real_data=False: fixed random ids, no openwebtext
    needed (its get_batch is then free); profile=False: the timed loop."""
    return [f"--batch_size={batch}", f"--block_size={block}", "--bias=False", "--real_data=False",
            "--seed=1337", f"--device={device}", f"--dtype={dtype}", f"--compile={compile_}",
            "--profile=False"]


def run(path, args, threads, timeout, cache_dir):
    """bench.py once; returns {returncode, seconds, ms_per_iter, mfu_pct, error}.
    threads: OMP threads, as our job gets; cache_dir: inductor's cache (compile=True)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=cache_dir)
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", RUNNER, *args], cwd=path, env=env,
                              capture_output=True, text=True, timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        code, out = None, f"hung: killed after {timeout:.0f}s"
    found = RESULT.findall(out)
    ms, mfu = (float(found[-1][0]), float(found[-1][1])) if found else (None, None)
    ok = code == 0 and ms is not None
    return {"returncode": code, "seconds": round(time.perf_counter() - started, 2),
            "ms_per_iter": ms, "mfu_pct": mfu, "error": "" if ok else out[-5000:]}
