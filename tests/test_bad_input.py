"""Bad input in a real 2-rank torchrun job: one clear error naming the file on every
rank, a non-zero exit, no hang (run_job's timeout), and no snapshot touched."""

import os

import pytest

from char_dataset import embedded_corpus
from harness import REPO, run_job


def assert_clean_failure(result, *needles):
    assert result.returncode != 0, result.stdout
    for rank in (0, 1):
        lines = [ln for ln in result.stderr.splitlines() if ln.startswith(f"error on rank {rank}:")]
        assert len(lines) == 1, f"rank {rank} should print one error line:\n{result.stderr}"
        for needle in needles:
            assert needle in lines[0], lines[0]
    # no traceback from our code (torchrun's launcher adds its own failure summary)
    assert f'File "{REPO}' not in result.stderr, result.stderr


@pytest.mark.parametrize("name,content,needle", [
    ("missing.txt", None, "data file not found"),
    ("short.txt", "tiny text", "too short"),
    ("latin1.txt", "caf\u00e9 ".encode("latin-1") * 50, "not UTF-8"),
])
def test_bad_data(tmp_path, name, content, needle):
    path = tmp_path / name
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_bytes(content)
    result = run_job(tmp_path / "job", 2, [f"data.path={path}"], timeout=120)
    assert_clean_failure(result, needle, str(path))


@pytest.fixture(scope="module")
def good_snapshot(tmp_path_factory):
    """A real snapshot written by a short 2-rank run."""
    workdir = tmp_path_factory.mktemp("good")
    result = run_job(workdir, 2, ["trainer.max_steps=2"])
    assert result.returncode == 0, result.stderr
    with open(workdir / "runs" / "default" / "snapshot.pt", "rb") as f:
        return f.read()


@pytest.mark.parametrize("damage,overrides,needle", [
    ("truncate", [], "corrupt or truncated"),
    ("garbage", [], "corrupt or truncated"),
    (None, ["model.n_embd=48"], "another shape"),
    (None, ["trainer.batch_size=24"], "batch_size"),
])
def test_bad_snapshot(tmp_path, good_snapshot, damage, overrides, needle):
    snap = tmp_path / "snap.pt"
    data = {"truncate": good_snapshot[: len(good_snapshot) // 2],
            "garbage": b"not a snapshot" * 100, None: good_snapshot}[damage]
    snap.write_bytes(data)
    before = os.stat(snap).st_mtime_ns
    result = run_job(tmp_path / "job", 2, [f"trainer.snapshot_path={snap}", *overrides], timeout=120)
    assert_clean_failure(result, needle, str(snap))
    assert snap.read_bytes() == data and os.stat(snap).st_mtime_ns == before  # untouched


def test_bad_config_under_torchrun(tmp_path):
    result = run_job(tmp_path / "job", 2, ["trainer.batch_size=7"], timeout=120)
    assert_clean_failure(result, "trainer.batch_size=7")


def test_prompt_outside_vocabulary(tmp_path, good_snapshot):
    snap = tmp_path / "snap.pt"
    snap.write_bytes(good_snapshot)
    result = run_job(tmp_path, 1, ["mode=sample", f"trainer.snapshot_path={snap}",
                                   "sample.prompt=\u2603"], timeout=60)
    assert result.returncode == 2 and "not in the vocabulary" in result.stderr
