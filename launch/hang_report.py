"""When a collective gives up waiting: what each rank was waiting in, and which ranks are behind.

A collective that does not complete within parallel.timeout_s raises on the ranks waiting
in it (gloo's timeout; NCCL's watchdog), and a rank whose peer then leaves gets a
connection error. Each such rank writes `<run_dir>/hang/rank<R>.json` at once: the
collective it was blocked in (the counted collectives know it: its kind, its group's
ranks, how many collectives this rank started on that group; parallel/comm.py), the step
and the phase (forward, backward, gradient sync, gradient norm, optimizer step,
evaluation, snapshot, end of step), else the line of our code it failed in. Then it waits
for the other ranks' reports (every live rank gives up within about a timeout of the first:
it waits on a rank that is behind, or on one that gave up; at most MAX_GRACE_S) and ends
with one line naming the ranks that are behind: those that wrote no report (stopped, hung,
dead), or, if every one did, those fewest collectives into this rank's group. On NCCL the flight recorder
(torch's ring of recent collectives per rank) is switched on and dumped to the same
folder on a timeout (`nccl_trace_rank<R>`: main.py's init_process_group).

On NCCL no timeout reaches the training thread: a collective returns to the host at once,
the host later blocks on the device (a logged value, a full queue) and NCCL's own watchdog
aborts the process. So each rank of a multi-rank run also has a watchdog thread
(HangWatch): once a step has run longer than parallel.timeout_s it writes the rank's
report from the collective counters (the collective the host is blocked in, else the last
one it started, and how many it started on each group), reads the others' for a short
grace and prints one line naming the ranks behind. NCCL's groups wait parallel.timeout_s
plus a margin (parallel/grid.nccl_timeout_s), so the watchdog comes first: every
collective of a step starts after the step did. On gloo the same report comes first, and
the training thread's timeout then writes its own over it. A step that ends after all
(a long compilation, evaluation or snapshot) withdraws its report.
"""

import json
import os
import sys
import threading
import time
import traceback

from errors import UserError

MAX_GRACE_S = 60.0  # the longest a rank waits for the others' reports (at most the timeout)
GONE_GRACE_S = 2.0  # after a peer left (a crash, a kill): the others learn it at once too


def hang_dir(run_dir):
    return os.path.join(run_dir, "hang")


def nccl_flight_recorder(run_dir) -> dict:
    """The environment that switches NCCL's flight recorder on and dumps it into the hang
    folder when its watchdog times a collective out (read when the process group starts:
    main.py sets these before, unless the user set them)."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(hang_dir(run_dir), "nccl_trace_rank")}


class HangReport:
    def __init__(self, run_dir, rank, world_size, comm, timeout_s):
        """comm: the strategy's CommCounter (what this rank waits in, where the run is)."""
        self.dir, self.rank, self.world_size, self.comm = hang_dir(run_dir), rank, world_size, comm
        self.timeout_s = timeout_s
        self.grace_s = min(timeout_s, MAX_GRACE_S)
        # the watchdog's: short, inside the margin NCCL's groups wait beyond the timeout
        self.watch_grace_s = min(MAX_GRACE_S, max(GONE_GRACE_S, timeout_s / 8))
        self.step_started = None  # time.monotonic() at the current step's start (`at`)
        self.explained = False  # the training thread wrote its report (explain): it stands

    def clear(self):
        """At the start of a run (main rank): reports of an earlier launch would be read as
        this one's."""
        if os.path.isdir(self.dir):
            for name in os.listdir(self.dir):
                if name.startswith("rank") and name.endswith(".json"):
                    os.remove(os.path.join(self.dir, name))

    def at(self, **where):
        if "step" in where:  # a step starts (or a voted-down one starts again)
            self.step_started = time.monotonic()
        self.comm.at(**where)

    def watch(self):
        """Start this rank's watchdog thread (HangWatch); stop() it when the steps end."""
        watch = HangWatch(self)
        watch.start()
        return watch

    def explain(self, failure, error, timed_out=True):
        """failure: the one-line UserError parallel.comm.collective_failure made of `error`;
        timed_out: it gave up waiting (else a peer left: every live rank learns that at
        once, and the others' reports come within GONE_GRACE_S). Writes this rank's report,
        reads the others', returns the UserError to end with."""
        report = {"rank": self.rank, **self.where(error), "error": str(failure),
                  "collectives_started": self.started()}
        self.explained = True
        self.write(report)
        said = self.verdict(report, self.grace_s if timed_out else GONE_GRACE_S)
        return UserError(f"{failure} -- waiting in {_place(report)} ({report['phase']}, step "
                         f"{report['step']}); {said}; every rank's report: {self.dir}")

    def from_counters(self, late_s) -> str:
        """The watchdog's report: a step has run late_s, longer than the timeout, and no
        exception came (NCCL's host is not blocked in the collective, the device is).
        Writes it from the counters, reads the others' for watch_grace_s; returns the line."""
        comm, waiting = self.comm, self.comm.waiting
        if waiting is not None:
            state, report = "waiting in", dict(waiting)
        elif comm.last is not None:
            kind, ranks, number = comm.last
            state = "after"  # the last collective the host started; the device runs it
            report = {"op": kind, "group": list(ranks), "collective_on_group": number}
        else:
            state, report = "at", {"site": "no collective started yet"}
        where = dict(comm.where)
        report = {"rank": self.rank, **report, **where, "collectives_started": self.started(),
                  "by": "watchdog", "step_s": round(late_s, 1),
                  "error": f"step {where.get('step')} has run {late_s:.1f} s, longer than "
                           f"parallel.timeout_s={self.timeout_s:g} s"}
        self.write(report)
        said = self.verdict(report, self.watch_grace_s)
        return (f"hang watchdog on rank {self.rank}: {report['error']} -- {state} "
                f"{_place(report)} ({report.get('phase')}); {said}; every rank's report: {self.dir}")

    def withdraw(self):
        """The step the watchdog reported ended after all: its report is no hang's."""
        try:
            os.remove(os.path.join(self.dir, f"rank{self.rank}.json"))
        except FileNotFoundError:
            pass

    def started(self) -> dict:
        """How many collectives this rank started on each group ("0,1,2,3": n)."""
        started = getattr(self.comm, "started", {})
        for _ in range(3):  # the training thread may add a group while this one reads
            try:
                return {",".join(map(str, ranks)): n for ranks, n in list(started.items())}
            except RuntimeError:
                continue
        return {}

    def write(self, report):
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"rank{self.rank}.json")
        tmp = f"{path}.{threading.get_ident()}.tmp"  # the watchdog and the training thread
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, path)

    def verdict(self, report, grace_s) -> str:
        """Which ranks are behind, after reading the others' reports for up to grace_s."""
        others = self.read_reports(range(self.world_size), grace_s)
        behind = self.behind(report, others, range(self.world_size))
        if behind and not any(r in others for r in behind):
            return f"rank(s) {_ranks(behind)} behind (no report: stopped, hung or dead)"
        if behind:
            return f"rank(s) {_ranks(behind)} behind (fewer collectives into the group)"
        return "no rank behind found"

    def where(self, error) -> dict:
        """What this rank was blocked in (the counted collectives'), or the line of our code
        the error came from (an uncounted collective: an agreement, a snapshot's)."""
        waiting = self.comm.waiting
        if waiting is not None:
            return dict(waiting)
        site = "?"
        for frame in traceback.extract_tb(error.__traceback__):
            if "site-packages" not in frame.filename and os.sep + "torch" + os.sep not in frame.filename:
                site = f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
        return {"site": site, **self.comm.where}

    def read_reports(self, group, grace_s) -> dict:
        """{rank: report} of the ranks of `group` that wrote one within grace_s."""
        group, deadline, found = list(group), time.monotonic() + grace_s, {}
        while True:
            for rank in group:
                path = os.path.join(self.dir, f"rank{rank}.json")
                if rank not in found and os.path.exists(path):
                    try:
                        with open(path) as f:
                            found[rank] = json.load(f)
                    except (OSError, ValueError):
                        pass  # being written: read it on the next pass
            if len(found) == len(group) or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    @staticmethod
    def behind(mine, others, world) -> list:
        """The ranks that wrote no report; if every one did, those of this rank's group
        fewest collectives into it."""
        silent = [r for r in world if r not in others]
        if silent:
            return silent
        counts = {r: _count_on(rep, mine.get("group")) for r, rep in others.items()}
        counts = {r: c for r, c in counts.items() if c is not None}
        if not counts:
            return []
        least = min(counts.values())
        return sorted(r for r, c in counts.items() if c == least) if least < max(counts.values()) else []


class HangWatch(threading.Thread):
    """A rank's watchdog (the module's docstring): polls the step's start; once a step has
    run longer than parallel.timeout_s, writes the report from the counters and prints its
    line, once per step; withdraws it if the step ends after all. `said`: its lines."""

    def __init__(self, report, poll_s=None):
        super().__init__(name="hang-watch", daemon=True)
        self.report = report
        self.poll_s = poll_s or min(1.0, max(0.05, report.timeout_s / 20))
        self.stopped = threading.Event()
        self.said = []

    def run(self):
        fired = None  # the start of the step reported
        while not self.stopped.wait(self.poll_s):
            started = self.report.step_started
            if started is None:
                continue
            if fired is not None and started != fired:  # that step ended: no hang
                self.report.withdraw()
                self.say(f"hang watchdog on rank {self.report.rank}: the step went on after "
                         f"all; report withdrawn")
                fired = None
            late = time.monotonic() - started
            if fired is None and late > self.report.timeout_s and not self.report.explained:
                fired = started
                self.say(self.report.from_counters(late))

    def say(self, line):
        self.said.append(line)
        sys.stderr.flush()  # one write of the whole line, as main.py's error line
        os.write(2, (line + "\n").encode())

    def stop(self):
        self.stopped.set()


def _count_on(report, group):
    """How many collectives the rank of `report` started on `group` (a list of ranks), or
    None where its report does not say."""
    started = report.get("collectives_started") or {}
    key = ",".join(map(str, group or []))
    if key in started:
        return started[key]
    return report.get("collective_on_group") if report.get("group") == group else None


def _place(report) -> str:
    if "op" in report:
        return f"{report['op']} #{report['collective_on_group']} over ranks {_ranks(report['group'])}"
    return report["site"]


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks)
