"""metrics.tensorboard=true: metrics.jsonl's scalars as TensorBoard event files in
<run_dir>/tensorboard/ (`tensorboard --logdir runs/default/tensorboard`), written by the
main rank beside metrics.jsonl.

A resumed run writes again the steps past its snapshot, which the previous run may have
logged. Each run start opens a new event file that begins with a restart at the first
step it will write (SummaryWriter's purge_step): TensorBoard drops every older event from
that step on, as metrics.jsonl drops its records. TensorBoard reads a directory's files in
the order of their names, which begin with the second they were created: a run started
in the same second as the newest file waits for the next, so its file sorts after it."""

import glob
import os
import time

from errors import missing_package


def check(cfg):
    """Before anything starts: the package, or one line naming it."""
    if cfg.mode == "train" and cfg.metrics.tensorboard:
        try:
            import tensorboard  # noqa: F401  (an optional package: requirements-dev.txt)
        except ImportError:
            raise missing_package("metrics.tensorboard=true", "tensorboard") from None


def created_second(path):
    """The creation second in an event file's name (events.out.tfevents.<s>.<host>...)."""
    try:
        return int(os.path.basename(path).split(".")[3])
    except (IndexError, ValueError):
        return 0


class TensorBoardLog:
    def __init__(self, run_dir, first_step):
        """first_step: the first step this run writes; events of it and later ones that an
        earlier run wrote are purged."""
        from torch.utils.tensorboard import SummaryWriter
        where = os.path.join(run_dir, "tensorboard")
        newest = max(map(created_second, glob.glob(os.path.join(where, "events.out.tfevents.*"))),
                     default=0)
        if time.time() < newest + 1:
            time.sleep(newest + 1 - time.time())
        self.writer = SummaryWriter(where, purge_step=first_step)

    def write(self, record):
        """Every number of the record at its step; flushed, so that a killed run keeps it."""
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()

    def close(self):
        self.writer.close()
