"""`trainer.snapshot_async`: snapshots written while training goes on, with the
guarantees of the synchronous path (checkpoint/snapshot_writer.py).

A save at step S goes through four phases, each moved on by the scalar all-reduce
the trainer already makes at the end of every step (launch/preemption.EndOfStep),
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

What the writer thread reads is fixed when its save begins: a `Save` (frozen:
step, path, rank and world, keep, a copy of the manifest's facts, the staged
pieces, and once agreed the snapshot id) is handed to `write_own_part` and
`commit_save` as their argument. They read nothing of AsyncSnapshots, whose fields
the main thread changes (the next begin, a failure): a write still running when
its save failed on another rank goes on writing its own step, and the next save
stages into buffers of its own. No error of the thread is dropped: a failed write
or commit reaches every rank through the flags; one the run could not agree on
any more (it stopped for another reason with a save in flight) is the line
`close` returns, which the trainer prints on the way out.
"""

import copy
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch

from checkpoint.snapshot_dirs import fs_and_root, join, remove_stale, step_dir_name
from checkpoint.snapshot_writer import commit, prepare_step_dir, save_sharded, write_part
from data.fs_json import read_json, write_json
from errors import UserError

IDLE, STAGED, WRITING, COMMITTING = "idle", "staged", "writing", "committing"
# positions in the flag vector each rank adds to the step's all-reduce (MAX)
ID, PREP_FAILED, NOT_WRITTEN, WRITE_FAILED, NOT_COMMITTED, COMMIT_FAILED = range(6)
N_FLAGS = 6
KEEP_NOTE = "the previous snapshot stays the one to resume from"


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


@dataclass(frozen=True)
class Save:
    """One save, as its background write and commit see it: fixed at begin (the id once
    every rank agreed on it), whatever the main thread does afterwards."""
    path: str
    step: int
    rank: int
    world_size: int
    keep: int
    meta: MappingProxyType  # a deep copy of the manifest's facts
    staged: tuple  # ((key, full shape, box, host tensor), ...): this save's own buffers
    snapshot_id: str = ""


def write_own_part(save):
    """Writer thread, every rank: this rank's part file of `save` and its index."""
    index = write_part(save.path, save.step, save.rank, save.snapshot_id, save.staged)
    fs, root = fs_and_root(save.path)
    write_json(fs, join(join(root, step_dir_name(save.step)), index_name(save.rank)), index)


def commit_save(save):
    """Writer thread, main rank, once every rank reported its part written: the manifest,
    latest.json (the commit point), then retention (raises on failure but retention's)."""
    fs, root = fs_and_root(save.path)
    step_dir = join(root, step_dir_name(save.step))
    indexes = [read_json(fs, join(step_dir, index_name(r))) for r in range(save.world_size)]
    commit(save.path, save.step, save.snapshot_id, dict(save.meta), indexes)
    remove_stale(fs, root, save.step, save.keep)  # best effort: never raises


def _error_of(task):
    """The exception a finished task raised, or None (None too while it runs)."""
    return task.exception() if task is not None and task.done() else None


class AsyncSnapshots:
    def __init__(self, path, grid, keep):
        self.path, self.grid, self.keep = path, grid, keep
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-writer")
        self.state, self.save, self.error = IDLE, None, None
        self.buffers = {}
        self.write, self.commit = None, None  # the futures of the save in flight
        self.copied = None  # on CUDA: an event after the staging copies (begin)
        self.last_wait_ms = 0.0

    def save_step(self, step, pieces, meta, final):
        """The trainer's save (SyncSnapshots' interface): staged now, written in the
        background; final (the end, a stop): the save in flight first, then this one
        synchronously. Returns the record's snapshot_wait_ms (waiting for the one before)."""
        if not final:
            self.begin(step, pieces, meta)
            return {"snapshot_wait_ms": self.last_wait_ms}
        self.drain()
        save_sharded(self.path, self.grid, step, pieces, keep=self.keep, meta=meta)
        return {"snapshot_wait_ms": 0.0}

    # ------------------------------------------------ phase 1, on the save step

    def begin(self, step, pieces, meta):
        """Stage this rank's pieces of `step` and (main rank) prepare its directory."""
        started = time.perf_counter()
        if self.state != IDLE:
            self.drain()
        self.last_wait_ms = 1000 * (time.perf_counter() - started)
        if self.write is not None and not self.write.done():
            # the write of a save that failed on another rank (_fail) still runs: it
            # reads the buffers it was given, so this save stages into new ones
            self.buffers = {}
        staged = tuple((key, tuple(shape), box, self._stage(i, t))
                       for i, (key, shape, box, t) in enumerate(pieces))
        # the run's device is where its tensors live: an event there, none on a CPU run
        on = next((t.device for _, _, _, t in pieces if t.device.type != "cpu"), torch.device("cpu"))
        self.copied = staging_done(on)
        self.save = Save(self.path, step, self.grid.rank, self.grid.world_size, self.keep,
                         MappingProxyType(copy.deepcopy(dict(meta))), staged)
        self.write, self.commit, self.error = None, None, None
        self.drawn_id = 0  # the main rank's, agreed through the step's all-reduce
        if self.grid.is_main:
            self.drawn_id = uuid.uuid4().int >> 66  # 62 bits; not the training's random streams
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
            f[ID] = self.drawn_id
            f[PREP_FAILED] = int(self.error is not None)
        elif self.state == WRITING:
            done = self.write.done()  # read once: "written" and "failed" agree
            f[NOT_WRITTEN] = int(not done)
            f[WRITE_FAILED] = int(done and self.write.exception() is not None)
        elif self.state == COMMITTING and self.commit is not None:  # the main rank's
            done = self.commit.done()
            f[NOT_COMMITTED] = int(not done)
            f[COMMIT_FAILED] = int(done and self.commit.exception() is not None)
        return f

    def advance(self, agreed):
        """Move on by what every rank said (the all-reduced flags); raises on a failure."""
        if self.state == STAGED:
            if agreed[PREP_FAILED]:
                self._fail("prepare")
            if self.copied is not None:
                self.copied.synchronize()  # the staging copies are complete before the thread reads
                self.copied = None
            self.save = replace(self.save, snapshot_id=f"{agreed[ID]:016x}")
            self.write = self.pool.submit(write_own_part, self.save)
            self.state = WRITING
        elif self.state == WRITING:
            if agreed[WRITE_FAILED]:
                self._fail("write")
            if not agreed[NOT_WRITTEN]:  # every rank's part and index are written
                self.commit = self.pool.submit(commit_save, self.save) if self.grid.is_main else None
                self.state = COMMITTING
        elif self.state == COMMITTING:
            if agreed[COMMIT_FAILED]:
                self._fail("commit")
            if not agreed[NOT_COMMITTED]:
                self.state = IDLE

    def _fail(self, what):
        """Every rank, at the same advance: one line (this rank's own error, if it has one).
        A write of this rank may still run (another rank failed first): it writes its own
        Save, and `begin` gives the next save new buffers."""
        task = {"write": self.write, "commit": self.commit}.get(what)
        own = self.error if what == "prepare" else _error_of(task)
        self.state = IDLE
        raise UserError(_failure_line(what, self.save, own))

    # ------------------------------------------------ waiting for the save in flight

    def drain(self):
        """Finish the save in flight, agreeing with blocking all-reduces (every rank calls
        it at the same step: a save step, the end of training, a preemption). A failure
        raises here, on every rank, from advance."""
        while self.state != IDLE:
            task = {WRITING: self.write, COMMITTING: self.commit}.get(self.state)
            if task is not None:
                wait([task])  # its error stays in it: the flags carry it to every rank
            self.advance(self.grid_all_reduce(self.flags()))

    def grid_all_reduce(self, values):
        return self.grid.max_over_ranks(values)

    def close(self):
        """Wait for the writer thread. Returns one line if a save was still in flight (the
        run stopped for another reason, so the ranks could not agree on it any more) and
        this rank knows it did not commit, else None: never a silent missing snapshot."""
        self.pool.shutdown(wait=True)
        if self.state == IDLE:
            return None
        save, state = self.save, self.state
        self.state = IDLE
        task = {WRITING: self.write, COMMITTING: self.commit}.get(state)
        own = self.error if state == STAGED else _error_of(task)
        if own is not None:
            what = {STAGED: "prepare", WRITING: "write", COMMITTING: "commit"}[state]
            return _failure_line(what, save, own)
        if not self.grid.is_main or state == COMMITTING:  # the main rank's commit went through
            return None
        return (f"snapshot step {save.step} at {save.path} was not committed: the run stopped "
                f"while it was {state}; {KEEP_NOTE}")


def _failure_line(what, save, own):
    detail = f": {type(own).__name__}: {own}" if own else " (on another rank: see its error)"
    return f"could not {what} snapshot step {save.step} at {save.path}{detail}; {KEEP_NOTE}"
