"""trainer.snapshot_async's protocol (checkpoint/async_snapshot.py), in process and
deterministic: no job, no sleep, no timing. Each test drives AsyncSnapshots the way the
trainer does (begin on a save step; flags, the step's all-reduce and advance at every
step's end; drain) against a fake grid whose all-reduce the test plays, and holds the
writer thread on an Event where it must be in flight.

- the race of issue part 3: what a background write or commit reads is fixed when its
  save begins: the next save (or anything else the main thread does) cannot change it;
- no error of the writer thread is swallowed: a failed commit reaches every rank's
  all-reduce and stops the run; one still in flight when the run stops for another
  reason is reported when the run ends;
- one test per fault class the multi-rank jobs saw only by chance (the slowed-
  filesystem SIGKILL test) or only by a wait-time figure (tests/README.md's guards).
"""

import json
import os
import threading
from types import SimpleNamespace

import pytest
import torch

from checkpoint import async_snapshot
from checkpoint.snapshot_dirs import fs_and_root, step_dir_name
from checkpoint.snapshot_format import DTYPES, HEADER_BYTES
from checkpoint.snapshot_reader import open_snapshot
from checkpoint.snapshot_writer import save_sharded, write_part
from data.fs_json import write_json
from errors import UserError

META = {"config": {}, "gpt_config": {}, "tokenizer": {}}
SHAPE = (2, 3)


def pieces(value, rank=None):
    """The tensor "model/w": whole, or (a rank of Pair) the rank's row of it."""
    if rank is None:
        return [("model/w", SHAPE, ((0, 2), (0, 3)), torch.full(SHAPE, float(value)))]
    return [("model/w", SHAPE, ((rank, rank + 1), (0, 3)), torch.full((1, 3), float(value)))]


class PeerGrid:
    """This process is rank 0 (the main rank) of a 2-rank world; the test plays rank 1:
    the step's all-reduce (MAX) merges this rank's flags with `peer`, rank 1's (zeros
    when None)."""

    def __init__(self):
        self.rank, self.world_size, self.is_main = 0, 2, True
        self.peer = None
        self.sent = []  # this rank's contribution to each all-reduce

    def max_over_ranks(self, values):
        self.sent.append(list(values))
        return [max(a, b) for a, b in zip(values, self.peer or [0] * len(values))]


def peer_writes(saver, step, value=0.0):
    """Rank 1's part and index of `step`, which `saver` (rank 0) is writing, as rank 1's
    writer thread would leave them."""
    fs, root = fs_and_root(saver.path)
    index = write_part(saver.path, step, 1, saver.save.snapshot_id, pieces(value, rank=1))
    write_json(fs, f"{root}/{step_dir_name(step)}/{async_snapshot.index_name(1)}", index)


def flag(**set_flags):
    f = [0] * async_snapshot.N_FLAGS
    for name, value in set_flags.items():
        f[getattr(async_snapshot, name.upper())] = value
    return f


def end_of_step(saver):
    """What the trainer does at the end of every step: this rank's flags into the
    step's all-reduce, then advance by what every rank said."""
    saver.advance(saver.grid_all_reduce(saver.flags()))


_holds = []


@pytest.fixture(autouse=True)
def _release_holds():
    """A test that fails with a call still held lets it go, so no writer thread waits on."""
    yield
    while _holds:
        _holds.pop().release()


class Hold:
    """Wraps async_snapshot.<name>: the call from the writer thread (with the arguments
    it was given) waits until release(); entered is set once it is waiting."""

    def __init__(self, monkeypatch, name, fail=None, only=None):
        self.real, self.fail, self.only = getattr(async_snapshot, name), fail, only
        self.entered, self.go, self.calls = threading.Event(), threading.Event(), []
        self.returned = threading.Event()
        monkeypatch.setattr(async_snapshot, name, self)
        _holds.append(self)

    def __call__(self, *args, **kw):
        if self.only is not None and not self.only(*args):  # not a call to hold
            return self.real(*args, **kw)
        self.calls.append(args)
        try:
            return self._held(*args, **kw)
        finally:
            self.returned.set()

    def _held(self, *args, **kw):
        self.entered.set()
        assert self.go.wait(60), "the test never released the held call"
        if self.fail is not None:  # an injected error, raised once released
            raise self.fail
        return self.real(*args, **kw)

    def release(self):
        self.go.set()


def part_values(part, index):
    """{key: tensor} of a part file, read back through its index (a JSON file)."""
    with open(index) as f:
        entries = json.load(f)
    with open(part, "rb") as f:
        raw = f.read()
    out = {}
    for e in entries:
        assert e["offset"] >= HEADER_BYTES
        dtype = DTYPES[e["dtype"]]
        n = 1
        for lo, hi in e["box"]:
            n *= hi - lo
        size = n * torch.empty((), dtype=dtype).element_size()
        out[e["key"]] = torch.frombuffer(bytearray(raw[e["offset"]:e["offset"] + size]), dtype=dtype)
    return out


def test_a_write_still_running_when_its_save_fails_elsewhere_writes_its_own_step(tmp_path, monkeypatch):
    """The race (issue part 3): the writer thread read the save's fields (step, staged
    buffers, id) off the shared object while it ran. Rank 1 reports its write of step 2
    failed while this rank's own write of step 2 is still running (held): every rank
    raises, and this rank's state is idle with its write still running. A next save
    (a caller going on after the error) then begins step 3, staging new values, and the
    write is let go: it must write step 2's values into step 2's directory. It wrote
    the index into step 3's directory (it read `self.step` after begin(3)) and step 3's
    values into step 2's part (it read the staging buffer begin(3) had refilled)."""
    path = str(tmp_path / "snapshot")
    grid = PeerGrid()
    saver = async_snapshot.AsyncSnapshots(path, grid, keep=2)
    held = Hold(monkeypatch, "write_part")
    saver.begin(2, pieces(1.0), META)
    end_of_step(saver)  # staged -> writing: the write of step 2 starts, and is held
    assert held.entered.wait(60)
    grid.peer = flag(write_failed=1)  # rank 1: "my write of step 2 failed"
    with pytest.raises(UserError, match=r"could not write snapshot step 2 .*on another rank"):
        end_of_step(saver)
    grid.peer = None
    saver.begin(3, pieces(3.0), META)  # the next save begins while step 2's write still runs
    held.release()
    saver.close()  # waits for the writer thread
    step2, step3 = tmp_path / "snapshot" / "step-00000002", tmp_path / "snapshot" / "step-00000003"
    index2, index3 = (d / async_snapshot.index_name(0) for d in (step2, step3))
    wrong = []
    if index3.exists():
        wrong.append("step 2's write put its index into step 3's directory")
    if not index2.exists():
        wrong.append("step 2's directory has no index of rank 0")
    got = part_values(step2 / "part-00000.bin", index2 if index2.exists() else index3)
    if got["model/w"].tolist() != [1.0] * 6:
        wrong.append(f"step 2's part holds {got['model/w'].tolist()}, not step 2's values (1.0)")
    assert not wrong, "; ".join(wrong)


class Rank:
    """A rank of Pair: the pair makes the all-reduce, so this grid never does."""

    def __init__(self, rank):
        self.rank, self.world_size, self.is_main = rank, 2, rank == 0

    def max_over_ranks(self, values):
        raise AssertionError("Pair ranks agree through Pair.end_of_step")


class Pair:
    """Ranks 0 and 1 of a 2-rank world in this one thread: the end of each step is the
    MAX of both ranks' flags, by which both advance (each rank's error, or None)."""

    def __init__(self, path, keep=2):
        self.savers = [async_snapshot.AsyncSnapshots(path, Rank(r), keep) for r in (0, 1)]

    def begin(self, step, value):
        for r, s in enumerate(self.savers):
            s.begin(step, pieces(value, rank=r), META)

    def end_of_step(self):
        agreed = [max(vs) for vs in zip(*(s.flags() for s in self.savers))]
        errors = []
        for s in self.savers:
            try:
                s.advance(agreed)
                errors.append(None)
            except UserError as e:
                errors.append(str(e))
        return errors

    def settle(self, ranks=(0, 1)):
        """Wait until no task of these ranks runs (what a rank's drain waits for)."""
        for s in (self.savers[r] for r in ranks):
            for task in (s.write, s.commit):
                if task is not None:
                    task.exception()

    def close(self):
        return [s.close() for s in self.savers]


def test_a_failed_commit_stops_every_rank_and_the_commit_point_stays(tmp_path, monkeypatch,
                                                                     one_rank_grid):
    """An error raised by the main rank's background commit (injected: the manifest
    cannot be written) reaches the other rank through the step's all-reduce, and every
    rank raises it at the same step: rank 0 with the error, rank 1 pointing at it."""
    path = str(tmp_path / "snapshot")
    save_sharded(path, one_rank_grid, 1, pieces(1.0), META)  # the snapshot to fall back on

    def refused(*args):
        raise OSError("injected: the bucket refused manifest.json")
    monkeypatch.setattr(async_snapshot, "commit", refused)
    pair = Pair(path)
    pair.begin(2, 2.0)
    assert pair.end_of_step() == [None, None]  # staged -> writing
    pair.settle()
    assert pair.end_of_step() == [None, None]  # written -> committing (rank 0's thread)
    pair.settle()
    errors = pair.end_of_step()
    assert errors[0] is not None and errors[0].startswith(
        f"could not commit snapshot step 2 at {path}: OSError: injected: the bucket refused "
        "manifest.json; the previous snapshot stays"), errors
    assert errors[1] is not None and errors[1].startswith(
        f"could not commit snapshot step 2 at {path} (on another rank: see its error)"), errors
    assert open_snapshot(path).meta["step"] == 1
    assert pair.close() == [None, None]  # reported already: nothing more at the end


def test_a_save_step_that_finds_a_failed_commit_raises_it(tmp_path, monkeypatch):
    """The same failure found by the next save step's wait (drain: it waited for the
    commit, dropping its exception, and relied on the flags to carry it)."""
    path = str(tmp_path / "snapshot")
    held = Hold(monkeypatch, "commit", fail=OSError("injected: disk quota exceeded"))
    saver = async_snapshot.AsyncSnapshots(path, PeerGrid(), keep=2)
    saver.begin(2, pieces(2.0, rank=0), META)
    end_of_step(saver)
    saver.write.result()
    peer_writes(saver, 2)
    end_of_step(saver)  # the commit starts, and is held
    assert held.entered.wait(60)
    end_of_step(saver)  # a step while it runs: nothing agreed yet
    assert saver.state == async_snapshot.COMMITTING
    held.release()
    with pytest.raises(UserError, match=r"^could not commit snapshot step 2 at .*: OSError: "
                                        r"injected: disk quota exceeded; the previous snapshot"):
        saver.begin(3, pieces(3.0, rank=0), META)
    assert saver.grid.sent[-1][async_snapshot.COMMIT_FAILED] == 1  # what the other rank got
    assert not os.path.exists(os.path.join(path, "latest.json"))
    assert saver.close() is None


@pytest.mark.parametrize("phase", ["commit", "write"])
def test_a_save_in_flight_when_the_run_stops_for_another_reason_is_reported(tmp_path, monkeypatch,
                                                                            capfd, phase):
    """The run stops (a damaged batch, a NaN loss, ...) while the main rank's commit of
    step 2 runs and then fails, or once its write is done but before the ranks agreed
    to commit: no all-reduce will carry it any more. The end of the run (Trainer.close)
    says so in one line instead of leaving the snapshot silently missing."""
    import trainer
    path = str(tmp_path / "snapshot")
    if phase == "commit":
        held = Hold(monkeypatch, "commit", fail=OSError("injected: connection reset"))
    saver = async_snapshot.AsyncSnapshots(path, PeerGrid(), keep=2)
    saver.begin(2, pieces(2.0, rank=0), META)
    end_of_step(saver)
    saver.write.result()
    peer_writes(saver, 2)
    if phase == "commit":
        end_of_step(saver)
        assert held.entered.wait(60)
        held.release()  # it fails while the run is already on its way out
    closed = SimpleNamespace(close=lambda: None)  # the profiler, the record, the replica group
    stub = SimpleNamespace(profiler=closed, record=closed, group=closed, snapshots=saver,
                           grid=saver.grid)
    trainer.Trainer.close(stub)
    err = capfd.readouterr().err
    want = {"commit": f"warning on rank 0: could not commit snapshot step 2 at {path}: OSError: "
                      "injected: connection reset; the previous snapshot stays the one to resume from",
            "write": f"warning on rank 0: snapshot step 2 at {path} was not committed: the run "
                     "stopped while it was writing; the previous snapshot stays the one to resume from"}
    assert err.splitlines() == [want[phase]], err


# ---------------------------------------------- fault classes the jobs saw only by chance


def test_the_commit_waits_for_every_ranks_part(tmp_path, monkeypatch):
    """The commit point never names a step some rank has not finished: rank 0's write
    of step 2 is done, rank 1's is held; steps go by and no commit may start (a commit
    started on NOT_WRITTEN ignored, on the main rank's own write, or on a rank that says
    "written" too early). Let go, the next steps commit step 2 with both ranks' parts."""
    path = str(tmp_path / "snapshot")
    started = []  # (step, files in its directory) when a commit starts
    real_commit = async_snapshot.commit_save

    def commit_save(save):
        started.append((save.step, sorted(os.listdir(os.path.join(path, step_dir_name(save.step))))))
        return real_commit(save)
    monkeypatch.setattr(async_snapshot, "commit_save", commit_save)
    held = Hold(monkeypatch, "write_part", only=lambda path, step, rank, *rest: rank == 1)
    pair = Pair(path)
    pair.begin(2, 2.0)
    assert pair.end_of_step() == [None, None]  # staged -> writing
    assert held.entered.wait(60)
    pair.savers[0].write.result()  # rank 0's part and index are written
    for _ in range(3):
        assert pair.end_of_step() == [None, None]
        pair.settle(ranks=[0])  # whatever rank 0's thread was given has run
        assert not started, f"a commit of step 2 started while rank 1 was writing: {started}"
    held.release()
    pair.settle()
    for _ in range(2):  # written -> committing -> idle
        assert pair.end_of_step() == [None, None]
        pair.settle()
    assert [s.state for s in pair.savers] == [async_snapshot.IDLE] * 2
    every_file = ["index-00000.json", "index-00001.json", "part-00000.bin", "part-00001.bin"]
    assert started == [(2, every_file)]
    snap = open_snapshot(path)
    assert snap.meta["step"] == 2 and snap.read_full("model/w").tolist() == [[2.0] * 3] * 2
    assert pair.close() == [None, None]


def test_no_rank_is_idle_while_the_commit_runs(tmp_path, monkeypatch):
    """Steps go by while the main rank's commit of step 2 runs (held): every rank stays
    in the save (idle would let the next save begin without waiting for it: its
    directory prepared, and removed by the commit's retention, and the commit's error
    never carried by the flags). Let go, the next step makes both idle."""
    path = str(tmp_path / "snapshot")
    held = Hold(monkeypatch, "commit")
    pair = Pair(path)
    pair.begin(2, 2.0)
    pair.end_of_step()
    pair.settle()
    assert pair.end_of_step() == [None, None]  # every part written: the commit starts
    assert held.entered.wait(60)
    for _ in range(3):
        assert pair.end_of_step() == [None, None]
        assert [s.state for s in pair.savers] == [async_snapshot.COMMITTING] * 2
    held.release()
    pair.settle()
    assert pair.end_of_step() == [None, None]
    assert [s.state for s in pair.savers] == [async_snapshot.IDLE] * 2
    assert open_snapshot(path).meta["step"] == 2



def test_the_save_holds_the_values_of_its_step_while_training_changes_them(tmp_path, monkeypatch):
    """Training goes on while step 2 is written: the optimizer step changes the live
    tensors in place before the (held) write reads them. The part holds the values at
    step 2 (the staging copy), not the ones of a later step."""
    path = str(tmp_path / "snapshot")
    held = Hold(monkeypatch, "write_part")
    live = pieces(2.0)
    saver = async_snapshot.AsyncSnapshots(path, PeerGrid(), keep=2)
    saver.begin(2, live, META)
    end_of_step(saver)
    assert held.entered.wait(60)
    live[0][3].add_(1.0)  # step 3's optimizer step, in place
    held.release()
    saver.write.result()
    step2 = tmp_path / "snapshot" / "step-00000002"
    got = part_values(step2 / "part-00000.bin", step2 / async_snapshot.index_name(0))["model/w"]
    assert got.tolist() == [2.0] * 6, f"step 2's part holds {got.tolist()}"
    saver.close()


def test_a_failed_prepare_stops_every_rank_before_any_part_is_written(tmp_path, monkeypatch):
    """The main rank could not empty step 2's directory (begin): the save step's
    all-reduce carries it, every rank raises at once, and no write starts (a write into
    a directory that still holds another run's files could be committed with them)."""
    path = str(tmp_path / "snapshot")

    def refused(path, step):
        raise PermissionError(f"injected: cannot remove step-{step:08d}")
    monkeypatch.setattr(async_snapshot, "prepare_step_dir", refused)
    writes = []
    monkeypatch.setattr(async_snapshot, "write_part", lambda *args: writes.append(args))
    pair = Pair(path)
    pair.begin(2, 2.0)
    errors = pair.end_of_step()
    assert errors[0] is not None and errors[0].startswith(
        f"could not prepare snapshot step 2 at {path}: PermissionError: injected: cannot remove "
        "step-00000002; the previous snapshot stays"), errors
    assert errors[1] is not None and errors[1].startswith(
        f"could not prepare snapshot step 2 at {path} (on another rank: see its error)"), errors
    pair.settle()
    assert not writes and [s.state for s in pair.savers] == [async_snapshot.IDLE] * 2
    assert pair.close() == [None, None]


class Clock:
    """async_snapshot's time.perf_counter, moved on by the test only."""

    def __init__(self, monkeypatch):
        self.now = 1000.0
        monkeypatch.setattr(async_snapshot, "time", self)

    def perf_counter(self):
        return self.now


def test_a_save_step_waits_for_the_save_in_flight_and_reports_the_wait(tmp_path, monkeypatch):
    """The issue's sequence, held open: step 2's commit runs across a step and on when
    the save of step 3 begins. begin(3) must wait for it (drain) before staging or
    preparing anything (retention would delete step 3's unfinished directory); the
    commit, let go only once begin(3) waits for it (or has returned without waiting),
    commits step 2; and the wait is what metrics report as snapshot_wait_ms (a fake
    clock: the 2.5 s the commit is held, exactly)."""
    path = str(tmp_path / "snapshot")
    clock = Clock(monkeypatch)
    held = Hold(monkeypatch, "commit")
    saver = async_snapshot.AsyncSnapshots(path, PeerGrid(), keep=2)
    saver.begin(2, pieces(2.0, rank=0), META)
    end_of_step(saver)
    saver.write.result()
    peer_writes(saver, 2)
    end_of_step(saver)  # every part written: the commit of step 2 starts, and is held
    assert held.entered.wait(60)
    end_of_step(saver)  # a step between two saves, while it runs

    events, waiting_or_returned = [], threading.Event()
    real_wait = async_snapshot.wait

    def wait(tasks, *args, **kw):  # drain's wait for a task of the save in flight
        events.append("begin(3) waits for step 2's commit")
        waiting_or_returned.set()
        return real_wait(tasks, *args, **kw)
    monkeypatch.setattr(async_snapshot, "wait", wait)

    def begin_3():
        try:
            saver.begin(3, pieces(3.0, rank=0), META)
        finally:
            events.append("begin(3) returned" + ("" if held.returned.is_set() else
                                                 " with step 2's commit still running"))
            waiting_or_returned.set()
    thread = threading.Thread(target=begin_3)
    thread.start()
    assert waiting_or_returned.wait(60)
    clock.now += 2.5  # the commit takes 2.5 s
    held.release()
    thread.join(60)
    assert events == ["begin(3) waits for step 2's commit", "begin(3) returned"], events
    assert [call[1] for call in held.calls] == [2]  # commit(path, step, ...) of step 2
    assert open_snapshot(path).meta["step"] == 2
    assert saver.state == async_snapshot.STAGED  # step 3, staged after the wait
    assert saver.last_wait_ms == 2500.0
    saver.close()
