"""The CUDA/NCCL paths a static review found wrong (GPU readiness, round two), each shown
on CPU where the behaviour can be shown here:

- every subgroup of the grid carries parallel.timeout_s (a rank that skips a tp
  collective stops every rank with one line, instead of a 30-minute wait), and on a GPU
  the grid's groups come from one `split_group` per dimension (faked in process);
- step_ms / MFU time the whole step, optimizer included, on the device's clock (a
  stand-in event class, as tests/test_pp.py does for the pipeline's clock);
- a training step reads nothing from the device but the logged values at logged steps;
- ring attention under bf16 autocast is as accurate as PyTorch's SDPA;
- a rank's GPU comes from its launcher, never GPU 0 by default, and asynchronous
  snapshots synchronize the run's device, not whatever CUDA is there.
"""

import os
import re
import sys
import time

import pytest
import torch

from harness import REPO, TINY, job_env, our_frames, run_tree


# ---------------------------------------------------------------- 1. subgroup timeouts

def test_a_rank_skipping_a_tp_collective_stops_every_rank_within_the_timeout(tmp_path):
    """dp2 x tp2 (the tp groups are subgroups of the world): rank 1 does not enter a
    forward all-reduce of its tp group and waits in another collective instead
    (tests/skip_worker.py). Its tp peer waits in the all-reduce, the other tp group in
    the gradient all-reduces of the dp groups: every rank must give up after
    parallel.timeout_s with one line and a non-zero exit. Without the timeout on the
    subgroups they wait 30 minutes (torch's default for new_group)."""
    timeout_s = 4
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           os.path.join(REPO, "tests", "skip_worker.py"), *TINY, "parallel.tp=2",
           "parallel.dp=ddp_bucket", f"parallel.timeout_s={timeout_s}", "trainer.max_steps=2"]
    result = run_tree(cmd, 180, "a job with a skipped tp collective", cwd=tmp_path, env=job_env())
    ended = time.time()
    skipped = re.search(r"^SKIPPED ([0-9.]+)$", result.stdout, re.M)
    assert skipped, result.stdout[-3000:] + result.stderr[-3000:]
    waited = ended - float(skipped.group(1))
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error on rank")]
    print(f"every rank stopped {waited:.1f} s after the skip (timeout {timeout_s} s):\n"
          + "\n".join(lines))
    assert result.returncode != 0
    assert sorted(ln[:15] for ln in lines) == [f"error on rank {r}" for r in range(4)], result.stderr
    assert all("parallel.timeout_s=4 s" in ln or "another rank stopped" in ln for ln in lines), lines
    assert not our_frames(result.stderr), result.stderr[-5000:]  # no traceback of ours
    assert waited <= timeout_s + 30, f"ranks stopped {waited:.0f} s after the skip"


class FakeDist:
    """torch.distributed as ProcessGrid sees it, for rank `rank` of `world`: records
    every group it is asked for."""

    def __init__(self, rank, world, splits):
        self.rank, self.world, self.splits = rank, world, splits
        self.new_groups, self.split_groups = [], []

    def install(self, monkeypatch):
        import parallel.grid as grid
        monkeypatch.setattr(grid.dist, "get_rank", lambda: self.rank)
        monkeypatch.setattr(grid.dist, "get_world_size", lambda: self.world)
        monkeypatch.setattr(grid.dist, "new_group", self.new_group)
        monkeypatch.setattr(grid.dist, "split_group", self.split_group)
        monkeypatch.setattr(grid, "can_split", lambda device: self.splits)

    def new_group(self, ranks=None, timeout=None, backend=None):
        self.new_groups.append((ranks, timeout, backend))
        return ("group", tuple(ranks or range(self.world)))

    def split_group(self, parent_pg=None, split_ranks=None, timeout=None, **kw):
        self.split_groups.append((split_ranks, timeout))
        return next((("split", tuple(line)) for line in split_ranks if self.rank in line), None)


@pytest.mark.parametrize("splits", [False, True], ids=["gloo-new_group", "nccl-split_group"])
def test_every_group_of_the_grid_gets_the_timeout_and_gpus_split_once_per_dimension(
        monkeypatch, splits):
    """Rank 5 of dp2 x pp2 x tp2, in process (torch.distributed faked). gloo: a new_group
    per line of every dimension, each with the timeout. GPU (NCCL bound to the rank's
    device): one split_group per dimension, naming every line, with the timeout: each
    rank creates its own communicators only, not every group of the world's."""
    import datetime
    from parallel.grid import ProcessGrid
    fake = FakeDist(5, 8, splits)
    fake.install(monkeypatch)
    grid = ProcessGrid({"dp": 2, "pp": 2, "tp": 2}, torch.device("cpu"), timeout_s=7)
    timeout = datetime.timedelta(seconds=7)
    assert fake.new_groups[-1] == (None, timeout, "gloo")  # the host group
    lines = {"dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
             "tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "grad": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    if splits:
        # dp, pp, cp (size 1: lines of one rank), tp, then grad_group (dp x cp)
        assert [s for s, _ in fake.split_groups] == [lines["dp"], lines["pp"],
                                                      [[r] for r in range(8)], lines["tp"],
                                                      lines["grad"]]
        assert all(t == timeout for _, t in fake.split_groups)
        assert fake.new_groups == [(None, timeout, "gloo")]
        assert grid.tp_group == ("split", (4, 5)) and grid.dp_group == ("split", (1, 5))
    else:
        made = [(r, t) for r, t, _ in fake.new_groups[:-1]]
        assert made == [(line, timeout) for d in ("dp", "pp") for line in lines[d]] + \
            [([r], timeout) for r in range(8)] + \
            [(line, timeout) for d in ("tp", "grad") for line in lines[d]]
        assert grid.tp_group == ("group", (4, 5)) and grid.pp_group == ("group", (5, 7))
