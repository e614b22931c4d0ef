"""`trainer.snapshot_async`: snapshots written while training goes on, with the
guarantees of the synchronous path (checkpoint/snapshot_writer.py).

A save at step S goes through four phases, each moved on by the scalar all-reduce
the trainer already makes at the end of every step (launch/preemption.agreed_signal),
never by a barrier of its own, and never by a collective from the writer thread:

1. staged (the save step, main thread): every rank copies what it holds into host
   memory (pinned and reused between saves on CUDA), so training may change the
   live tensors (on CUDA the copies are asynchronous: an event recorded after them on
   the run's device is what the writer thread waits for, not the whole device, and
   nothing CUDA is touched when the run is on another device); the main rank empties step S's directory (the only filesystem
   work every part must wait for) and draws the snapshot id. The step's
   all-reduce carries the id and whether that failed.
2. writing (a background thread per rank): its part file and the part's index
   (a small JSON beside it, which the main rank reads to build the manifest).
   Each later step's all-reduce carries "my write of S is done" and "it failed".
3. committing (once every rank reported done): the main rank's writer thread reads
   the indexes and writes manifest.json, then latest.json, the commit point; then
   retention (keep_snapshots: committed, older steps only). In the background too:
   deleting the previous snapshot took 80-280 ms for 650 MiB here
   (bench.snapshot_async), a stall of the main rank's training (and so of every
   rank) on the main thread. Each later all-reduce carries "the commit is done"
   and "it failed". Retention deletes unfinished step directories, so the next
   save may not prepare its own before this phase ends.
4. idle: the next save may start.

At most one save is in flight: a save step that finds one unfinished waits for
it (`drain`, which agrees with blocking collectives: the wait is the point) and
reports the wait in metrics (`snapshot_wait_ms`). The end of training and a
preemption drain the save in flight and then save the step reached
synchronously. A failed write or commit stops every rank with one line; the
commit point never names a snapshot some rank did not finish.
"""

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from checkpoint.snapshot_dirs import fs_and_root, join, remove_stale, step_dir_name
from checkpoint.snapshot_writer import commit, prepare_step_dir, write_part
from data.fs_json import read_json, write_json
from errors import UserError

IDLE, STAGED, WRITING, COMMITTING = "idle", "staged", "writing", "committing"
# positions in the flag vector each rank adds to the step's all-reduce (MAX)
ID, PREP_FAILED, NOT_WRITTEN, WRITE_FAILED, NOT_COMMITTED, COMMIT_FAILED = range(6)
N_FLAGS = 6


def staging_done(device, event_class=None):
    """An event recorded on `device`'s current stream after the staging copies were
    queued (they run asynchronously from pinned memory on CUDA), or None where copies
    are synchronous (CPU): the run's device decides, not whether CUDA happens to be
    there. event_class: a stand-in (tests)."""
    if device.type != "cuda":
        return None
    event = (event_class or torch.cuda.Event)()
    event.record()
    return event


def index_name(rank):
    return f"index-{rank:05d}.json"


class AsyncSnapshots:
    def __init__(self, path, grid, keep):
        self.path, self.grid, self.keep = path, grid, keep
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-writer")
        self.state, self.step, self.meta = IDLE, None, None
        self.staged, self.buffers = None, {}
        self.copied = None  # on CUDA: an event after the staging copies (begin)
        self.snapshot_id, self.write, self.commit, self.error = None, None, None, None
        self.last_wait_ms = 0.0

    # ------------------------------------------------ phase 1, on the save step

    def begin(self, step, pieces, meta):
        """Stage this rank's pieces of `step` and (main rank) prepare its directory."""
        started = time.perf_counter()
        if self.state != IDLE:
            self.drain()
        self.last_wait_ms = 1000 * (time.perf_counter() - started)
        self.staged = [(key, shape, box, self._stage(i, t)) for i, (key, shape, box, t)
                       in enumerate(pieces)]
        self.copied = staging_done(self.grid.device)
        self.step, self.meta, self.error = step, meta, None
        self.snapshot_id = 0
        if self.grid.is_main:
            self.snapshot_id = uuid.uuid4().int >> 66  # 62 bits; not the training's random streams
            try:
                prepare_step_dir(self.path, step)
            except Exception as e:
                self.error = e
        self.state = STAGED

    def _stage(self, i, tensor):
        """A host copy of `tensor`, into a buffer kept for the next save (pinned on CUDA,
        so the copy runs at full bandwidth)."""
        t = tensor.detach()
        buf = self.buffers.get(i)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                              pin_memory=t.device.type == "cuda")
            self.buffers[i] = buf
        buf.copy_(t, non_blocking=t.device.type == "cuda")
        return buf

    # ------------------------------------------------ the flags, in every step's all-reduce

    def flags(self):
        """This rank's contribution to the end-of-step all-reduce (ints, MAX-reduced)."""
        f = [0] * N_FLAGS
        if self.state == STAGED:
            f[ID] = self.snapshot_id
            f[PREP_FAILED] = int(self.error is not None)
        elif self.state == WRITING:
            f[NOT_WRITTEN] = int(not self.write.done())
            f[WRITE_FAILED] = int(self.write.done() and self.write.exception() is not None)
        elif self.state == COMMITTING and self.commit is not None:  # the main rank's
            f[NOT_COMMITTED] = int(not self.commit.done())
            f[COMMIT_FAILED] = int(self.commit.done() and self.commit.exception() is not None)
        return f

    def advance(self, agreed):
        """Move on by what every rank said (the all-reduced flags); raises on a failure."""
        if self.state == STAGED:
            if agreed[PREP_FAILED]:
                self._fail(f"could not prepare snapshot step {self.step}")
            if self.copied is not None:
                self.copied.synchronize()  # the staging copies are complete before the thread reads
                self.copied = None
            self.snapshot_id = f"{agreed[ID]:016x}"
            self.write = self.pool.submit(self._write_own_part)
            self.state = WRITING
        elif self.state == WRITING:
            if agreed[WRITE_FAILED]:
                self._fail(f"could not write snapshot step {self.step}")
            if not agreed[NOT_WRITTEN]:
                self.commit = self.pool.submit(self._commit) if self.grid.is_main else None
                self.state = COMMITTING
        elif self.state == COMMITTING:
            if agreed[COMMIT_FAILED]:
                self._fail(f"could not commit snapshot step {self.step}")
            if not agreed[NOT_COMMITTED]:
                self.state = IDLE

    # ------------------------------------------------ the work

    def _write_own_part(self):
        index = write_part(self.path, self.step, self.grid.rank, self.snapshot_id, self.staged)
        fs, root = fs_and_root(self.path)
        write_json(fs, join(join(root, step_dir_name(self.step)), index_name(self.grid.rank)),
                   index)

    def _commit(self):
        """Main rank, writer thread, once every part is written (raises on failure)."""
        fs, root = fs_and_root(self.path)
        step_dir = join(root, step_dir_name(self.step))
        indexes = [read_json(fs, join(step_dir, index_name(r))) for r in range(self.grid.world_size)]
        commit(self.path, self.step, self.snapshot_id, self.meta, indexes)
        remove_stale(fs, root, self.step, self.keep)  # best effort: never raises

    def _fail(self, what):
        task = self.commit if self.state == COMMITTING else self.write
        own = self.error or (task.exception() if task is not None and task.done() else None)
        self.state = IDLE
        detail = f": {type(own).__name__}: {own}" if own else " (on another rank: see its error)"
        raise UserError(f"{what} at {self.path}{detail}; the previous snapshot stays the one to "
                        "resume from")

    # ------------------------------------------------ waiting for the save in flight

    def drain(self):
        """Finish the save in flight, agreeing with blocking all-reduces (every rank calls
        it at the same step: a save step, the end of training, a preemption)."""
        while self.state != IDLE:
            task = {WRITING: self.write, COMMITTING: self.commit}.get(self.state)
            if task is not None:
                try:
                    task.result()
                except Exception:
                    pass  # reported through the flags: every rank raises together
            self.advance(self.grid_all_reduce(self.flags()))

    def grid_all_reduce(self, values):
        return self.grid.max_over_ranks(values)

    def close(self):
        self.pool.shutdown(wait=True)
