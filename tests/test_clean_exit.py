"""A finished 2-rank job exits 0 on every rank, every time (torch 2.13 was seen to give a
SIGABRT at interpreter shutdown in about 1 of 5 such runs; main.run_and_exit avoids it).

Three runs here (a 1-in-5 abort shows with probability 49%), on real interpreters (the
other fresh jobs' processes are forked from tests/fork_server.py, which leaves past the
interpreter's teardown): every rank of these starts and exits as a user's does."""

import os

from harness import run_job

RUNS = 3


def test_short_jobs_all_exit_zero(tmp_path):
    codes = []
    for i in range(RUNS):
        result = run_job(tmp_path / f"run{i}", 2, ["trainer.max_steps=1"], timeout=120,
                         fresh=True, forked=False)  # interpreters that start and leave
        codes.append(result.returncode)
        assert result.returncode == 0, f"run {i} exited {result.returncode}:\n{result.stderr[-3000:]}"
        assert os.path.exists(tmp_path / f"run{i}" / "runs" / "default" / "snapshot" / "latest.json")
    assert codes == [0] * RUNS
