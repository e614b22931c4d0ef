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
"""

import json
import os
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
        self.grace_s = min(timeout_s, MAX_GRACE_S)

    def clear(self):
        """At the start of a run (main rank): reports of an earlier launch would be read as
        this one's."""
        if os.path.isdir(self.dir):
            for name in os.listdir(self.dir):
                if name.startswith("rank") and name.endswith(".json"):
                    os.remove(os.path.join(self.dir, name))

    def at(self, **where):
        self.comm.at(**where)

    def explain(self, failure, error, timed_out=True):
        """failure: the one-line UserError parallel.comm.collective_failure made of `error`;
        timed_out: it gave up waiting (else a peer left: every live rank learns that at
        once, and the others' reports come within GONE_GRACE_S). Writes this rank's report,
        reads the others', returns the UserError to end with."""
        report = {"rank": self.rank, **self.where(error), "error": str(failure)}
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"rank{self.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)
        others = self.read_reports(range(self.world_size),
                                   self.grace_s if timed_out else GONE_GRACE_S)
        behind = self.behind(report, others, range(self.world_size))
        place = (f"{report['op']} #{report['collective_on_group']} over ranks "
                 f"{_ranks(report['group'])}" if "op" in report else report["site"])
        said = (f"rank(s) {_ranks(behind)} behind (no report: stopped, hung or dead)"
                if behind and not any(r in others for r in behind)
                else f"rank(s) {_ranks(behind)} behind (fewer collectives into the group)"
                if behind else "no rank behind found")
        return UserError(f"{failure} -- waiting in {place} ({report['phase']}, step "
                         f"{report['step']}); {said}; every rank's report: {self.dir}")

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
        counts = {r: rep.get("collective_on_group") for r, rep in others.items()
                  if rep.get("group") == mine.get("group")}
        if None in counts.values() or not counts:
            return []
        least = min(counts.values())
        return sorted(r for r, c in counts.items() if c == least) if least < max(counts.values()) else []


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks)
