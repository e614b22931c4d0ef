"""Preemption and Ctrl-C: on SIGTERM or SIGUSR1 finish the step, snapshot it, exit 75;
on a first SIGINT (Ctrl-C) the same with exit 130, on a second stop at once.

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

Ctrl-C (SIGINT) while the steps run is the same stop, a user's: the step finishes,
its snapshot is written, the main rank prints one line (the step, the step the next
run resumes from), every rank exits INTERRUPTED (130), and no MARKER is left (a
job script must not requeue a run its user stopped). Any stop signal after it (a
second Ctrl-C) stops at once: the main rank's line says which snapshot the next run
resumes from. Outside the steps (setup, the final sample) SIGINT is Python's
KeyboardInterrupt: at once. Under torchrun only the launcher gets the terminal's
Ctrl-C (its workers run in sessions of their own): torch 2.13's forwards the first
to every worker, turns a second into SIGTERM to them (its shutdown starts again) and
on a third exits without a word to them. So each worker also asks the kernel for a
SIGINT when its launcher dies (PR_SET_PDEATHSIG): a launcher gone (a third Ctrl-C,
kill -9) stops its workers, after the step or at once, instead of leaving them
training unwatched.
"""

import ctypes
import os
import signal
import sys
from contextlib import contextmanager

from errors import UserError
from launch.exit import flush_and_exit

EXIT_STATUS = 75
INTERRUPTED = 130  # Ctrl-C, as a shell reports a process that died of SIGINT
MARKER = "preempted"  # in trainer.run_dir: this run stopped on a signal, with a snapshot
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_received = 0  # the signal number noted by the handler, 0 if none
_interrupted = False  # a SIGINT came while the steps ran: the next stop signal is at once
_steps = None  # while the steps run: the trainer's progress() (stepping)
_parent = None  # under torchrun: the launcher's pid when install() ran


class Preempted(Exception):
    """Raised at the end of the stopping step, once its snapshot is written."""
    status = EXIT_STATUS


class Interrupted(Preempted):
    """The same, for Ctrl-C: the user's stop, not the cluster's."""
    status = INTERRUPTED


def _note(signum, frame):
    """SIGTERM, SIGUSR1, SIGINT: noted (the step ends with a snapshot); after a Ctrl-C
    while the steps run, at once; SIGINT outside the steps: KeyboardInterrupt."""
    global _received, _interrupted
    if signum == signal.SIGINT and _steps is None:
        raise KeyboardInterrupt
    if _interrupted and _steps is not None:
        _stop_at_once()
    _interrupted = _interrupted or signum == signal.SIGINT
    _received = max(_received, signum)


def _stop_at_once():
    step, max_steps, resumes_from, is_main = _steps()
    if is_main:
        resume = (f"the same command resumes from step {resumes_from}, the last snapshot"
                  if resumes_from else "the same command starts over (no snapshot yet)")
        sys.stdout.flush()
        os.write(1, (f"interrupted again: stopped at once in step {step + 1} of {max_steps}, "
                     f"which is lost; {resume} (exit status {INTERRUPTED})\n").encode())
    flush_and_exit(INTERRUPTED)


def install():
    """Take SIGTERM and SIGUSR1 from their default action (die at once), and SIGINT from
    Python's (KeyboardInterrupt wherever it lands); under torchrun, a SIGINT when the
    launcher dies."""
    global _received, _interrupted, _parent
    _received, _interrupted = 0, False  # a process may run more jobs (tests/job_server.py)
    for sig in SIGNALS + (signal.SIGINT,):
        signal.signal(sig, _note)
        signal.siginterrupt(sig, False)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _parent = os.getppid()
        interrupt_when_parent_dies()


def interrupt_reason():
    """What this process's SIGINT was, for the line that says it stopped."""
    gone = _parent is not None and os.getppid() != _parent
    return "its launcher (torchrun) is gone" if gone else "Ctrl-C (SIGINT) received"


def interrupt_when_parent_dies():
    """PR_SET_PDEATHSIG: SIGINT to this process when its parent (torchrun) dies, unless
    a death signal is set already (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        current = ctypes.c_int(0)
        prctl(2, ctypes.byref(current))  # PR_GET_PDEATHSIG
        if current.value == 0:
            prctl(1, int(signal.SIGINT))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@contextmanager
def stepping(progress):
    """While the steps run: SIGINT stops after the step (a second: at once). progress():
    (steps done, trainer.max_steps, the step a new run would resume from or 0, whether
    this is the main rank)."""
    global _steps
    _steps = progress
    try:
        yield
    finally:
        _steps = None


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
        if signum == signal.SIGINT:  # the user's Ctrl-C: nothing for a job script to requeue
            raise Interrupted(
                f"interrupted: {interrupt_reason()}, stopped after step {step} of "
                f"{self.t.max_steps} and wrote its snapshot to {self.path}; the same command "
                f"resumes from step {step} (exit status {INTERRUPTED})")
        message = (f"preempted: {signal_name(signum)} received, stopped after step {step} of "
                   f"{self.t.max_steps} and wrote its snapshot to {self.path}; run the same "
                   f"command to resume (exit status {EXIT_STATUS})")
        if self.grid.is_main:
            with open(os.path.join(self.t.run_dir, MARKER), "w") as f:
                f.write(message + "\n")
        raise Preempted(message)
