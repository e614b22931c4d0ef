"""Run real jobs (python / torchrun, gloo, 1 thread per rank) and compare them.

The parity harness every strategy's tests use:

    ref = run_metrics(tmp_path, 1, ["parallel.dp=single"])
    got = run_metrics(tmp_path, 2, ["parallel.dp=torch_ddp"])
    assert_parity(ref, got)            # rtol 1e-5 per step; returns the max diff

Jobs run main.py in a fresh directory under tmp_path with a tiny model
(TINY) on the embedded corpus, so no test needs ../shared or a network.
Every job has a timeout: a hang fails the test instead of stalling CI.
"""

import json
import os
import re
import subprocess
import sys
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(REPO, "main.py")

# batch 12 divides by dp 1, 2, 3, 4 and 6; a 2-layer model keeps every job short
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "data.block_size=16",
        "trainer.batch_size=12", "trainer.max_steps=6", "trainer.warmup_steps=2",
        "trainer.log_every=1", "trainer.eval_every=0", "trainer.save_every=0",
        "sample.length=0", "wandb.mode=disabled", "parallel.timeout_s=60"]


def job_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_SILENT="true",
               PYTHONUNBUFFERED="1")
    env.pop("MASTER_ADDR", None)
    return env


def command(nproc, overrides, launcher_args=()):
    if nproc == 1 and not launcher_args:
        launcher = [sys.executable, MAIN]
    else:  # --standalone picks a free port for the rendezvous
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={nproc}", *launcher_args, MAIN]
    return launcher + list(overrides)


def run_job(workdir, nproc, overrides, timeout=240, tiny=True):
    """Run main.py in `workdir`; returns the CompletedProcess (never raises on exit code)."""
    os.makedirs(workdir, exist_ok=True)
    args = (TINY if tiny else []) + list(overrides)
    try:
        return subprocess.run(command(nproc, args), cwd=workdir, env=job_env(),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"job hung for {timeout}s: {args}\n{e.stdout}\n{e.stderr}") from None


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_metrics(tmp_path, nproc, overrides, **kw):
    """Run a job that must succeed; return its metrics.jsonl records (loss,
    grad_norm, ...: what assert_parity compares)."""
    workdir = os.path.join(str(tmp_path), f"job-{uuid.uuid4().hex[:8]}")
    result = run_job(workdir, nproc, overrides, **kw)
    assert result.returncode == 0, f"job failed ({result.returncode}): {overrides}\n" \
                                   f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return read_metrics(os.path.join(workdir, "runs", "default"))


def snapshot_model(snapshot_dir):
    """The canonical model parameters of the snapshot in `snapshot_dir`, in the
    model's own parameter order."""
    from model import GPT, GPTConfig
    from snapshot import open_snapshot
    reader = open_snapshot(str(snapshot_dir))
    names = [n for n, _ in GPT(GPTConfig(**reader.meta["gpt_config"])).named_parameters()]
    return {n: reader.read_full(f"model/{n}") for n in names}


def snapshot_state(snapshot_dir):
    """{"model": {name: tensor}, "optimizer": {"state": {name: {field: tensor}}}} of a
    snapshot, in canonical names, for comparing final states across layouts."""
    from parallel.strategy import optimizer_state_from
    from snapshot import open_snapshot
    return {"model": snapshot_model(snapshot_dir),
            "optimizer": {"state": optimizer_state_from(open_snapshot(str(snapshot_dir)))}}


def our_frames(text):
    """The traceback frames (`File "..."` lines) of `text` that are in this project's
    own source: under the checkout, but not in a virtual environment or a
    site-packages that happens to live there (`python -m venv .venv` in the
    repository root puts torchrun's own frames under the checkout too)."""
    repo = os.path.realpath(REPO)
    ours = []
    for path in re.findall(r'File "([^"]+)"', text):
        real = os.path.realpath(path)
        if not os.path.isabs(path) or not real.startswith(repo + os.sep):  # "<frozen runpy>"
            continue
        parts = os.path.relpath(real, repo).split(os.sep)
        in_env = any(p in ("site-packages", "dist-packages") for p in parts) or any(
            os.path.exists(os.path.join(repo, *parts[:i], "pyvenv.cfg")) for i in range(1, len(parts)))
        if not in_env:
            ours.append(path)
    return ours


def max_rel_diff(ref, got):
    return max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref, got))


def assert_parity(ref, got, rtol=1e-5):
    """Per-step losses -- and pre-clip gradient norms, where both sides are metrics
    records -- equal within rtol. Returns the max relative loss difference.

    The gradient norm matters: AdamW is invariant to the gradient's scale, so a
    strategy that sums gradients instead of averaging them trains identical losses;
    its gradient norm is dp times too large."""
    assert len(ref) == len(got) and ref, f"different step counts: {len(ref)} vs {len(got)}"
    loss = lambda rs: [r["loss"] if isinstance(r, dict) else r for r in rs]
    diff = max_rel_diff(loss(ref), loss(got))
    assert diff <= rtol, f"max relative loss difference {diff:.3g} > {rtol}\n{loss(ref)}\n{loss(got)}"
    message = f"parity: max relative loss difference {diff:.3g}"
    if all(isinstance(r, dict) and "grad_norm" in r for r in list(ref) + list(got)):
        norms = [[r["grad_norm"] for r in rs] for rs in (ref, got)]
        norm_diff = max_rel_diff(*norms)
        assert norm_diff <= rtol, f"max relative grad-norm difference {norm_diff:.3g} > {rtol}\n{norms}"
        message += f", grad norm {norm_diff:.3g}"
    print(f"{message} over {len(ref)} steps")
    return diff
