"""trainer.snapshot_path as an s3:// URL, through s3fs, against a local S3-compatible
server (moto) that this test starts on loopback: a job writes its snapshot there and a
second job resumes from it with the losses of an uninterrupted run."""

import os
import socket
import subprocess
import sys
import time

import pytest

from harness import run_job, run_metrics, read_metrics

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto")

# constant LR after a 0-step warm-up, so a 3-step job and a 6-step job share a schedule
ARGS = ["parallel.dp=torch_ddp", "trainer.warmup_steps=0", "trainer.min_lr=0.002",
        "trainer.lr=0.002"]


@pytest.fixture
def s3_server(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(key, value)  # the jobs inherit these
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.time() < deadline, "moto server did not start"
            time.sleep(0.2)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    fs.mkdir("snapshots")
    yield fs
    server.kill()
    server.wait()


def test_snapshot_on_s3_resumes(tmp_path, s3_server):
    reference = [r["loss"] for r in run_metrics(tmp_path, 2, ARGS + ["trainer.max_steps=6"])]
    url = "s3://snapshots/run1/snapshot"
    workdir = tmp_path / "s3job"
    first = run_job(workdir, 2, ARGS + ["trainer.max_steps=3", f"trainer.snapshot_path={url}"])
    assert first.returncode == 0, first.stderr[-3000:]
    s3_server.invalidate_cache()
    assert s3_server.exists(url + "/latest.json")
    assert not os.path.exists(workdir / "runs" / "default" / "snapshot")
    # a process of its own: s3fs caches listings per process, and a user resumes in a new one
    second = run_job(workdir, 2, ARGS + ["trainer.max_steps=6", f"trainer.snapshot_path={url}"],
                     fresh=True)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from snapshot s3://" in second.stdout
    losses = [r["loss"] for r in read_metrics(workdir / "runs" / "default")]
    assert len(losses) == 6
    assert max(abs(a - b) / a for a, b in zip(reference, losses)) <= 1e-6
