"""Counted collectives: every strategy sends through these, so metrics.jsonl can say
how many collective calls each rank made per step and how many bytes it handed
to them, by kind (`comm_calls`, `comm_bytes`, and `comm_<kind>_calls/bytes`).

Every tensor handed to them must be on the grid's device (so must the tensor of
`checked_all_reduce`, the uncounted all-reduce of the ranks' agreements): a CPU tensor headed for
an NCCL group fails here with one clear message, on the first step, instead of
deep inside the backend ("No backend type associated with device type cpu").

"Bytes handed" is the payload of the call on this rank (the tensor given to
all_reduce, the output of an all_gather, the input of a reduce_scatter, what a
send sends), not what the algorithm puts on the wire: the benchmark compares
it with the textbook volumes.

The counter also times how long the training thread was blocked in them (a synchronous
call, or `wait()` on the work of an asynchronous one: `take_waited_s`): a rank that waits
little while the others wait long is the one they wait for (telemetry/stragglers.py). On
CUDA the wait is the device's: NCCL returns to the host at once and makes the compute
stream wait, so each wait is timed by two CUDA events on the current stream, around it
(read at the steps that report it, never at the others). And
it knows what it is waiting in (`waiting`: the collective, its group's ranks, how many
collectives this rank has started on that group, the step and the phase the trainer and
the step's code set with `at`): what a hang report says (launch/hang_report.py).
"""

import re
import threading
import time
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist

from errors import UserError

# torch 2.13 renamed the tensor-to-tensor collectives (all_gather_into_tensor and
# reduce_scatter_tensor now warn as deprecated); a GPU image's older torch has only the
# old names. Same arguments, same kernels.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class WrongDevice(RuntimeError):
    """A collective was handed a tensor on another device than its process group's."""


def check_device(kind, device, *tensors):
    """Raise WrongDevice if any of `tensors` is not on `device` (None: unchecked)."""
    for t in tensors:
        if device is not None and t.device != device:
            raise WrongDevice(f"{kind}: tensor of shape {tuple(t.shape)} is on {t.device}, but "
                              f"the process groups work on {device}: create it with "
                              f"device=grid.device (an NCCL group cannot send CPU tensors)")


def checked_all_reduce(tensor, device, op=dist.ReduceOp.SUM, group=None):
    """An all-reduce that is no training traffic and has no strategy's counter at hand
    (the ranks' agreements: grid.all_ok, the fp16 overflow vote, the preemption and
    asynchronous snapshot flags): device-checked like the counted ones, never counted,
    so metrics.jsonl's comm_* figures stay the strategies' traffic."""
    check_device("all_reduce", torch.device(device), tensor)
    return dist.all_reduce(tensor, op=op, group=group)


# how the backends word a collective that gave up waiting, and one whose peer went away
_TIMED_OUT = re.compile(r"timed out|timeout|watchdog", re.I)
_PEER_GONE = re.compile(r"connection (closed|reset|refused)|broken pipe|socket closed", re.I)


def timed_out(error) -> bool:
    """Whether a collective's error says it gave up waiting (not that its peer left)."""
    return bool(_TIMED_OUT.search(str(error)))


def collective_failure(error, timeout_s):
    """The one-line UserError for an exception a collective raised (a backend's
    RuntimeError or torch's DistError), or None if `error` is something else. Each rank
    gets its own line: the ranks that waited too long say so, the ones whose peer left
    say that; the backend's own words follow in brackets. A WrongDevice is none of these
    (its text names NCCL, and so read as a peer's failure): a defect of this program on
    this rank, left to raise with its traceback, which names the call that handed over
    the tensor."""
    if isinstance(error, WrongDevice) or not isinstance(error, (RuntimeError, dist.DistError)):
        return None
    text = str(error).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    first = re.sub(r"^\[[^\]]*(gloo|nccl|c10d)[^\]]*\]\s*", "", first, flags=re.I)
    if len(first) > 200:
        first = first[:200] + "..."
    if _TIMED_OUT.search(text):
        return UserError(f"a collective waited longer than parallel.timeout_s={timeout_s:g} s and "
                         "gave up: another rank is stuck, crashed or took another code path (the "
                         f"other ranks' lines say which) [{first}]")
    if _PEER_GONE.search(text) or isinstance(error, dist.DistError) or "gloo" in text.lower() \
            or "nccl" in text.lower():
        return UserError(f"a collective failed because another rank stopped (its own line says "
                         f"why) [{first}]")
    return None


class CommCounter:
    def __init__(self, device=None, event_class=None):
        """device: the grid's device, which every tensor handed over must be on (None:
        unchecked, for tools that build a counter without a grid). event_class: what times
        the waits on the device (torch.cuda.Event on CUDA; tests pass a stand-in); None
        elsewhere: the host's clock, which is the device's there."""
        self.calls, self.bytes = Counter(), Counter()
        self.counting = True
        self.device = None if device is None else torch.device(device)
        if event_class is None and self.device is not None and self.device.type == "cuda":
            event_class = torch.cuda.Event
        self.event_class = event_class
        self.device_waits = []  # (start, end) events of this step's waits, on the device
        self.waited_s, self.thread = 0.0, threading.get_ident()  # the training thread's
        self.where = {"step": 0, "phase": "setup"}  # set by `at`
        self.started = Counter()  # group's ranks -> collectives started on it
        self.ranks = {}  # group -> its global ranks
        self.last = None  # the last collective started: (kind, group's ranks, its number)
        self.waiting = None  # what the training thread is blocked in now (a dict), or None

    def at(self, **where):
        """Note where the run is (step=, phase=) for a hang report."""
        self.where.update(where)

    def _started(self, kind, group):
        ranks = self.ranks.get(group)
        if ranks is None:  # (a dict lookup in torch, kept: some collectives run per layer)
            ranks = self.ranks[group] = tuple(dist.get_process_group_ranks(group)) \
                if group is not None else tuple(range(dist.get_world_size()))
        self.started[ranks] += 1
        self.last = (kind, ranks, self.started[ranks])
        return self.last

    @contextmanager
    def blocked(self, what=None):
        """Time a wait for a collective, if the training thread is the one waiting (the
        ring's worker thread waits for its own sends: not the step's wait), and note what
        it waits in (`what`: _started's, default the last started)."""
        mine = threading.get_ident() == self.thread
        if mine:
            kind, ranks, number = what or self.last or ("?", (), 0)
            self.waiting = {"op": kind, "group": list(ranks), "collective_on_group": number,
                            **self.where}
            events = self._device_mark() if self.event_class is not None else None
        start = time.perf_counter()
        yield  # raising (a timeout): `waiting` stays, for the hang report
        if mine:
            self.waited_s += time.perf_counter() - start
            self.waiting = None
            if events is not None:  # the stream passes this mark once the collective is done
                self.device_waits.append((events, self._device_mark()))

    def _device_mark(self):
        event = self.event_class(enable_timing=True)
        event.record()  # on the current stream, where NCCL's wait() makes the work wait
        return event

    def take_waited_s(self, read=True) -> float:
        """Seconds the training thread's work was blocked in collectives since the last
        take: on CUDA the device's time between each wait's two events (read=False: none
        read, the events dropped; a step that reports no figure synchronizes nothing),
        elsewhere the host's."""
        waited, self.waited_s = self.waited_s, 0.0
        marks, self.device_waits = self.device_waits, []
        if self.event_class is None or not read:
            return waited
        for _, end in marks:  # at a reported step only (a wait on a side stream too)
            end.synchronize()
        return sum(start.elapsed_time(end) for start, end in marks) / 1000

    def _run(self, kind, group, call, async_op):
        """A collective's call: its work wrapped to time its wait, or timed itself."""
        what = self._started(kind, group)
        if async_op:
            return TimedWork(call(), self, what)
        with self.blocked(what):
            return call()

    def check(self, kind, *tensors):
        check_device(kind, self.device, *tensors)

    def record(self, kind, tensor):
        self.check(kind, tensor)
        if self.counting:
            self.calls[kind] += 1
            self.bytes[kind] += tensor.numel() * tensor.element_size()

    @contextmanager
    def uncounted(self):
        """Collectives that are not training traffic (evaluation, snapshots) go uncounted."""
        before, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = before

    def pop(self) -> dict:
        """Totals and per-kind figures since the last pop, then start again."""
        out = {"comm_calls": sum(self.calls.values()), "comm_bytes": sum(self.bytes.values())}
        for kind in sorted(self.calls):
            out[f"comm_{kind}_calls"] = self.calls[kind]
            out[f"comm_{kind}_bytes"] = self.bytes[kind]
        self.calls.clear()
        self.bytes.clear()
        return out

    # -- the collectives, same signatures as torch.distributed plus the counting

    def all_reduce(self, tensor, group=None, op=dist.ReduceOp.SUM, async_op=False):
        self.record("all_reduce", tensor)
        return self._run("all_reduce", group, lambda: dist.all_reduce(
            tensor, op=op, group=group, async_op=async_op), async_op)

    def reduce_scatter(self, output, input, group=None, op=dist.ReduceOp.SUM, async_op=False):
        self.check("reduce_scatter", output)
        self.record("reduce_scatter", input)
        return self._run("reduce_scatter", group, lambda: reduce_scatter_single(
            output, input, op=op, group=group, async_op=async_op), async_op)

    def all_gather(self, output, input, group=None, async_op=False):
        self.check("all_gather", input)
        self.record("all_gather", output)
        return self._run("all_gather", group, lambda: all_gather_single(
            output, input, group=group, async_op=async_op), async_op)

    def all_to_all(self, output, input, output_splits, input_splits, group=None, kind="all_to_all",
                   counted=None):
        """dist.all_to_all_single with uneven splits (row counts per rank), synchronous.
        Counted: `counted`, the side of the exchange the caller names (default: what this
        rank hands over, its own share included)."""
        self.check(kind, output, input)
        self.record(kind, input if counted is None else counted)
        with self.blocked(self._started(kind, group)):
            return dist.all_to_all_single(output, input, output_splits, input_splits, group=group)

    def broadcast(self, tensor, src, group=None, async_op=False):
        self.record("broadcast", tensor)
        return self._run("broadcast", group, lambda: dist.broadcast(
            tensor, src=src, group=group, async_op=async_op), async_op)

    def exchange(self, sends=(), recvs=(), group=None):
        """Post sends [(tensor, dst)] and receives [(tensor, src)] as one batch
        (batch_isend_irecv): on NCCL two separate calls to the same peer could each wait
        behind the other. Returns one work per operation, receives first (NCCL returns
        one work for the whole batch: each operation then gets that one)."""
        ops = []
        for tensor, src in recvs:
            self.check("recv", tensor)
            if self.counting:
                self.calls["recv"] += 1
            ops.append(dist.P2POp(dist.irecv, tensor, peer=src, group=group))
        for tensor, dst in sends:
            self.record("send", tensor)
            ops.append(dist.P2POp(dist.isend, tensor, peer=dst, group=group))
        what = self._started("send/recv", group) if ops else None
        works = [TimedWork(w, self, what) for w in (dist.batch_isend_irecv(ops) if ops else [])]
        return works if len(works) == len(ops) else [works[0]] * len(ops)


class TimedWork:
    """An asynchronous collective's work whose wait() is timed (CommCounter.blocked); the
    rest is the work's own."""

    def __init__(self, work, counter, what):
        self.work, self.counter, self.what = work, counter, what

    def wait(self, *args, **kwargs):
        with self.counter.blocked(self.what):
            return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)
