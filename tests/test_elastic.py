"""Elastic restart: under torchrun --max-restarts, SIGKILL one worker (at a random step,
or while it writes a snapshot) and the job restarts from the last snapshot, exits 0,
and its losses equal those of a job never killed."""

import pytest
import glob
import os
import random
import re
import signal
import subprocess
import time

from harness import TINY, command, job_env, kill_tree, read_metrics, run_metrics, workers_of

ARGS = ["parallel.dp=torch_ddp", "trainer.max_steps=30", "trainer.save_every=5",
        "model.n_embd=64", "data.block_size=32", "model.dropout=0.1"]

pytestmark = pytest.mark.long  # the long tier (tests/README.md): kills at a random moment; guards are elsewhere


def rank_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env[b"RANK"])


def run_and_kill(workdir, args, should_kill, timeout=240):
    """Run a 2-rank job with --max-restarts=3; SIGKILL one worker once should_kill()
    says so. Returns (exit code, whether a kill happened)."""
    os.makedirs(workdir, exist_ok=True)
    proc = subprocess.Popen(command(2, TINY + args, ["--max-restarts=3"]), cwd=workdir,
                            env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    killed, deadline = False, time.time() + timeout
    try:
        while not killed and proc.poll() is None and time.time() < deadline:
            victim = should_kill(workers_of(proc.pid))
            if victim:
                os.kill(victim, signal.SIGKILL)
                killed = True
            time.sleep(0.001)
        output, _ = proc.communicate(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # the workers too: they run in sessions of their own
        proc.wait()
        raise AssertionError("elastic job hung")
    return proc.returncode, killed, output


def logged_steps(workdir):
    path = os.path.join(workdir, "runs", "default", "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return f.read().count("\n")


def assert_resumed_and_retrained(output, steps):
    """The (last) restarted attempt says which snapshot step it resumed from, and trains
    every step after it again (its console lines `step k/steps`). Returns that step."""
    found = list(re.finditer(r"^resuming from snapshot \S+ at step (\d+)$", output, re.M))
    assert found, output[-4000:]
    resumed_at = int(found[-1].group(1))
    after = output[found[-1].end():]
    retrained = [int(k) for k in re.findall(rf"^step (\d+)/{steps} \|", after, re.M)]
    assert retrained == list(range(resumed_at + 1, steps + 1)), output[-4000:]
    return resumed_at


def assert_same_losses(reference, workdir):
    resumed = read_metrics(os.path.join(workdir, "runs", "default"))
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]
    for ref, got in zip(reference, resumed):
        assert abs(ref["loss"] - got["loss"]) <= 1e-6 * ref["loss"], (ref, got)


def test_sigkill_of_a_worker_restarts_from_snapshot(tmp_path):
    reference = run_metrics(tmp_path, 2, ARGS)
    kill_at = random.randint(6, 24)
    print(f"killing a worker after step {kill_at}")
    workdir = str(tmp_path / "elastic")

    def at_step(workers):
        if len(workers) == 2 and logged_steps(workdir) >= kill_at:
            return random.choice(workers)

    code, killed, output = run_and_kill(workdir, ARGS, at_step)
    assert killed and code == 0, output[-4000:]
    resumed_at = assert_resumed_and_retrained(output, 30)
    assert resumed_at % 5 == 0 and 0 < resumed_at < 30, resumed_at
    assert_same_losses(reference, workdir)


def test_sigkill_during_snapshot_write_keeps_previous_snapshot(tmp_path):
    # a wider model makes the snapshot write take long enough to be caught in the act;
    # 15 steps leave two later writes (steps 10 and 15) to catch
    args = ARGS + ["model.n_embd=256", "model.n_layer=4", "trainer.max_steps=15"]
    reference = run_metrics(tmp_path, 2, args)
    workdir = str(tmp_path / "elastic")
    snap_dir = os.path.join(workdir, "runs", "default", "snapshot")

    def while_writing(workers):
        # a later write (so there is a previous snapshot to keep) caught in the act:
        # a step directory that has no manifest yet
        if len(workers) == 2 and os.path.exists(os.path.join(snap_dir, "latest.json")) and any(
                not os.path.exists(os.path.join(d, "manifest.json"))
                for d in glob.glob(os.path.join(snap_dir, "step-*"))):
            return next(pid for pid in workers if rank_of(pid) == 0)  # rank 0 commits

    code, killed, output = run_and_kill(workdir, args, while_writing)
    assert killed, "never caught a snapshot write in progress"
    assert code == 0, output[-4000:]
    assert assert_resumed_and_retrained(output, 15) % 5 == 0
    assert_same_losses(reference, workdir)
    assert len(glob.glob(os.path.join(snap_dir, "step-*"))) == 1, "the dead writer's leftovers are cleaned"
