"""Preemption: on SIGTERM or SIGUSR1, finish the step, snapshot it, exit 75.

Clusters stop jobs with a signal a grace period before they kill them: Slurm
sends SIGTERM (or the `--signal` one, often SIGUSR1), Kubernetes SIGTERM, and
torchrun forwards the signal it gets to every worker. So each worker:

1. `install()`: handlers for SIGTERM and SIGUSR1 that only note the signal
   (and restart interrupted system calls, so a collective in flight is not
   disturbed); the step in progress runs to its end.
2. `EndOfStep.after_step` at the end of every step: one all-reduce (MAX) over all
   ranks, so a rank that got no signal learns that another did and every rank stops
   after the same step. Not training traffic: it does not go through the strategies'
   counters (parallel/comm.py). (It carries more flags: whether a rank failed to read
   the next step's data, and how far a background snapshot got.)
3. It writes the snapshot of that step (unless the step just did) and raises
   `Preempted`; main.py closes metrics and wandb on the way out, the main rank
   prints one line, and every rank exits with EXIT_STATUS. The main rank also
   writes MARKER in the run directory (the next run of it removes it): torchrun
   reports any worker's non-zero exit as its own 1, so a job script tells
   "preempted, resumable" from a crash by this file (scripts/slurm_train.sbatch).

EXIT_STATUS is 75 (EX_TEMPFAIL in sysexits.h: "temporary failure, retry"):
distinct from 0 (finished), 1 (a crash), 2 (bad input, errors.UserError) and
130 (Ctrl-C). Run the same command again and it resumes from that snapshot
with the losses of an uninterrupted run. What torchrun and Slurm report
around it is in docs/checkpointing.md and docs/clusters.md.
"""

import os
import signal

from errors import UserError

EXIT_STATUS = 75
MARKER = "preempted"  # in trainer.run_dir: this run stopped on a signal, with a snapshot
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_received = 0  # the signal number noted by the handler, 0 if none


class Preempted(Exception):
    """Raised at the end of the stopping step, once its snapshot is written."""


def _note(signum, frame):
    global _received
    _received = max(_received, signum)


def install():
    """Take SIGTERM and SIGUSR1 from their default action (die at once)."""
    for sig in SIGNALS:
        signal.signal(sig, _note)
        signal.siginterrupt(sig, False)


def received() -> int:
    """The signal this process got (0 if none): no communication."""
    return _received


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class EndOfStep:
    """The one all-reduce (MAX) that ends every step but the last, over every rank
    (grid.max_over_ranks: host integers, uncounted): a stop signal, a damaged read of the
    next step's batches (training/batches.py), a background snapshot's progress
    (checkpoint/async_snapshot.py)."""

    def __init__(self, grid, snapshots, save, tcfg, snapshot_path):
        """save(): the trainer's snapshot of the step reached (collective)."""
        self.grid, self.snapshots, self.save = grid, snapshots, save
        self.t, self.path = tcfg, snapshot_path

    def after_step(self, step, saved, read_error):
        """saved: this step wrote its snapshot; read_error: this rank's, or None."""
        signum, failed, *progress = self.grid.max_over_ranks(
            [_received, int(read_error is not None), *self.snapshots.flags()])
        self.snapshots.advance(progress)  # raises on a failed write
        if signum:  # a stop signal: snapshot this step (the next one's data waits)
            self._stop(signum, step, saved)
        if failed:  # one rank's windows are damaged: all stop before any collective
            raise read_error or UserError("stopping: another rank failed while reading the "
                                          "data (see its error)")

    def _stop(self, signum, step, saved):
        """Every rank is here after the same step: snapshot it, so nothing trained is lost,
        and leave with EXIT_STATUS."""
        self.snapshots.drain()  # this step's save (if it was one) is committed now
        if not saved:
            self.save()
        message = (f"preempted: {signal_name(signum)} received, stopped after step {step} of "
                   f"{self.t.max_steps} and wrote its snapshot to {self.path}; run the same "
                   f"command to resume (exit status {EXIT_STATUS})")
        if self.grid.is_main:
            with open(os.path.join(self.t.run_dir, MARKER), "w") as f:
                f.write(message + "\n")
        raise Preempted(message)
