"""A hang names the rank and the collective (launch/hang_report.py).

4 ranks train; once step 2 is logged, rank 3 is stopped with SIGSTOP (not killed: it
holds its sockets and answers nothing). The others give up after parallel.timeout_s,
each writes run_dir/hang/rank<R>.json (the collective, its group, its number on the
group, the step and phase) and ends with one line naming rank 3 as behind, within the
timeout plus a margin. Under ddp_bucket and under a pipeline (dp2 x pp2, 1F1B)."""

import json
import os
import signal
import subprocess
import time

import pytest

from harness import REPO, TINY, job_env, kill_tree, python, read_metrics
from launch import process_tree

TIMEOUT_S = 5


def rank_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return int(env[b"RANK"])


@pytest.mark.parametrize("layout", [
    ["parallel.dp=ddp_bucket"],
    pytest.param(["parallel.dp=ddp_bucket", "parallel.pp=2", "parallel.microbatches=2"],
                 marks=pytest.mark.long),  # the long tier: the same report through a pipeline
], ids=["ddp_bucket", "dp2-pp2-1f1b"])
def test_a_stopped_rank_is_named_by_the_others_within_the_timeout(tmp_path, layout):
    run_dir = tmp_path / "run"
    cmd = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           os.path.join(REPO, "main.py"), *TINY, *layout, "trainer.max_steps=100000",
           "trainer.log_every=1", f"parallel.timeout_s={TIMEOUT_S}", f"trainer.run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(forked=False), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(run_dir)) < 2:
            assert time.time() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        workers = process_tree.workers_of(proc.pid)
        stopped = next(p for p in workers if rank_of(p) == 3)
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.time()
        while any(process_tree.alive(p) for p in workers if p != stopped):  # the others end
            assert time.time() - stopped_at < TIMEOUT_S + 60, "the other ranks hang"
            time.sleep(0.2)
        waited = time.time() - stopped_at
    finally:
        kill_tree(proc.pid)  # torchrun and the stopped rank (SIGTERM waits for a SIGCONT)
    out, err = proc.communicate()
    lines = [ln for ln in err.splitlines() if ln.startswith("error on rank")]
    print(f"ended {waited:.1f} s after the stop:\n" + "\n".join(lines))
    assert proc.returncode != 0 and lines, err[-3000:]
    assert waited <= TIMEOUT_S + 30
    assert all("rank(s) 3 behind (no report" in ln for ln in lines), lines
    assert not any(ln.startswith("error on rank 3") for ln in lines)
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in (run_dir / "hang").glob("rank*.json")}
    assert reports and 3 not in reports, reports
    for rank, report in reports.items():
        assert report["rank"] == rank and report["step"] >= 3 and report["phase"], report
        assert "op" in report or "site" in report, report


def test_on_nccl_the_flight_recorder_dumps_into_the_hang_folder(tmp_path, monkeypatch):
    """A GPU run's process group starts with NCCL's flight recorder on and its dump on a
    timeout going to run_dir/hang/ (a user's own settings win), its collectives waiting
    parallel.timeout_s plus the margin in which the hang watchdog reports first
    (test_hang_watchdog.py)."""
    import main
    from launch.hang_report import nccl_flight_recorder
    env = nccl_flight_recorder(str(tmp_path))
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith(str(tmp_path / "hang"))
    started = []
    monkeypatch.setattr(main.dist, "init_process_group", lambda *a, **k: started.append(k))
    for key in env:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "7")  # the user's
    monkeypatch.delenv("MASTER_ADDR", raising=False)

    class Cuda:  # a device of type cuda, without a GPU
        type = "cuda"
    main.init_process_group(Cuda(), 60, 0, 1, str(tmp_path))
    assert started and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "7"
    assert started[0]["timeout"].total_seconds() == 75  # 60 s and a quarter of it
    assert (tmp_path / "hang").is_dir()
