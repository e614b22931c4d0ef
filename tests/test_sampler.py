"""The sample order (data/permutation.py, data/sampling.GlobalBatches), in process: a
permutation of every window per epoch, O(batch) per step whatever the corpus size,
random-looking, and the old randperm order still reproducible for old snapshots."""

import os
import time

import numpy as np
import pytest
import torch

from char_dataset import GlobalBatches
from config import load_config
from errors import UserError
from harness import REPO
from data.permutation import Permutation
from checkpoint.snapshot_reader import open_snapshot
from checkpoint.resume import check_resumable


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 65, 1000, 4097])
def test_every_window_once_per_epoch(n):
    for epoch in (0, 1):
        order = Permutation(n, seed=7, epoch=epoch)(np.arange(n))
        assert np.array_equal(np.sort(order), np.arange(n)), order[:20]


def test_a_step_costs_its_batch_not_the_corpus():
    """10**12 windows: a permutation array would need 8 TB; a step reads 8 entries."""
    batches = GlobalBatches(n_samples=10**12, global_batch=8, seed=1)
    started = time.perf_counter()
    starts = batches.indices(10**9)
    assert time.perf_counter() - started < 1.0
    assert starts.shape == (8,) and len(set(starts.tolist())) == 8
    assert 0 <= int(starts.min()) and int(starts.max()) < 10**12
    # a dp rank's share is computed alone, and equals its slice of the whole batch
    assert torch.equal(batches.indices(10**9, 2, 4), starts[2:4])


def test_order_looks_random_and_depends_on_seed_and_epoch():
    n = 10_000
    order = Permutation(n, seed=3, epoch=0)(np.arange(n))
    # a random permutation moves an entry n/3 on average; neighbours are uncorrelated
    assert 0.30 < np.abs(order - np.arange(n)).mean() / n < 0.37
    assert abs(np.corrcoef(order[:-1], order[1:])[0, 1]) < 0.05
    first = [Permutation(n, seed=3, epoch=e)(np.arange(8)).tolist() for e in range(3)]
    assert first[0] != first[1] and first[1] != first[2] and first[0] != first[2]
    assert Permutation(n, seed=4, epoch=0)(np.arange(8)).tolist() != first[0]
    # position 0 over many epochs: roughly uniform over 10 windows
    hits = np.bincount([Permutation(10, 5, e)(np.array([0]))[0] for e in range(3000)], minlength=10)
    assert hits.min() > 220 and hits.max() < 380, hits


def test_randperm_is_the_order_snapshots_were_written_with_before():
    """data.sampler=randperm reproduces the old order exactly (tests/data/snapshot-v2
    was trained with it), so an old run can finish with the data it started with."""
    batches = GlobalBatches(n_samples=100, global_batch=12, seed=3, sampler="randperm")
    old = torch.randperm(100, generator=torch.Generator().manual_seed(3 * 1_000_003 + 1))
    assert torch.equal(batches.indices(batches.steps_per_epoch + 2), old[24:36])


def test_snapshot_of_the_old_order_is_refused_without_randperm():
    snapshot = os.path.join(REPO, "tests", "data", "snapshot-v2")
    meta = open_snapshot(snapshot).meta
    fixture = ["model.n_layer=2", "model.n_head=2", "model.n_embd=16", "data.block_size=16",
               "trainer.batch_size=12"]
    with pytest.raises(UserError, match="data.sampler=randperm") as e:
        check_resumable(snapshot, meta, load_config(fixture, 1), {})
    assert "silently change" in str(e.value) and "\n" not in str(e.value)
    check_resumable(snapshot, meta, load_config(fixture + ["data.sampler=randperm"], 1), {})
