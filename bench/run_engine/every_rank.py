"""main.py with every rank's collective counters written down: what a `Variant(every_rank=True)`
job runs in main.py's place (jobs.run_job), under the same torchrun and the same arguments.

metrics.jsonl holds rank 0's counters only (parallel/comm.py's, popped once a step by the
trainer), and some traffic differs between ranks: expert parallelism's all-to-all, where a
rank hands back as many rows as the routing sent it. Here each pop of a CommCounter is also
appended as one JSON line to `comm_rank<RANK>.jsonl` in the working directory (the job's run
directory), and jobs.py sums the ranks' lines step by step. Nothing else changes: no
collective is added, and a line a step costs microseconds beside a step of milliseconds.
"""

import json
import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = os.path.join(REPO, "main.py")


def count_every_pop(path):
    """Wrap CommCounter.pop so that each pop's figures are also appended to `path`."""
    from parallel import comm
    pop = comm.CommCounter.pop

    def pop_and_write(self):
        out = pop(self)
        with open(path, "a") as f:
            f.write(json.dumps(out) + "\n")
        return out

    comm.CommCounter.pop = pop_and_write


if __name__ == "__main__":
    sys.path[0] = REPO  # as `python main.py` would have it
    count_every_pop(os.path.join(os.getcwd(), f"comm_rank{os.environ.get('RANK', '0')}.jsonl"))
    sys.argv = [MAIN] + sys.argv[1:]
    runpy.run_path(MAIN, run_name="__main__")
