"""Test-only: main.py, except that one rank skips one tensor-parallel collective.

    python -m torch.distributed.run --standalone --nproc_per_node=4 tests/skip_worker.py \
        parallel.tp=2 parallel.timeout_s=4 ...

Global rank 1 (tp rank 1 of the first tp group, a subgroup of the world) does not enter
the forward all-reduce of its first row-parallel layer: it prints `SKIPPED <unix time>`
and waits in another collective instead (one on the grid's host group, which no other
rank enters then), as a rank that took another code path would. Its tp peer then waits
in the skipped all-reduce, and the other tp group in the data-parallel gradient
all-reduces it shares with them: every rank must stop with one line within
parallel.timeout_s, never hang (tests/test_gpu_paths.py). (A rank that skipped and went
on into the group's next collective would not wait: gloo aborts on the mismatched
sizes at once.) Everything else is main.run_and_exit, unchanged.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import main  # noqa: E402
from parallel.tensor_parallel import ops  # noqa: E402

grids = []


class RecordedGrid(main.ProcessGrid):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        grids.append(self)


if int(os.environ.get("RANK", 0)) == 1:
    main.ProcessGrid = RecordedGrid

    def forward(ctx, x, tp):
        print(f"SKIPPED {time.time():.3f}", flush=True)
        dist.all_reduce(torch.zeros(1), group=grids[0].host_group)  # no other rank comes
        raise AssertionError("unreachable: nobody joins that all-reduce")

    ops._ReduceFromTP.forward = staticmethod(forward)

if __name__ == "__main__":
    sys.argv = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "main.py")] + sys.argv[1:]
    main.run_and_exit()
