"""Bad input in a real 2-rank job: one clear error naming the file on every rank, a
non-zero exit, no hang (run_job's timeout), and no snapshot touched. Two jobs run under
a torchrun of their own (fresh: the exit status and console of a real launch), one
failing before main.py starts its process group (a config) and one after (a data file:
it leaves with the group started); the others run in the job server, the same main.run
on 2 real ranks, which goes on after a UserError on every rank. Damaged snapshots whose
damage the reader's opening finds (as every rank's does) are checked in process after
three of them have gone through the whole job."""

import json
import re
import shutil

import pytest

from checkpoint.checksums import seal
from checkpoint.snapshot_reader import check_model_shape, open_snapshot
from errors import UserError
from harness import our_frames, run_job


def assert_clean_failure(result, *needles):
    """Every rank finds the problem on its own and prints one line. (Once one rank
    has exited, torchrun may stop the other before it prints: so a rank prints
    at most one line, and at least one rank prints.)"""
    assert result.returncode != 0, result.stdout
    printed = 0
    for rank in range(8):  # whichever ranks printed before torchrun stopped them
        # (torchrun's summary quotes a line again, indented: `traceback : error on rank 0: ...`)
        lines = [ln for ln in result.stderr.splitlines() if ln.startswith(f"error on rank {rank}:")]
        assert len(lines) <= 1, f"rank {rank} printed more than one error line:\n{result.stderr}"
        for line in lines:
            printed += 1
            for needle in needles:
                assert needle in line, line
    assert printed >= 1, result.stderr
    # no traceback from our code (torchrun's launcher adds its own failure summary)
    assert not our_frames(result.stderr), result.stderr


def assert_root_cause_is_our_line(result, *needles):
    """Under torchrun: its failure summary's root cause carries the failed rank's line as
    its traceback (main.py writes it into TORCHELASTIC_ERROR_FILE, as torch's @record
    would), not torchrun's "To enable traceback see: ..."; torchrun itself exits 1."""
    assert result.returncode == 1, result.stderr[-3000:]
    cause = re.search(r"^Root Cause \(first observed failure\):\n(?:  .*\n|\[0\]:\n)*?"
                      r"  traceback : (error on rank \d: .*)$", result.stderr, re.M)
    assert cause and all(n in cause.group(1) for n in needles), result.stderr[-3000:]
    assert "To enable traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("name,content,needle,fresh", [
    ("missing.txt", None, "data file not found", True),
    ("short.txt", "tiny text", "too short", False),
    ("latin1.txt", "caf\u00e9 ".encode("latin-1") * 50, "not UTF-8", False),
])
def test_bad_data(tmp_path, name, content, needle, fresh):
    path = tmp_path / name
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_bytes(content)
    result = run_job(tmp_path / "job", 2, [f"data.path={path}"], fresh=fresh)
    assert_clean_failure(result, needle, str(path))
    if fresh:
        assert_root_cause_is_our_line(result, needle, str(path))


@pytest.fixture(scope="module")
def good_snapshot(tmp_path_factory):
    """A real snapshot written by a short 2-rank run (two parts, one per rank)."""
    workdir = tmp_path_factory.mktemp("good")
    result = run_job(workdir, 2, ["trainer.max_steps=2"])
    assert result.returncode == 0, result.stderr
    return workdir / "runs" / "default" / "snapshot"


def tree_bytes(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def damage(snap, how):
    """Break a copy of a good snapshot the way `how` says; returns the file it broke."""
    step_dir = next(snap.glob("step-*"))
    part, manifest = step_dir / "part-00001.bin", step_dir / "manifest.json"
    if how == "truncated part":
        part.write_bytes(part.read_bytes()[:-100])
        return part
    if how == "missing part":
        part.unlink()
        return part
    if how == "part from another version":
        data = part.read_bytes()
        header = json.loads(data[:256])
        header["format_version"] = 1
        part.write_bytes(json.dumps(header).encode().ljust(256) + data[256:])
        return part
    if how == "garbage manifest":
        manifest.write_text("{not json")
        return manifest
    if how == "manifest of another shape":
        meta = json.loads(manifest.read_text())
        meta["gpt_config"]["n_embd"] = 48
        manifest.write_text(json.dumps(seal(meta)))  # a sound manifest, of another model
        return snap
    # names are data from elsewhere: a complete, valid copy lies outside the snapshot,
    # so a reader that followed the name would resume from it without complaint
    outside = snap.parent / "outside"
    if how == "latest.json leads outside":
        shutil.copytree(step_dir, outside / step_dir.name)
        latest = snap / "latest.json"
        pointer = json.loads(latest.read_text())
        pointer["step_dir"] = f"../outside/{step_dir.name}"
        latest.write_text(json.dumps(pointer))
        return latest
    if how == "manifest names a part outside":
        outside.mkdir()
        shutil.copy(part, outside / part.name)
        meta = json.loads(manifest.read_text())
        for entry in meta["parts"]:
            if entry["file"] == part.name:
                entry["file"] = f"../../outside/{part.name}"
        manifest.write_text(json.dumps(seal(meta)))  # sealed anew: a checksum is no defence
        return manifest
    return snap


# through a real 2-rank job, in the job server (every rank says it, its status, snapshot
# untouched): a part found damaged on opening, a manifest the model check refuses, a
# config that differs
@pytest.mark.parametrize("how,overrides,needle", [
    ("truncated part", [], "truncated"),
    ("manifest of another shape", [], "another shape"),
    (None, ["trainer.batch_size=24"], "batch_size"),
])
def test_bad_snapshot(tmp_path, good_snapshot, how, overrides, needle):
    snap = tmp_path / "snap"
    shutil.copytree(good_snapshot, snap)
    broken = damage(snap, how)
    before = tree_bytes(snap)
    result = run_job(tmp_path / "job", 2, [f"trainer.snapshot_path={snap}", *overrides])
    assert_clean_failure(result, needle, str(broken))
    assert tree_bytes(snap) == before  # nothing overwritten, nothing lost


# the other damages are found by the same opening every rank does (SnapshotReader checks
# versions, names, parts and sizes before any tensor is read), so in process: the one
# message, naming the damaged file, and nothing written
@pytest.mark.parametrize("how,needle", [
    ("missing part", "missing"),
    ("part from another version", "another version"),
    ("garbage manifest", "corrupt or truncated"),
    ("latest.json leads outside", "must not lead outside"),
    ("manifest names a part outside", "must not lead outside"),
])
def test_bad_snapshot_is_refused_on_opening(tmp_path, good_snapshot, how, needle):
    snap = tmp_path / "snap"
    shutil.copytree(good_snapshot, snap)
    broken = damage(snap, how)
    before = tree_bytes(snap)
    with pytest.raises(UserError) as refused:
        open_snapshot(str(snap))
    assert needle in str(refused.value) and str(broken) in str(refused.value), refused.value
    assert "\n" not in str(refused.value)
    assert tree_bytes(snap) == before


def test_snapshot_of_another_model_shape_is_refused(good_snapshot):
    """trainer.snapshot_path of a model with another n_embd than the config's (the same
    check as the damaged manifest of another shape, run above on 2 ranks)."""
    snap = open_snapshot(str(good_snapshot))
    config = dict(snap.meta["gpt_config"], n_embd=48)
    with pytest.raises(UserError, match="another shape.*n_embd: snapshot 32 vs config 48"):
        check_model_shape(str(good_snapshot), snap.meta["gpt_config"], config)


def test_bad_config_under_torchrun(tmp_path):
    result = run_job(tmp_path / "job", 2, ["trainer.batch_size=7"], timeout=120, fresh=True)
    assert_clean_failure(result, "trainer.batch_size=7")
    assert_root_cause_is_our_line(result, "trainer.batch_size=7")


def test_prompt_outside_vocabulary(tmp_path, good_snapshot):
    result = run_job(tmp_path, 1, ["mode=sample", f"trainer.snapshot_path={good_snapshot}",
                                   "sample.prompt=\u2603"], timeout=60)
    assert result.returncode == 2 and "not in the vocabulary of the snapshot at" in result.stderr
