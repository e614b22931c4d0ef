"""trainer.snapshot_async on real 2-rank jobs when something happens while a background
write is in flight (checkpoint/async_snapshot.py):

- SIGTERM (preemption): the job waits for that write, commits it, snapshots the step
  reached, exits with the preemption status, and resuming gives the losses of an
  uninterrupted run;
- one rank's write fails (a file where the step's directory must be): one line on
  every rank, a non-zero exit, no traceback of ours, latest.json still on the
  previous snapshot.

The write is held open by a test-only filesystem ("gatedfile://", local files): the
first open of a held part waits until the test creates a release file, so the test
decides what happens while it is in flight. The failure itself is the OS's.
"""

import os
import re
import signal
import subprocess
import textwrap
import time

import pytest

from checkpoint.snapshot_reader import open_snapshot
from harness import (TINY, command, job_env, kill_tree, our_frames, read_metrics, run_job,
                     run_metrics)

ARGS = ["parallel.dp=fsdp", "parallel.zero_stage=2", "trainer.max_steps=12",
        "trainer.save_every=4", "trainer.keep_snapshots=4", "model.dropout=0.1"]
ASYNC = ["trainer.snapshot_async=true"]

GATED_FS = textwrap.dedent('''
    # test-only: local files ("gatedfile://"); opening a part file whose path contains
    # $GATE_HOLD for writing first creates $GATE_DIR/held, then waits for $GATE_DIR/release
    import os, time
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class GatedFileSystem(LocalFileSystem):
        protocol = "gatedfile"
        def _open(self, path, mode="rb", **kw):
            if "w" in mode and os.environ["GATE_HOLD"] in path and path.endswith(".bin"):
                gate = os.environ["GATE_DIR"]
                open(os.path.join(gate, "held"), "a").close()
                deadline = time.time() + 60
                while not os.path.exists(os.path.join(gate, "release")) and time.time() < deadline:
                    time.sleep(0.01)
            return super()._open(path, mode, **kw)

    fsspec.register_implementation("gatedfile", GatedFileSystem, clobber=True)
''')


def start_gated(tmp_path, hold, args):
    """Start a 2-rank job whose snapshot writes go through gatedfile://, holding the
    parts whose path contains `hold`. Returns (process, workdir, snapshot dir, gate dir)."""
    site, gate, workdir = tmp_path / "site", tmp_path / "gate", tmp_path / "job"
    for d in (site, gate, workdir):
        d.mkdir()
    (site / "sitecustomize.py").write_text(GATED_FS)
    snapshot = tmp_path / "snapshot"
    env = dict(job_env(), PYTHONPATH=str(site), GATE_HOLD=hold, GATE_DIR=str(gate))
    proc = subprocess.Popen(command(2, TINY + args + [f"trainer.snapshot_path=gatedfile://{snapshot}"]),
                            cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    return proc, workdir, snapshot, gate


def wait_for(proc, condition, what, timeout=60):
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None or time.time() > deadline:
            kill_tree(proc.pid)
            out, err = proc.communicate()
            raise AssertionError(f"{what} never happened\n{out[-3000:]}\n{err[-3000:]}")
        time.sleep(0.001)


def finish(proc, timeout=60):
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"the job hung\n{out[-3000:]}\n{err[-3000:]}") from None


_reference = []


def logged(workdir, step):
    path = workdir / "runs" / "default" / "metrics.jsonl"
    return path.exists() and path.read_text().count("\n") >= step


@pytest.mark.parametrize("when", ["at-once", "at-the-next-save"])
def test_sigterm_during_a_background_write_waits_for_it_then_snapshots_the_step_reached(tmp_path, when):
    """Step 4's parts are held open; SIGTERM to torchrun (which forwards it to the ranks)
    while they are: at once (the ranks stop after a step between saves: step 4 is
    drained, then the step reached saved synchronously), or once the ranks wait for step 4
    at the next save step, 8 (drained there; 8 staged and written in the background, then
    drained by the stop). Either way step 4 is committed, then the step reached; the ranks
    exit 75 (torchrun itself: 1), and the job resumes with the uninterrupted losses."""
    if not _reference:
        _reference.append(run_metrics(tmp_path, 2, ARGS))
    proc, workdir, snapshot, gate = start_gated(tmp_path, "step-00000004/part-", ARGS + ASYNC)
    wait_for(proc, (gate / "held").exists, "the held write of step 4")
    if when == "at-the-next-save":  # step 7's line is written just before its stop check
        wait_for(proc, lambda: logged(workdir, 7), "step 7")
        time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the ranks see the signal at the end of their step, then wait for step 4
    (gate / "release").touch()
    out, err = finish(proc)

    assert proc.returncode == 1, err[-3000:]  # torchrun, signalled, exits 1 (docs/clusters.md)
    stopped = re.findall(r"^preempted: SIGTERM received, stopped after step (\d+) of 12 .*"
                         r"\(exit status 75\)$", out, re.M)
    assert len(stopped) == 1, out[-3000:] + err[-3000:]
    step = int(stopped[0])
    print(f"{when}: stopped after step {step}")
    assert 4 < step <= 8 if when == "at-once" else step == 8
    assert open_snapshot(str(snapshot), 4).meta["step"] == 4, "the write in flight was committed"
    assert open_snapshot(str(snapshot)).meta["step"] == step, "then the step reached"
    run_dir = workdir / "runs" / "default"
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, step + 1))

    resumed = run_job(workdir, 2, ARGS + ASYNC + [f"trainer.snapshot_path={snapshot}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {step}" in resumed.stdout, resumed.stdout[-2000:]
    got = read_metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, 13))
    assert [r["loss"] for r in got] == [r["loss"] for r in _reference[0]]


def test_a_failed_background_write_on_one_rank_stops_every_rank_with_one_line(tmp_path):
    """Rank 1's part of step 8 is held while rank 0 finishes its own; then the test puts a
    file where step 8's directory is, so rank 1's open fails (NotADirectoryError).
    Every rank prints one line and exits 2; latest.json stays on step 4."""
    proc, workdir, snapshot, gate = start_gated(tmp_path, "step-00000008/part-00001", ARGS + ASYNC)
    step_dir = snapshot / "step-00000008"
    wait_for(proc, lambda: (gate / "held").exists() and (step_dir / "index-00000.json").exists(),
             "rank 0's write of step 8 with rank 1's held")
    for f in step_dir.iterdir():
        f.unlink()
    step_dir.rmdir()
    step_dir.write_text("not a directory")
    (gate / "release").touch()
    out, err = finish(proc)

    assert proc.returncode == 1 and re.search(r"exitcode\s*:\s*2\b", err), err[-3000:]  # UserError: 2
    lines = {rank: [ln for ln in err.splitlines() if ln.startswith(f"error on rank {rank}:")]
             for rank in (0, 1)}
    assert [len(lines[0]), len(lines[1])] == [1, 1], err[-5000:]
    # "write", not "commit": committing despite the failure (which fails here only because
    # the directory is gone) would be the bug
    assert re.search(r"could not write snapshot step 8 at gatedfile://\S+: NotADirectoryError: "
                     r".*part-00001\.bin.*; the previous snapshot stays the one to resume from$",
                     lines[1][0]), lines[1][0]
    assert "could not write snapshot step 8 at " in lines[0][0] and "on another rank" in lines[0][0]
    assert not our_frames(err), err[-5000:]
    assert open_snapshot(str(snapshot)).meta["step"] == 4
    assert not (snapshot / "step-00000008" / "manifest.json").exists()
    assert max(r["step"] for r in read_metrics(workdir / "runs" / "default")) < 12
