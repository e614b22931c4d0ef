"""The sharded snapshot format in one process: what the reader refuses, and cleanup."""

import json
import os

import pytest
import torch

from errors import UserError
from harness import run_job
from checkpoint.snapshot_reader import open_snapshot
from checkpoint.snapshot_writer import save_sharded

META = {"gpt_config": {}}


def test_ranged_reads_assemble_pieces(tmp_path, one_rank_grid):
    w = torch.arange(12, dtype=torch.float32)
    pieces = [("model/w", (3, 4), 0, w[:5]), ("model/w", (3, 4), 5, w[5:]),
              ("optim/w/step", (), 0, torch.tensor([7.0]))]
    save_sharded(str(tmp_path / "s"), one_rank_grid, 1, pieces, META)
    snap = open_snapshot(str(tmp_path / "s"))
    assert torch.equal(snap.read_full("model/w"), w.view(3, 4))
    assert torch.equal(snap.read("model/w", 3, 6), w[3:9])  # across the two pieces
    assert snap.read_full("optim/w/step").item() == 7.0


@pytest.mark.parametrize("pieces,message", [
    ([("model/w", (10,), 0, torch.ones(6)), ("model/w", (10,), 4, torch.ones(4))], "overlap"),
    ([("model/w", (10,), 0, torch.ones(6))], "cover 6 of 10"),
])
def test_reader_refuses_ranges_that_do_not_tile(tmp_path, one_rank_grid, pieces, message):
    save_sharded(str(tmp_path / "s"), one_rank_grid, 1, pieces, META)
    with pytest.raises(UserError, match=message):
        open_snapshot(str(tmp_path / "s"))


def test_manifest_that_is_not_an_object(tmp_path, one_rank_grid):
    save_sharded(str(tmp_path / "s"), one_rank_grid, 1, [("model/w", (2,), 0, torch.ones(2))], META)
    manifest = next((tmp_path / "s").glob("step-*")) / "manifest.json"
    manifest.write_text(json.dumps([1, 2]))
    with pytest.raises(UserError, match="not a JSON object"):
        open_snapshot(str(tmp_path / "s"))


def test_old_steps_are_removed_even_with_glob_characters_in_the_path(tmp_path, one_rank_grid):
    path = str(tmp_path / "exp[2]" / "snap")
    for step in (1, 2, 3):
        save_sharded(path, one_rank_grid, step, [("model/w", (2,), 0, torch.full((2,), float(step)))], META)
    assert sorted(os.listdir(path)) == ["latest.json", "step-00000003"]
    assert open_snapshot(path).read_full("model/w").tolist() == [3.0, 3.0]


def test_a_failure_on_the_main_rank_alone_stops_every_rank(tmp_path):
    """Only rank 0 creates the run directory; when it cannot, rank 1 must not go on
    training and wait for it forever: both exit non-zero, quickly. (In the job server:
    each rank's status is its own there; how such a job leaves through torchrun is
    tests/test_bad_input.py's fresh bad-data job, failing at the same point.)"""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    result = run_job(tmp_path / "job", 2, [f"trainer.run_dir={blocker}/run"])
    assert result.returncode != 0
    rank0 = [ln for ln in result.stderr.splitlines() if "error on rank 0:" in ln]
    assert len(rank0) == 1 and str(blocker) in rank0[0], result.stderr[-3000:]


@pytest.mark.parametrize("dies", ["every file", "part-", "manifest.json", "latest.json"])
def test_commit_point_is_written_last_so_a_failed_write_keeps_previous_snapshot(
        tmp_path, monkeypatch, one_rank_grid, dies):
    """A write that dies half way -- in a part, in the manifest, in latest.json, or in
    every file -- leaves the previous snapshot loadable, and every rank gets one clear
    error. A commit point (latest.json) written before the parts and the manifest
    would name a step directory that is not complete."""
    path = str(tmp_path / "snap")
    save_sharded(path, one_rank_grid, 1, [("model/w", (3,), 0, torch.ones(3))], META)
    import fsspec.implementations.local as local

    real_open = local.LocalFileSystem._open

    def dying_open(self, p, mode="rb", **kw):
        f = real_open(self, p, mode, **kw)
        if "w" in mode and (dies == "every file" or dies in p.rsplit("/", 1)[-1]):
            def write(data):
                f.__class__.write(f, bytes(data)[:10])
                raise OSError("disk died mid-write")
            f.write = write
        return f

    monkeypatch.setattr(local.LocalFileSystem, "_open", dying_open)
    with pytest.raises(UserError, match="could not write snapshot .*disk died"):
        save_sharded(path, one_rank_grid, 2, [("model/w", (3,), 0, torch.zeros(3))], META)
    monkeypatch.undo()
    snap = open_snapshot(path)
    assert snap.meta["step"] == 1 and torch.equal(snap.read_full("model/w"), torch.ones(3))
    # the next successful write cleans up the dead one's leftovers
    save_sharded(path, one_rank_grid, 3, [("model/w", (3,), 0, torch.full((3,), 3.0))], META)
    assert sorted(os.listdir(path)) == ["latest.json", "step-00000003"]


@pytest.mark.parametrize("name", ["step-00000004\n", "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0664",
                                  "/step-00000004", "a/step-00000004", "../step-00000004", "step-0000004"])
def test_names_from_a_snapshot_must_be_plain_and_whole(name):
    """Names read from latest.json and manifests are matched whole, in ASCII: a trailing
    newline, other digits, a path, or a short number is no step directory."""
    from checkpoint.snapshot_dirs import STEP_DIR, checked_name
    assert checked_name("step-00000004", STEP_DIR, "step-00000120", "latest.json", "snap") == "step-00000004"
    with pytest.raises(UserError, match="must not lead outside it"):
        checked_name(name, STEP_DIR, "step-00000120", "latest.json", "snap")
