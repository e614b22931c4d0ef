"""Stragglers are visible (telemetry/stragglers.py): at every logged step the rank the
others wait for, its busy time (step time less its waits in collectives) and the spread
over the median rank, in metrics.jsonl; nothing at the steps that are not logged.

Through main.py on 3 ranks (tests/straggler_worker.py) with rank 2 sleeping in every
block's forward, under ddp_bucket (waits in the bucket all-reduces) and fsdp ZeRO-3
(waits in every block's all-gather): rank 2 is named at every logged step, and its busy
time is well above the others'.
"""

import os

import pytest
import torch

from harness import REPO, TINY, job_env, python, read_metrics, run_tree


@pytest.mark.parametrize("layout", [pytest.param(["parallel.dp=ddp_bucket"], marks=pytest.mark.long),
                                    ["parallel.dp=fsdp", "parallel.zero_stage=3"]],
                         ids=["ddp_bucket", "fsdp3"])
def test_a_rank_slowed_on_purpose_is_named(tmp_path, layout):
    cmd = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           os.path.join(REPO, "tests", "straggler_worker.py"), "2", "40"] + TINY + layout + [
        "trainer.max_steps=6", "trainer.log_every=2", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.batch_size=12"]
    result = run_tree(cmd, 240, "straggler job", cwd=tmp_path, env=job_env(forked=False))
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    print([(r["step"], r["straggler_rank"], round(r["busy_spread"], 2)) for r in records])
    assert [r["step"] for r in records] == [2, 4, 6]
    assert all(r["straggler_rank"] == 2 for r in records), records
    # two blocks x 40 ms a micro-batch: the others wait about that long for rank 2
    assert all(r["straggler_busy_ms"] >= 60 and r["busy_spread"] > 1.5 for r in records), records


def timeline():
    """A stand-in CUDA event class with a device clock of its own (`now`, ms), moved on
    by the work the test says each call queues; the host returns from every call at once.
    Counts the host's synchronize calls."""
    class Event:
        now, syncs = 0.0, 0

        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = Event.now

        def synchronize(self):
            Event.syncs += 1

        def elapsed_time(self, other):
            return other.at - self.at
    return Event


@pytest.mark.parametrize("slow", [0, 2])
def test_on_a_gpu_the_busy_time_is_timed_on_the_device(monkeypatch, slow):
    """NCCL returns to the host at once and makes the compute stream wait, so host clocks
    see no wait and every rank's busy time is its whole step (busy_spread 1.0, the rank
    named arbitrary). Three ranks on stand-in CUDA events: rank `slow`'s compute takes 30
    ms, the others' 10; each all-reduce makes the device wait for the slowest rank plus 2
    ms of transfer, none of it on the host. The device's step time less its waits names
    rank `slow`, 30 ms busy, spread 3.0; a step that reports nothing synchronizes no
    event. Red when the waits are the host's (spread 1.0, rank 0 named), or when every
    step's events are read."""
    from types import SimpleNamespace
    from parallel import comm as comm_module
    from parallel.comm import CommCounter
    from parallel.pipeline_parallel.clock import DeviceClock
    from telemetry.stragglers import straggler_figures
    compute = {r: 30.0 if r == slow else 10.0 for r in range(3)}
    monkeypatch.setattr(comm_module.dist, "get_world_size", lambda group=None: 3)
    busy = {}
    for rank in range(3):
        Event = timeline()

        def all_reduce(*a, rank=rank, Event=Event, **k):  # queued: the stream waits
            Event.now += max(compute.values()) - compute[rank] + 2.0
        monkeypatch.setattr(comm_module.dist, "all_reduce", all_reduce)
        comm, clock = CommCounter(torch.device("cpu"), event_class=Event), DeviceClock(None, Event)
        for step, measured in ((1, False), (2, True)):
            started = clock.mark()
            Event.now += compute[rank]  # forward and backward, queued
            comm.all_reduce(torch.zeros(4))
            ended = clock.mark()
            syncs = Event.syncs
            waited_ms = 1000 * comm.take_waited_s(read=measured)
            if not measured:
                assert Event.syncs == syncs, "an unreported step synchronized the device"
        step_ms = 1000 * clock.seconds(started, [ended])[0]
        assert step_ms == pytest.approx(32.0)  # every rank's step: the slowest's and the transfer
        busy[rank] = step_ms - waited_ms
    grid = SimpleNamespace(world_size=3, gather_over_ranks=lambda row: [[busy[r]] for r in range(3)])
    figures = straggler_figures(grid, 32.0, 32.0 - busy[0])
    print(busy, figures)
    assert figures["straggler_rank"] == slow
    assert figures["straggler_busy_ms"] == pytest.approx(30.0)
    assert figures["busy_spread"] == pytest.approx(3.0)
