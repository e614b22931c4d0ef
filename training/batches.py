"""This rank's micro-batches of each step, read where a failure strands no rank.

A damaged shard shows on one rank only, so every rank agrees on a read's error before the
next collective. The shares a step is expected to hold (the plain run's whole batch, a
replica group's shares of the step before) are read at the end of the step before and
agreed in its one all-reduce (launch/preemption.EndOfStep); shares the step's quorum
deals otherwise (a group joined or left) are read at the step, then agreed (one all_ok).
"""

import time

from errors import UserError
from fault_tolerance.shares import share_micro_batches
from parallel.grid import together

READING = "reading the data"


class StepBatches:
    def __init__(self, batches, dataset, grid, grad_accum):
        """batches: the run's char_dataset.GlobalBatches over `dataset`."""
        self.batches, self.dataset, self.grid, self.grad_accum = batches, dataset, grid, grad_accum
        self.ahead = None  # (step, shares, micro-batches, ms) read at the end of the step before

    def take(self, step, shares, replicas):
        """(micro-batches of `step` for this rank, ms reading them): those of `shares` of
        the `replicas` shares of its batch (fault_tolerance/shares.py), read ahead or now."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[:2] == (step, list(shares)):
            return ahead[2:]
        return together(self.grid, READING, lambda: self._read(step, shares, replicas))

    def read_ahead(self, step, shares, replicas):
        """Reads them now if `shares` is known (not None); returns this rank's error or None."""
        try:
            if shares is not None:
                self.ahead = (step, list(shares), *self._read(step, shares, replicas))
        except UserError as e:
            return e
        except Exception as e:  # s3 errors, a vanished file, ...
            return UserError(f"{READING} failed: {type(e).__name__}: {e}")

    def _read(self, step, shares, replicas):
        started, g = time.perf_counter(), self.grid
        micro = share_micro_batches(self.batches, self.dataset, step, shares, replicas,
                                    g.data_rank, g.data_size, self.grad_accum)
        return micro, 1000 * (time.perf_counter() - started)
