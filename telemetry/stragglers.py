"""Which rank the others wait for, at the steps the trainer logs (issue 45's stragglers).

Every step ends in collectives, so every rank's step takes as long as the slowest rank's:
step times do not tell them apart. What does is how long each rank was *not* waiting: its
step time less the time its training thread was blocked in collectives (parallel/comm.py's
CommCounter times each synchronous call and each wait on an asynchronous one). A rank that
is slow (a slower GPU, a busier CPU, a slow disk under its data) waits little, and the
others wait for it. At a logged step every rank hands in its figure (one all-gather of a
float over the host group: nothing at the steps that are not logged) and the record gets:

    straggler_rank      the rank with the most busy time
    straggler_busy_ms   its busy time: step time less its waits
    busy_spread         its busy time over the median rank's (1.0: evenly loaded)

On a GPU with NCCL a collective's wait happens on the device, not in the host thread (the
host returns at once and the compute stream waits): there both figures are the device's,
the step time from CUDA events at its start and after the optimizer, the waits from two
events around each wait on the stream the training thread works on (parallel/comm.py), so
a slow GPU is named as on CPU. They are read at logged steps only.
"""

from statistics import median


def straggler_figures(grid, step_ms, waited_ms) -> dict:
    """The record's fields for this rank's step time and time blocked in collectives
    (collective over the host group: every rank calls it at the same steps)."""
    if grid.world_size == 1:
        return {}
    busy = [row[0] for row in grid.gather_over_ranks([max(step_ms - waited_ms, 0.0)])]
    slowest = max(range(len(busy)), key=busy.__getitem__)
    middle = median(busy)
    return {"straggler_rank": slowest, "straggler_busy_ms": busy[slowest],
            "busy_spread": busy[slowest] / middle if middle > 0 else 1.0}
