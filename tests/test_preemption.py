"""Preemption (launch/preemption.py): a signal at a random step, the snapshot of the step reached
(not the last periodic one), a distinct exit, and a resume with the losses of a run
never interrupted.

As a cluster does it: SIGTERM to the torchrun launcher (it forwards the signal to
its workers, then waits up to its shutdown timeout before SIGKILL), SIGUSR1 to a
launcher told to forward it (`--signals-to-handle`: scripts/slurm_train.sbatch under a
stand-in srun, which also requeues), SIGTERM to one worker only (the other rank gets no signal and must stop
after the same step, not wait), and SIGTERM to a plain `python main.py`.
"""

import os
import random
import re
import signal
import subprocess
import time

import pytest

from harness import (TINY, command, job_env, kill_tree, python, read_metrics, run_job, run_metrics,
                     workers_of)
from launch.process_tree import alive
from checkpoint.snapshot_reader import open_snapshot
from test_elastic import rank_of

ARGS = ["trainer.max_steps=30", "trainer.save_every=8", "model.n_embd=64",
        "data.block_size=32", "model.dropout=0.1"]  # dropout: the random stream resumes too

_references = {}


def reference(tmp_path, nproc, args):
    key = (nproc, tuple(args))
    if key not in _references:
        _references[key] = run_metrics(tmp_path, nproc, args)
    return _references[key]


def logged_steps(workdir):
    path = os.path.join(workdir, "runs", "default", "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return f.read().count("\n")


def run_and_signal(workdir, nproc, args, launcher_args, at_step, send, timeout=240):
    """Start a job; once `at_step` steps are logged call send(launcher pid).
    Returns (exit status, output, seconds from the signal to the exit)."""
    os.makedirs(workdir, exist_ok=True)
    proc = subprocess.Popen(command(nproc, TINY + args, launcher_args), cwd=workdir, env=job_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline, sent = time.time() + timeout, None
    try:
        while sent is None and proc.poll() is None and time.time() < deadline:
            if logged_steps(workdir) >= at_step and send(proc.pid):
                sent = time.time()
            time.sleep(0.002)
        output, _ = proc.communicate(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # the workers live in sessions of their own
        raise AssertionError("job hung after the signal")
    assert sent is not None, f"the job ended before step {at_step}:\n{output[-3000:]}"
    return proc.returncode, output, time.time() - sent


def to_launcher(sig):
    def send(pid):
        os.kill(pid, sig)
        return True
    return send


def to_rank(rank, sig):
    def send(pid):
        workers = workers_of(pid)
        if len(workers) < 2:
            return False
        os.kill(next(w for w in workers if rank_of(w) == rank), sig)
        return True
    return send


CASES = {
    # name: (nproc, strategy, launcher args, whom to signal, the launcher's exit status)
    # torchrun 2.13, signalled itself: forwards, waits for its workers, then raises
    # SignalException: exit 1. When only a worker exits 75, it reports a failed child: 1.
    "fsdp-SIGTERM-to-torchrun": (2, ["parallel.dp=fsdp"], [], to_launcher(signal.SIGTERM), 1),
    # Ctrl-C: the terminal's SIGINT reaches torchrun alone (its workers run in sessions of
    # their own), which forwards it; the same stop, the user's: exit 130, no `preempted` file
    "ddp_bucket-Ctrl-C-to-torchrun": (2, ["parallel.dp=ddp_bucket"], [],
                                      to_launcher(signal.SIGINT), 1),
    # SIGUSR1 forwarded by torchrun (--signals-to-handle=...,SIGUSR1): the Slurm test below,
    # whose batch script starts torchrun that way; the stop and resume are the same code
    "ddp_bucket-SIGTERM-to-rank1-only": (2, ["parallel.dp=ddp_bucket"], [],
                                         to_rank(1, signal.SIGTERM), 1),
    "single-SIGTERM-to-python": (1, ["parallel.dp=single"], [], to_launcher(signal.SIGTERM), 75),
}


@pytest.mark.parametrize("case", list(CASES))
def test_signal_snapshots_the_step_reached_and_resumes_exactly(tmp_path, case):
    nproc, strategy, launcher_args, send, launcher_status = CASES[case]
    args = strategy + ARGS
    ref = reference(tmp_path, nproc, args)
    at_step = random.randint(3, 24)
    workdir = str(tmp_path / "preempted")
    code, output, seconds = run_and_signal(workdir, nproc, args, launcher_args, at_step, send)
    print(f"{case}: signalled after step {at_step}; exit {code} {seconds:.1f} s later")

    assert code == launcher_status, output[-4000:]
    line = (r"^interrupted: Ctrl-C \(SIGINT\) received, stopped after step (\d+) of 30 and wrote "
            r"its snapshot to \S+; the same command resumes from step \1 \(exit status 130\)$"
            if "Ctrl-C" in case else
            r"^preempted: SIG\w+ received, stopped after step (\d+) of 30 .*\(exit status 75\)$")
    stopped = re.findall(line, output, re.M)
    assert len(stopped) == 1, output[-4000:]  # the main rank says it, once
    step = int(stopped[0])
    # a job script requeues on `preempted`: never after its user's Ctrl-C
    marker = os.path.exists(os.path.join(workdir, "runs", "default", "preempted"))
    assert marker == ("Ctrl-C" not in case), os.listdir(os.path.join(workdir, "runs", "default"))
    metrics = read_metrics(os.path.join(workdir, "runs", "default"))
    assert at_step <= step < 30 and [r["step"] for r in metrics] == list(range(1, step + 1))
    snap = os.path.join(workdir, "runs", "default", "snapshot")
    assert open_snapshot(snap).meta["step"] == step, "the step reached, not the last periodic one"
    assert "forcefully exiting" not in output  # torchrun never had to SIGKILL a worker
    if case.endswith("rank1-only"):  # rank 1 exited 75, as the failure summary shows
        assert re.search(r"exitcode\s*:\s*75", output), output[-4000:]
        # with our line as its traceback (TORCHELASTIC_ERROR_FILE), not torchrun's pointer
        assert re.search(r"traceback : preempted: SIGTERM received, stopped after step", output) \
            and "To enable traceback" not in output, output[-4000:]

    resumed = run_job(workdir, nproc, args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(rf"^resuming from snapshot \S+ at step {step}$", resumed.stdout, re.M), \
        resumed.stdout[-2000:]
    got = read_metrics(os.path.join(workdir, "runs", "default"))
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * a["loss"], (a, b)


SLOW = ["model.n_layer=4", "model.n_head=4", "model.n_embd=256", "data.block_size=256",
        "trainer.batch_size=8", "trainer.max_steps=30", "trainer.save_every=2"]  # ~1-3 s a step


def twice(sig, gap=0.3):
    def send(pid):
        os.kill(pid, sig)
        time.sleep(gap)
        os.kill(pid, sig)
        return True
    return send


def test_a_second_ctrl_c_under_torchrun_stops_every_rank_at_once(tmp_path):
    """Ctrl-C twice, 0.3 s apart, early in step 3 of slow steps: torchrun turns the second
    into SIGTERM to its workers (its shutdown starts again), which after a Ctrl-C means
    now: every rank leaves within seconds, step 3 unsaved, and the main rank's line says
    the next run resumes from step 2, the snapshot it finds."""
    workdir = str(tmp_path / "job")
    code, output, seconds = run_and_signal(workdir, 2, SLOW, [], 2, twice(signal.SIGINT))
    print(f"exit {code} {seconds:.1f} s after the first Ctrl-C")
    assert code == 1, output[-4000:]  # torchrun's SignalException
    assert re.findall(r"^interrupted again: .*$", output, re.M) == [
        "interrupted again: stopped at once in step 3 of 30, which is lost; the same command "
        "resumes from step 2, the last snapshot (exit status 130)"], output[-4000:]
    assert "stopped after step" not in output and "forcefully exiting" not in output
    assert seconds < 20, output[-4000:]
    run_dir = os.path.join(workdir, "runs", "default")
    assert open_snapshot(os.path.join(run_dir, "snapshot")).meta["step"] == 2
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]


@pytest.mark.long  # the long tier (tests/README.md)
def test_ranks_whose_torchrun_is_killed_stop_after_the_step(tmp_path):
    """torchrun SIGKILLed (a third Ctrl-C exits it without a word to its workers, as does
    kill -9): each worker gets SIGINT from the kernel (PR_SET_PDEATHSIG), ends the step,
    writes its snapshot and leaves; none trains on unwatched. Real interpreters: a forked
    rank's parent is the fork server, which lives on."""
    workdir = str(tmp_path / "job")
    os.makedirs(workdir)
    proc = subprocess.Popen(command(2, TINY + ["trainer.max_steps=100000", "parallel.dp=ddp_bucket"]),
                            cwd=workdir, env=job_env(forked=False), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    workers = []
    try:
        deadline = time.time() + 240
        while logged_steps(workdir) < 5 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        workers = workers_of(proc.pid)
        assert len(workers) == 2, (workers, proc.poll())
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.time()
        while any(alive(w) for w in workers) and time.time() < killed + 60:
            time.sleep(0.05)
        gone, running = time.time() - killed, [w for w in workers if alive(w)]
    finally:
        for pid in workers:
            if alive(pid):
                kill_tree(pid)
        output = proc.communicate()[0]
    print(f"the workers left {gone:.1f} s after torchrun's SIGKILL")
    assert not running, f"workers {running} still train 60 s after torchrun's SIGKILL"
    run_dir = os.path.join(workdir, "runs", "default")
    steps = [r["step"] for r in read_metrics(run_dir)]
    # what the ranks printed: this case failed at times with no snapshot (the workers gone
    # 0.1-0.2 s after the kill); the lines say how they ended
    snapshot = open_snapshot(os.path.join(run_dir, "snapshot"))
    assert snapshot is not None, (steps, output[-3000:])
    assert snapshot.meta["step"] == steps[-1] >= 5, steps
    assert re.search(rf"^interrupted: its launcher \(torchrun\) is gone, stopped after step "
                     rf"{steps[-1]} of 100000 ", output, re.M), output[-3000:]


# srun on one node, with srun's signal handling (srun(1), src/srun/libsrun/srun_job.c):
# SIGUSR1/SIGUSR2 are forwarded to the task, a SIGTERM becomes SIGKILL of the task
SRUN = """#!/bin/bash
"$@" &
task=$!
trap 'kill -USR1 $task' USR1
trap 'kill -USR2 $task' USR2
trap 'echo "srun: forcing job termination" >&2; kill -KILL $task' TERM
wait $task; status=$?
while kill -0 $task 2>/dev/null; do wait $task; status=$?; done
exit $status
"""


def test_slurm_script_requeues_a_preempted_job(tmp_path):
    """scripts/slurm_train.sbatch under stand-ins for srun (runs its command here, and
    handles signals as srun does) and scontrol: Slurm's SIGUSR1 to the batch shell ends
    in a snapshot of the step reached and a requeue; the batch script itself exits 0."""
    import socket
    from harness import REPO
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "torchrun").write_text(f'#!/bin/bash\nexec "{python()}" -m torch.distributed.run "$@"\n')
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\nif [ "$1" = show ]; then echo localhost; else echo "$@" >> "$REQUEUED"; fi\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    env = dict(job_env(), PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242",
               SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost", GPUS_PER_NODE="2",
               RDZV_PORT=str(port), REQUEUED=str(tmp_path / "requeued"), RUN_DIR=str(run_dir))
    args = TINY + ["parallel.dp=ddp_bucket"] + ARGS
    proc = subprocess.Popen(["bash", os.path.join(REPO, "scripts", "slurm_train.sbatch"), *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline, metrics = time.time() + 240, run_dir / "metrics.jsonl"
    while proc.poll() is None and time.time() < deadline and not (
            metrics.exists() and metrics.read_text().count("\n") >= 5):
        time.sleep(0.01)
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@180 does
    try:
        output, _ = proc.communicate(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # bash, srun, torchrun and the ranks below it
        raise AssertionError("the sbatch script hung after USR1")
    assert proc.returncode == 0, output[-4000:]
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"], output[-4000:]
    stopped = re.search(r"stopped after step (\d+) of 30", output)
    assert stopped, output[-4000:]
    step = int(stopped.group(1))
    assert 5 <= step < 30
    assert open_snapshot(str(run_dir / "snapshot")).meta["step"] == step
    # what made the script requeue: rank 0's file, not just "a signal came and torchrun
    # exited non-zero" (a crash after the signal must not be requeued)
    assert f"stopped after step {step} of 30" in (run_dir / "preempted").read_text()
