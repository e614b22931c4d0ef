"""Test-only: main.py on gloo with collectives that hang as NCCL's do, raising nothing.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/nccl_hang_worker.py \
        parallel.timeout_s=3 ...

From step 3 on, rank 0's counted all-reduces never return and never raise (on NCCL the
host waits on the device, and only NCCL's own watchdog ends the process: no timeout reaches
the training thread), and rank 1 stops before starting its next one (a rank that hung
elsewhere). Only the hang watchdog can then report where each rank is
(tests/test_hang_watchdog.py). Everything else is main.run_and_exit, unchanged.
"""

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import main  # noqa: E402
from parallel import comm  # noqa: E402

STUCK_STEP = 3
RANK = int(os.environ.get("RANK", 0))
real_all_reduce = comm.CommCounter.all_reduce
never = threading.Event()  # nothing sets it


def all_reduce(self, tensor, group=None, op=comm.dist.ReduceOp.SUM, async_op=False):
    if self.where.get("step", 0) >= STUCK_STEP and threading.get_ident() == self.thread:
        if RANK == 1:
            never.wait()  # stopped before this collective: it is never counted
        self.record("all_reduce", tensor)
        with self.blocked(self._started("all_reduce", group)):
            never.wait()  # NCCL: the host never hears back, and nothing raises
    return real_all_reduce(self, tensor, group=group, op=op, async_op=async_op)


comm.CommCounter.all_reduce = all_reduce

if __name__ == "__main__":
    sys.argv = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "main.py")] + sys.argv[1:]
    main.run_and_exit()
