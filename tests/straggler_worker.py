"""Test-only: main.py's run under torchrun with one rank slowed on purpose.

    python -m torch.distributed.run --standalone --nproc_per_node=W tests/straggler_worker.py \
        SLOW_RANK DELAY_MS key=value ...

Rank SLOW_RANK sleeps DELAY_MS in every transformer block's forward (a slower device, or a
busier host); then main.run with the given overrides, as `python main.py` would.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import main  # noqa: E402
import model  # noqa: E402

if __name__ == "__main__":
    slow, delay_ms, overrides = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    rank = int(os.environ["RANK"])
    if rank == slow:
        forward = model.Block.forward

        def slowed(self, x):
            time.sleep(delay_ms / 1000)
            return forward(self, x)
        model.Block.forward = slowed
    sys.exit(main.run(overrides, rank, int(os.environ["WORLD_SIZE"]),
                      int(os.environ.get("LOCAL_RANK", 0))))
