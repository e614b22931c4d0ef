"""Preemption: on SIGTERM or SIGUSR1, finish the step, snapshot it, exit 75.

Clusters stop jobs with a signal a grace period before they kill them: Slurm
sends SIGTERM (or the `--signal` one, often SIGUSR1), Kubernetes SIGTERM, and
torchrun forwards the signal it gets to every worker. So each worker:

1. `install()`: handlers for SIGTERM and SIGUSR1 that only note the signal
   (and restart interrupted system calls, so a collective in flight is not
   disturbed); the step in progress runs to its end.
2. `agreed_signal(device)` at the end of every step: one all-reduce (MAX) of a
   scalar over all ranks, so a rank that got no signal learns that another did
   and every rank stops after the same step. Not training traffic: it does not
   go through the strategies' counters (parallel/comm.py). (It carries a
   second flag: whether a rank failed to read the next step's data.)
3. The trainer writes the snapshot of that step (unless it just did) and raises
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

import signal

EXIT_STATUS = 75
MARKER = "preempted"  # in trainer.run_dir: this run stopped on a signal, with a snapshot
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_received = 0  # the signal number noted by the handler, 0 if none


class Preempted(Exception):
    """Raised by the trainer after the snapshot of the stopping step is written."""


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


def agreed_signal(grid, failed=False, extra=()):
    """Collective over every rank of `grid`: (the largest signal number any rank got, 0 if
    none; whether any rank passed failed=True; the MAX over ranks of each of `extra`). The
    trainer has the ranks agree on a damaged read of the next step's data, and the
    progress of an asynchronous snapshot (ints), in this same all-reduce
    (`grid.max_over_ranks`: device-checked, uncounted)."""
    values = grid.max_over_ranks([_received, int(failed), *extra])
    return int(values[0]), bool(values[1]), values[2:]


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
