"""A finished 2-rank job exits 0 on every rank, every time (torch 2.13 was seen to give a
SIGABRT at interpreter shutdown in about 1 of 5 such runs; main.run_and_exit avoids it).

Three runs here (a 1-in-5 abort shows with probability 49%). Their processes leave
through the interpreter's own teardown (FORK_SERVER_FULL_EXIT=1: the fork server's
default way out skips it, tests/fork_server.py), so an abort there shows as it would for
a user; their start is forked, as every fresh job's of the suite."""

import os

from harness import TINY, command, job_env, run_tree

RUNS = 3


def test_short_jobs_all_exit_zero(tmp_path):
    codes = []
    for i in range(RUNS):
        workdir = tmp_path / f"run{i}"
        workdir.mkdir()
        result = run_tree(command(2, TINY + ["trainer.max_steps=1"]), 120, f"run {i}", cwd=workdir,
                          env=dict(job_env(), FORK_SERVER_FULL_EXIT="1"))
        codes.append(result.returncode)
        assert result.returncode == 0, f"run {i} exited {result.returncode}:\n{result.stderr[-3000:]}"
        assert os.path.exists(workdir / "runs" / "default" / "snapshot" / "latest.json")
    assert codes == [0] * RUNS
