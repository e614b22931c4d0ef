"""trainer.snapshot_async: snapshots written in the background keep every guarantee of
the synchronous ones (checkpoint/async_snapshot.py).

- the same training (losses bitwise equal to a synchronous run), and a background-
  written snapshot resumes with the losses of an uninterrupted run;
- SIGKILL while a part is being written (a slow filesystem holds the write open):
  latest.json still names the previous snapshot, which resumes exactly;
- a failed background write: one clear error, the commit point untouched (in process);
- the end of training waits for the write in flight, then saves the last step;
- the commit and retention run on the writer thread, and the next save waits for them
  (in process). Stop signals and failed writes on real jobs: test_async_snapshot_faults.py.
"""

import os
import signal
import textwrap
import time

import pytest

from checkpoint.snapshot_reader import open_snapshot
from checkpoint.snapshot_writer import save_sharded
from errors import UserError
from harness import command, job_env, kill_tree, read_metrics, run_job, run_metrics, workers_of

FSDP = ["parallel.dp=fsdp", "parallel.zero_stage=2", "trainer.max_steps=8", "trainer.save_every=2",
        "trainer.keep_snapshots=4"]


def test_async_training_equals_sync_and_its_snapshots_resume_exactly(tmp_path):
    sync = run_metrics(tmp_path, 2, FSDP)
    workdir = tmp_path / "async"
    result = run_job(workdir, 2, FSDP + ["trainer.snapshot_async=true"])
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = workdir / "runs" / "default"
    records = read_metrics(run_dir)
    assert [r["loss"] for r in records] == [r["loss"] for r in sync]
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in sync]
    saves = [r for r in records if "snapshot_ms" in r]
    assert [r["step"] for r in saves] == [2, 4, 6, 8] and all("snapshot_wait_ms" in r for r in saves)
    for step in (2, 4, 6, 8):  # every save committed, each a complete snapshot
        assert open_snapshot(str(run_dir / "snapshot"), step).meta["step"] == step
    resumed = run_job(workdir, 2, FSDP + ["trainer.snapshot_async=true", "trainer.resume_step=4"])
    assert resumed.returncode == 0 and "at step 4" in resumed.stdout, resumed.stderr[-3000:]
    again = read_metrics(run_dir)
    assert [r["step"] for r in again] == list(range(1, 9))
    assert [r["loss"] for r in again[4:]] == [r["loss"] for r in sync[4:]]


SLOW_FS = textwrap.dedent('''
    # test-only: a local filesystem ("slowfile://") whose part files take seconds to write,
    # so a test can kill a job while a background snapshot write is in flight
    import time
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class _SlowWrites:  # the first write of a part file waits 2 s: the file stays open
        def __init__(self, f):
            self.f, self.waited = f, False
        def write(self, data):
            if not self.waited:
                time.sleep(2.0)
                self.waited = True
            return self.f.write(data)
        def __getattr__(self, name):
            return getattr(self.f, name)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    class SlowFileSystem(LocalFileSystem):
        protocol = "slowfile"
        def _open(self, path, mode="rb", **kw):
            f = super()._open(path, mode, **kw)
            return _SlowWrites(f) if "w" in mode and path.endswith(".bin") else f

    fsspec.register_implementation("slowfile", SlowFileSystem, clobber=True)
''')


def test_sigkill_during_a_background_write_keeps_the_previous_snapshot(tmp_path):
    """Save at 2 (committed), save at 4 written slowly in the background: SIGKILL the
    ranks while step 4's part is open. latest.json names step 2, and resuming from it
    gives the losses of an uninterrupted run."""
    reference = run_metrics(tmp_path, 2, FSDP)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_FS)
    snapshot = tmp_path / "snapshot"
    env = dict(job_env(), PYTHONPATH=str(site))
    workdir = tmp_path / "killed"
    workdir.mkdir()
    import subprocess
    from harness import TINY
    proc = subprocess.Popen(command(2, TINY + FSDP + ["trainer.snapshot_async=true",
                                                       f"trainer.snapshot_path=slowfile://{snapshot}"]),
                            cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    part = snapshot / "step-00000004" / "part-00000.bin"
    deadline = time.time() + 120
    while not part.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert part.exists(), "the step 4 write never started"
    for pid in workers_of(proc.pid):
        os.kill(pid, signal.SIGKILL)
    kill_tree(proc.pid)
    proc.communicate()
    assert open_snapshot(str(snapshot)).meta["step"] == 2  # the commit point: step 2
    resumed = run_job(workdir, 2, FSDP + [f"trainer.snapshot_path={snapshot}"])
    assert resumed.returncode == 0 and "at step 2" in resumed.stdout, resumed.stderr[-3000:]
    records = read_metrics(workdir / "runs" / "default")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["loss"] for r in records[2:]] == [r["loss"] for r in reference[2:]]


def test_a_failed_background_write_is_one_error_and_the_commit_point_stays(one_rank_grid, tmp_path,
                                                                         monkeypatch):
    import torch
    from checkpoint import async_snapshot
    path = str(tmp_path / "snapshot")
    pieces = [("model/w", (2, 3), ((0, 2), (0, 3)), torch.ones(2, 3))]
    meta = {"config": {}, "gpt_config": {}, "tokenizer": {}}
    save_sharded(path, one_rank_grid, 1, pieces, meta)  # the snapshot to fall back on
    saver = async_snapshot.AsyncSnapshots(path, one_rank_grid, keep=2)

    def disk_full(*args):
        raise OSError("No space left on device")
    monkeypatch.setattr(async_snapshot, "write_part", disk_full)
    saver.begin(2, pieces, meta)
    saver.advance(saver.grid_all_reduce(saver.flags()))  # staged -> writing
    saver.write.exception()  # let the background write fail
    with pytest.raises(UserError, match="could not write snapshot step 2 .*No space left on device"):
        saver.advance(saver.grid_all_reduce(saver.flags()))
    assert open_snapshot(path).meta["step"] == 1
    saver.close()


def test_retention_runs_in_the_background_and_the_next_save_waits_for_it(one_rank_grid, tmp_path,
                                                                          monkeypatch):
    """The commit and keep_snapshots' deletions run on the writer thread. Retention removes
    unfinished step directories, so a save that starts while it runs must wait for it
    (here it is slowed down), or it would delete the new save's directory."""
    import torch
    from checkpoint import async_snapshot
    from checkpoint.snapshot_dirs import kept_steps, remove_stale
    path = str(tmp_path / "snapshot")
    pieces = [("model/w", (2, 3), ((0, 2), (0, 3)), torch.ones(2, 3))]
    meta = {"config": {}, "gpt_config": {}, "tokenizer": {}}
    save_sharded(path, one_rank_grid, 1, pieces, meta)

    def slow_remove_stale(*args):
        time.sleep(0.5)
        remove_stale(*args)
    monkeypatch.setattr(async_snapshot, "remove_stale", slow_remove_stale)
    saver = async_snapshot.AsyncSnapshots(path, one_rank_grid, keep=1)
    saver.begin(2, pieces, meta)
    saver.advance(saver.grid_all_reduce(saver.flags()))  # staged -> writing
    saver.write.result()
    saver.advance(saver.grid_all_reduce(saver.flags()))  # written -> committing, in the background
    assert saver.state == async_snapshot.COMMITTING and not saver.commit.done()
    saver.begin(3, pieces, meta)  # waits for step 2's commit and retention, then prepares 3
    saver.drain()  # writes and commits step 3
    import fsspec
    assert kept_steps(fsspec.filesystem("file"), path) == [3]
    assert open_snapshot(path).meta["step"] == 3
    assert saver.last_wait_ms > 300  # what metrics report as snapshot_wait_ms
    saver.close()
