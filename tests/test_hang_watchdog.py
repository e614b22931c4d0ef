"""The hang watchdog (launch/hang_report.HangWatch): on NCCL no timeout reaches the
training thread (a collective returns to the host at once, the host then waits on the
device, NCCL's own watchdog aborts the process), so each rank's watchdog thread writes the
report from the collective counters once a step has run parallel.timeout_s.

In process, three ranks as threads over stand-in collectives: each all-reduce returns at
once, as NCCL's does, and the host then blocks in a stand-in device read that never
returns; rank 2 took another path (one all-reduce fewer) or is stopped (no watchdog at
all). Through main.py on 2 ranks (tests/nccl_hang_worker.py): rank 0 blocks in an
all-reduce that never returns and never raises, rank 1 stops before its next one; only
the watchdogs can say where they are. NCCL's groups wait a margin longer than the
timeout, so the watchdog comes first (test_hang_report.py's NCCL test, and the grid's
groups here).
"""

import datetime
import json
import os
import subprocess
import threading
import time

import pytest
import torch

from harness import REPO, TINY, job_env, kill_tree, python
from launch.hang_report import HangReport
from parallel import comm as comm_module
from parallel.comm import CommCounter

TIMEOUT_S = 0.5


@pytest.fixture
def stand_in_nccl(monkeypatch):
    """torch.distributed's all_reduce as NCCL's host sees it: enqueued, returns at once;
    a world of 3. Yields the event that releases the stand-in device reads at the end."""
    monkeypatch.setattr(comm_module.dist, "all_reduce", lambda *a, **k: None)
    monkeypatch.setattr(comm_module.dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(comm_module.dist, "get_process_group_ranks", lambda group: group)
    device = threading.Event()
    yield device
    device.set()  # the blocked "training threads" return


def rank_thread(tmp_path, rank, collectives, watched, device, out):
    """A rank's training thread: step 3 starts, `collectives` all-reduces over the world
    are started (and return at once), rank 2's followed by one over a group of its own;
    then the host waits on the device forever (a logged value's read)."""
    comm = CommCounter()  # made here: this is the training thread the counters know
    hangs = HangReport(str(tmp_path), rank, 3, comm, TIMEOUT_S)
    out[rank] = {"watch": hangs.watch() if watched else None, "started": time.monotonic()}
    hangs.at(step=3, phase="gradient sync")
    for _ in range(collectives):
        comm.all_reduce(torch.zeros(1))
    if rank == 2:  # another path: its last collective is on another group
        comm.all_reduce(torch.zeros(1), group=(2,))
    device.wait()  # the stand-in for the host's read of a device that never gets there
    if out[rank]["watch"] is not None:
        out[rank]["watch"].stop()


@pytest.mark.parametrize("rank2", ["another-path", "stopped"])
def test_the_watchdog_reports_a_hang_that_raises_nothing(tmp_path, stand_in_nccl, rank2):
    """Ranks 0 and 1 start 7 all-reduces of step 3 over the world, rank 2 starts 6 and one
    over a group of its own (another path), or is stopped (no report at all); nobody's
    collective raises. Within the timeout and a poll each live rank writes
    hang/rank<R>.json from its counters (the last collective started, how many on each
    group, the step and phase, by the watchdog) and ranks 0 and 1 print a line naming
    rank 2. Red without the watchdog (no report: nothing raised), or with reports that
    compare only each rank's last collective (rank 2's is on another group: "no rank
    behind found")."""
    out, threads = {}, []
    for rank, n in ((0, 7), (1, 7), (2, 6)):
        threads.append(threading.Thread(target=rank_thread, daemon=True, args=(
            tmp_path, rank, n, not (rank == 2 and rank2 == "stopped"), stand_in_nccl, out)))
        threads[-1].start()
    live = [0, 1] if rank2 == "stopped" else [0, 1, 2]
    deadline = time.monotonic() + TIMEOUT_S + 5
    while not all(r in out and out[r]["watch"] and out[r]["watch"].said for r in live):
        assert time.monotonic() < deadline, "no watchdog line"
        time.sleep(0.05)
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in (tmp_path / "hang").glob("rank*.json")}
    print(json.dumps(reports, indent=1))
    for r in live:
        print(out[r]["watch"].said[0])
    assert sorted(reports) == live
    for r in live:
        rep = reports[r]
        assert (rep["by"], rep["step"], rep["phase"], rep["op"]) == (
            "watchdog", 3, "gradient sync", "all_reduce"), rep
        assert rep["collectives_started"]["0,1,2"] == (6 if r == 2 else 7), rep
        assert (rep["group"], rep["collective_on_group"]) == (([2], 1) if r == 2 else ([0, 1, 2], 7))
        assert TIMEOUT_S <= rep["step_s"] < TIMEOUT_S + 1.5, rep
        line = out[r]["watch"].said[0]
        assert line.startswith(f"hang watchdog on rank {r}: step 3 has run") and "after all_reduce #" in line
        if r < 2:
            assert ("rank(s) 2 behind (no report" if rank2 == "stopped"
                    else "rank(s) 2 behind (fewer collectives into the group)") in line, line


def test_a_step_that_ends_after_the_timeout_withdraws_its_report(tmp_path, stand_in_nccl):
    """One rank whose step 1 runs 3x the timeout, then step 2 starts: the report it
    wrote is withdrawn (a long compilation or evaluation is no hang), and step 2 is
    watched again. Red when the watchdog keeps a finished step's report."""
    comm = CommCounter()
    hangs = HangReport(str(tmp_path), 0, 1, comm, 0.2)
    watch = hangs.watch()
    try:
        hangs.at(step=1, phase="start of step")
        comm.all_reduce(torch.zeros(1))
        time.sleep(0.6)
        assert (tmp_path / "hang" / "rank0.json").exists() and len(watch.said) == 1
        hangs.at(step=2, phase="start of step")
        time.sleep(0.12)
        assert not (tmp_path / "hang" / "rank0.json").exists(), watch.said
        assert "withdrawn" in watch.said[-1]
        time.sleep(0.3)  # step 2 runs late in its turn
        assert json.loads((tmp_path / "hang" / "rank0.json").read_text())["step"] == 2
    finally:
        watch.stop()


def test_the_grids_nccl_groups_wait_a_margin_longer_than_the_timeout(monkeypatch):
    """On a GPU the grid's groups (split_group, NCCL) wait parallel.timeout_s plus the
    margin (at least 10 s, a quarter of it), the host group (gloo) the timeout itself:
    every rank's watchdog, which fires once a step has run the timeout, writes its report
    before NCCL's own watchdog aborts the process. Red with the margin gone."""
    from parallel.grid import ProcessGrid, nccl_timeout_s
    from test_gpu_paths import FakeDist
    fake = FakeDist(1, 2, True)
    fake.install(monkeypatch)
    ProcessGrid({"dp": 2}, torch.device("cuda"), timeout_s=120)
    assert nccl_timeout_s(120) == 150 and nccl_timeout_s(8) == 18
    assert fake.new_groups == [(None, datetime.timedelta(seconds=120), "gloo")]
    assert {t for _, t in fake.split_groups} == {datetime.timedelta(seconds=150)}


def test_main_py_on_a_stand_in_nccl_group_reports_where_each_rank_is(tmp_path):
    """2 ranks through main.py (ddp_bucket, parallel.timeout_s 3). From step 3 on, rank
    0's all-reduces never return and never raise (NCCL's host waits on the device; no
    exception ever reaches the training thread), and rank 1 stops before starting its
    next one (tests/nccl_hang_worker.py). Both watchdogs must write their reports and
    print their lines naming rank 1, within the timeout and a few seconds: without them
    nothing is written until NCCL would abort the processes."""
    run_dir = tmp_path / "run"
    cmd = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "tests", "nccl_hang_worker.py"), *TINY, "parallel.dp=ddp_bucket",
           "trainer.max_steps=50", "parallel.timeout_s=3", f"trainer.run_dir={run_dir}"]
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(), stdout=subprocess.DEVNULL, stderr=f)
    try:
        deadline = time.time() + 120
        while True:
            lines = [ln for ln in err.read_text().splitlines() if ln.startswith("hang watchdog on rank")]
            if len({ln[:23] for ln in lines}) == 2:
                break
            assert proc.poll() is None and time.time() < deadline, err.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    print("\n".join(lines))
    reports = {r: json.loads((run_dir / "hang" / f"rank{r}.json").read_text()) for r in (0, 1)}
    print(json.dumps(reports, indent=1))
    assert all(rep["by"] == "watchdog" and rep["step"] == 3 for rep in reports.values())
    assert reports[0]["collectives_started"]["0,1"] == reports[1]["collectives_started"]["0,1"] + 1
    assert all("rank(s) 1 behind (fewer collectives into the group)" in ln for ln in lines), lines
    assert any(ln.startswith("hang watchdog on rank 0") and "waiting in all_reduce" in ln for ln in lines)
