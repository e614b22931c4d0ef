"""trainer.keep_snapshots and trainer.resume_step: which snapshots survive, going back to
one, and a requeued `resume_step` command that must not go back twice. In one process
for the rules, then a real 2-rank job end to end."""

import json
import os

import pytest
import torch

from errors import UserError
from harness import read_metrics, run_job
from checkpoint.snapshot_reader import open_snapshot, step_to_resume
from checkpoint.snapshot_writer import save_sharded


def meta(resume_step=-1):
    return {"gpt_config": {}, "config": {"trainer": {"resume_step": resume_step}}}


def write(path, grid, step, keep, resume_step=-1):
    save_sharded(path, grid, step, [("model/w", (2,), 0, torch.full((2,), float(step)))],
                 meta(resume_step), keep=keep)


def step_dirs(path):
    return sorted(n for n in os.listdir(path) if n.startswith("step-"))


def test_keep_the_newest_k_and_open_any_of_them(tmp_path, one_rank_grid):
    path = str(tmp_path / "snap")
    for step in range(1, 6):
        write(path, one_rank_grid, step, keep=3)
    assert step_dirs(path) == ["step-00000003", "step-00000004", "step-00000005"]
    assert open_snapshot(path).meta["step"] == 5
    assert open_snapshot(path, 4).read_full("model/w").tolist() == [4.0, 4.0]
    with pytest.raises(UserError, match=r"trainer.resume_step=2: .* keeps steps 3, 4, 5 "):
        open_snapshot(path, 2)


def test_a_write_that_never_finished_is_not_kept(tmp_path, one_rank_grid):
    path = str(tmp_path / "snap")
    write(path, one_rank_grid, 1, keep=3)
    os.makedirs(os.path.join(path, "step-00000002"))  # a writer killed before its manifest
    with pytest.raises(UserError, match="keeps steps 1 "):
        open_snapshot(path, 2)
    with pytest.raises(UserError, match="keeps no snapshot"):
        open_snapshot(str(tmp_path / "nothing"), 1)


def test_going_back_drops_the_abandoned_future_at_the_next_write(tmp_path, one_rank_grid):
    path = str(tmp_path / "snap")
    for step in (2, 4, 6):
        write(path, one_rank_grid, step, keep=3)
    step, note = step_to_resume(path, 2)
    assert step == 2 and "steps 4, 6" in note
    assert step_dirs(path) == ["step-00000002", "step-00000004", "step-00000006"]  # not yet
    write(path, one_rank_grid, 3, keep=3, resume_step=2)  # the resumed run's first snapshot
    assert step_dirs(path) == ["step-00000002", "step-00000003"]
    assert open_snapshot(path).meta["step"] == 3


def test_writing_a_resumed_runs_step_again_never_leaves_the_commit_point_dangling(
        tmp_path, one_rank_grid, monkeypatch):
    """Resumed from step 8 (kept: 8, 16; latest.json names 16), the run reaches 16 again:
    latest.json is pointed back at 8 before step 16's directory goes, so a write that
    dies half-way leaves a loadable snapshot (in process: the part write fails)."""
    from checkpoint import snapshot_writer
    path = str(tmp_path / "snap")
    for step in (8, 16):
        write(path, one_rank_grid, step, keep=2)
    monkeypatch.setattr(snapshot_writer, "_write_part", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(UserError, match="disk full"):
        write(path, one_rank_grid, 16, keep=2, resume_step=8)
    assert open_snapshot(path).meta["step"] == 8


def test_unfinished_writes_do_not_count_toward_keep(tmp_path, one_rank_grid):
    path = str(tmp_path / "snap")
    for step in (4, 8):
        write(path, one_rank_grid, step, keep=2)
    os.makedirs(os.path.join(path, "step-00000010"))  # a writer killed before its manifest
    write(path, one_rank_grid, 12, keep=2)
    assert step_dirs(path) == ["step-00000008", "step-00000012"]


def test_the_same_resume_step_command_again_continues_from_the_newest(tmp_path, one_rank_grid):
    """Preempted and requeued with `trainer.resume_step=2` still on the command line:
    continue from what that run wrote since, not from step 2 again."""
    path = str(tmp_path / "snap")
    for step in (2, 4):
        write(path, one_rank_grid, step, keep=3)
    write(path, one_rank_grid, 3, keep=3, resume_step=2)
    write(path, one_rank_grid, 5, keep=3, resume_step=2)
    step, note = step_to_resume(path, 2)
    assert step == -1 and "continuing from step 5" in note
    step, note = step_to_resume(path, 3)  # another step: a new branch, back to it
    assert step == 3 and "(steps 5)" in note


def test_temp_files_of_killed_writers_are_removed(tmp_path, one_rank_grid):
    path = str(tmp_path / "snap")
    write(path, one_rank_grid, 1, keep=2)
    open(os.path.join(path, "latest.json.tmp-deadbeef"), "w").close()
    write(path, one_rank_grid, 2, keep=2)
    assert sorted(os.listdir(path)) == ["latest.json", "step-00000001", "step-00000002"]


ARGS = ["trainer.max_steps=10", "trainer.save_every=2", "trainer.keep_snapshots=3",
        "model.dropout=0.1"]


def test_resume_from_a_kept_older_step_reproduces_the_run(tmp_path):
    """2 ranks: keep 3 snapshots, go back to step 6 of 10, and train 7..10 again with the
    same losses; an unknown step is one error on every rank; the same command run again
    (a requeue) continues from the newest instead of going back again."""
    workdir = tmp_path / "job"
    snap = workdir / "runs" / "default" / "snapshot"
    assert run_job(workdir, 2, ARGS).returncode == 0
    reference = read_metrics(workdir / "runs" / "default")
    assert step_dirs(snap) == ["step-00000006", "step-00000008", "step-00000010"]

    bad = run_job(workdir, 2, ARGS + ["trainer.resume_step=5"])
    assert bad.returncode != 0
    lines = [ln for ln in bad.stderr.splitlines() if ln.startswith("error on rank")]
    assert lines and all("keeps steps 6, 8, 10" in ln for ln in lines), bad.stderr[-3000:]

    back = run_job(workdir, 2, ARGS + ["trainer.resume_step=6"])
    assert back.returncode == 0, back.stderr[-3000:]
    assert "resuming from snapshot" in back.stdout and "at step 6" in back.stdout
    assert "steps 8, 10) are deleted" in back.stdout
    resumed = read_metrics(workdir / "runs" / "default")
    assert [r["step"] for r in resumed] == list(range(1, 11))
    for ref, got in zip(reference, resumed):
        assert abs(ref["loss"] - got["loss"]) <= 1e-6 * ref["loss"], (ref, got)
    manifest = json.loads((snap / "step-00000010" / "manifest.json").read_text())
    assert manifest["config"]["trainer"]["resume_step"] == 6

    again = run_job(workdir, 2, ARGS + ["trainer.resume_step=6"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing from step 10" in again.stdout
    assert read_metrics(workdir / "runs" / "default") == resumed
