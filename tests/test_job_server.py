"""The job server (harness.run_job's default, tests/job_server.py) runs main.py's jobs in
long-lived torchrun workers. What a test sees from it must be what a fresh job gives:

- the same job, fresh, forked by the fork server and in the job server (after another
  job there), writes the same metrics.jsonl to the bit and the same snapshot;
- a job leaves nothing running behind it: no rank of the server holds more threads
  after more jobs (a gloo group left alive keeps threads, one waking every 10 ms);
- a job that fails in the server with a UserError (status 2 on every rank, its process
  group left started) returns its status and its one line per rank, and the server runs
  the next job as a fresh one would; a rank that cannot go on (any other status) leaves
  the server, and a job past its timeout fails the test and ends its server.
"""

import json
import os

import pytest

from harness import forked_process, job_server, read_metrics, run_job, snapshot_state, workers_of

JOB = ["parallel.dp=fsdp", "parallel.zero_stage=3", "model.dropout=0.1", "trainer.eval_every=3",
       "trainer.save_every=3"]


@pytest.mark.long  # the long tier (tests/README.md)
def test_a_job_in_the_server_equals_the_same_job_fresh(tmp_path):
    run_job(tmp_path / "before", 2, ["parallel.dp=ddp_bucket"])  # the server has run a job
    server = job_server(2)
    # and one that failed on every rank after main.py had started its process group
    failed = run_job(tmp_path / "failed", 2, [f"data.path={tmp_path / 'missing.txt'}"])
    assert failed.returncode == 2 and "data file not found" in failed.stderr, failed.stderr
    assert job_server(2) is server and server.alive()
    runs = {}
    # fresh: real interpreters; forked: by the fork server (tests/fork_server.py), as the
    # suite's other fresh jobs are; server: in the job server, after the jobs above
    for how in ("fresh", "forked", "server"):
        result = run_job(tmp_path / how, 2, JOB, fresh=how != "server", forked=how == "forked")
        assert result.returncode == 0 and "step 6/6" in result.stdout, result.stderr[-3000:]
        run_dir = tmp_path / how / "runs" / "default"
        runs[how] = ([json.dumps({k: r[k] for k in ("step", "loss", "grad_norm", "val_loss") if k in r})
                      for r in read_metrics(run_dir)], snapshot_state(run_dir / "snapshot"))
    fresh, fresh_state = runs["fresh"]
    for how in ("forked", "server"):
        got, state = runs[how]
        assert got == fresh, how
        for name, t in fresh_state["model"].items():
            assert state["model"][name].equal(t), (how, name)


def threads_per_rank(server):
    """How many threads each rank of the server runs now (its real process, where a
    stand-in forwards to a forked one)."""
    return [len(os.listdir(f"/proc/{forked_process(rank) or rank}/task"))
            for rank in workers_of(server.proc.pid)]


def test_jobs_leave_no_threads_behind_in_the_server(tmp_path):
    """Each kind of job once (a thread pool a kind starts once may stay), then each
    again: no rank may hold more threads. A job's process groups (each gloo group: an
    event loop and two workers) must go with it: destroyed by main.py, and freed, which
    a strategy kept alive by its own gradient hooks prevented
    (parallel/data_parallel/grad_hooks.py)."""
    kinds = [["parallel.dp=ddp_bucket"], ["parallel.dp=fsdp", "parallel.zero_stage=3"]]
    for i, kind in enumerate(kinds):
        assert run_job(tmp_path / f"first-{i}", 2, kind).returncode == 0
    server = job_server(2)
    before = threads_per_rank(server)
    assert len(before) == 2, before
    for i, kind in enumerate(kinds * 2):
        assert run_job(tmp_path / f"again-{i}", 2, kind).returncode == 0
    assert job_server(2) is server
    assert threads_per_rank(server) == before


def test_a_failed_job_returns_its_status_and_its_lines_and_the_server_goes_on(tmp_path):
    first = job_server(2)
    bad = run_job(tmp_path / "bad", 2, ["trainer.batch_size=7"])  # 7 is not divisible by dp 2
    assert bad.returncode == 2, bad.stderr
    assert sorted(ln[:15] for ln in bad.stderr.splitlines() if ln.startswith("error on rank")) \
        == ["error on rank 0", "error on rank 1"], bad.stderr
    assert first.alive()
    good = run_job(tmp_path / "good", 2, [])
    assert good.returncode == 0, good.stderr[-3000:]
    assert job_server(2) is first


def test_a_rank_goes_on_after_status_0_or_2_only_with_its_process_group_gone():
    """tests/job_server.py's rule, in process on a one-rank gloo group: a UserError's
    status (2) with the group main.py left started, the group destroyed; a traceback's (1)
    or a signal's status ends the rank's server."""
    import torch.distributed as dist
    from job_server import can_run_another
    assert can_run_another(0) and not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert can_run_another(2) and not dist.is_initialized()
    assert not any(can_run_another(code) for code in (1, 130, 143))


def test_a_job_past_its_timeout_fails_the_test_and_ends_its_server(tmp_path):
    import pytest
    server = job_server(2)
    with pytest.raises(AssertionError, match="hung in the 2-rank job server"):
        run_job(tmp_path / "long", 2, ["trainer.max_steps=100000"], timeout=3)
    assert not server.alive()
