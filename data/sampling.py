"""Which windows each optimizer step reads, as a function of the step alone, and what
a snapshot records about that order (so a resumed run reads what an uninterrupted
one would, under any layout).

A sample is the window starting at token i. Each epoch is a pseudo-random
permutation of all windows keyed by (seed, epoch) (data/permutation.py),
optimizer step s reads positions [s*B, (s+1)*B) of that stream, and
data-parallel rank r takes its contiguous 1/dp of them. `randperm` is the
order before the permutation existed, kept to finish snapshots written with it.
"""

import numpy as np
import torch

from data.permutation import Permutation
from errors import UserError

# what a snapshot records about its data order; snapshots without it used randperm
SAMPLERS = {"feistel": 1, "randperm": 1}  # sampler -> version of its order
LEGACY_ORDER = {"sampler": "randperm", "version": SAMPLERS["randperm"]}


def data_order(cfg) -> dict:
    return {"sampler": cfg.sampler, "version": SAMPLERS[cfg.sampler]}


def data_identity(train_set) -> dict:
    """What a snapshot records of its train split: the number of windows and, for
    prepared tokens, their fingerprint (a copy of the corpus elsewhere has the same)."""
    return {"train_windows": len(train_set), "corpus": getattr(train_set, "fingerprint", None)}


def describe_data(identity: dict) -> str:
    kind = f"prepared tokens {identity['corpus'][:12]}" if identity.get("corpus") else "text"
    return f"{kind} ({identity.get('train_windows')} train windows)"


class GlobalBatches:
    """Which windows each optimizer step reads, as a function of the step alone."""

    def __init__(self, n_samples, global_batch, seed, sampler="feistel"):
        if n_samples < global_batch:
            raise UserError(f"the train split has {n_samples} samples, fewer than one "
                            f"global batch of {global_batch}")
        self.n, self.batch_size, self.seed, self.sampler = n_samples, global_batch, seed, sampler
        self.steps_per_epoch = n_samples // global_batch  # the ragged tail is dropped
        self._epoch, self._order = None, None

    def indices(self, step, start=0, stop=None):
        """Window starts at positions [start, stop) (default: all) of the global batch of
        0-based optimizer step `step`: O(stop - start) time and memory."""
        stop = self.batch_size if stop is None else stop
        epoch, pos = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, self._epoch_order(epoch)
        first = pos * self.batch_size
        if self.sampler == "randperm":
            return self._order[first + start:first + stop]
        return torch.from_numpy(self._order(np.arange(first + start, first + stop)))

    def _epoch_order(self, epoch):
        if self.sampler == "randperm":  # the old order: all n windows, O(n) per epoch
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            return torch.randperm(self.n, generator=g)
        return Permutation(self.n, self.seed, epoch)

    def local_micro_batches(self, dataset, step, dp_rank, dp_size, grad_accum):
        """This dp rank's share of step `step` (contiguous positions, only those computed
        and read), as grad_accum (x, y) micro-batches."""
        share = self.batch_size // dp_size
        mine = self.indices(step, dp_rank * share, (dp_rank + 1) * share)
        return [dataset.batch(part) for part in mine.view(grad_accum, -1)]


def eval_starts(n_samples, global_batch, n_batches):
    """Fixed, evenly spaced val windows: the same ones at every eval and layout (a val
    split smaller than the batches repeats windows rather than fail). Window i of the
    `total` starts at floor(i * (n_samples - 1) / (total - 1)), in integers: float32 (a
    torch.linspace) holds every integer only up to 2^24, and past that rounds starts,
    the last one past the end of the split."""
    total = global_batch * n_batches
    i = torch.arange(total, dtype=torch.int64)
    return (i * (n_samples - 1) // max(total - 1, 1)).view(n_batches, global_batch)
