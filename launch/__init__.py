"""How a training process stops and leaves.

    preemption.py  SIGTERM / SIGUSR1: every rank stops after the same step, with a snapshot
    devices.py     this rank's device: its GPU from LOCAL_RANK (or Slurm's, Open MPI's), else CPU
    exit.py        flush, then os._exit: past torch's teardown, which can abort after a
                   finished job
    process_tree.py  kill a torchrun launch and every rank below it (tests, benchmarks)
    hang_report.py a collective that gave up: each rank's report of where it waited, and
                   one line naming the ranks behind

May import: nothing of the project but errors (and devices.py: parallel.grid's uses_cuda).
"""
