"""launch/hang_report.py in process, on a fake clock: which ranks `behind` names, and how
long `explain` waits for the other ranks' reports (GONE_GRACE_S after a peer left, up to
the timeout after a collective timed out). The real hang, a rank SIGSTOPped among 4, is
tests/test_hang_report.py's.
"""

import json
from types import SimpleNamespace

import pytest

from errors import UserError
from launch import hang_report
from launch.hang_report import HangReport

GROUP = [0, 1, 2, 3]


def report(rank, count, group=GROUP):
    return {"rank": rank, "op": "all_reduce", "group": group, "collective_on_group": count,
            "step": 3, "phase": "gradient sync", "error": "timed out"}


@pytest.mark.parametrize("counts, named", [
    ({0: 7, 1: 6, 2: 7, 3: 7}, [1]),
    ({0: 7, 1: 7, 2: 5, 3: 5}, [2, 3]),
    ({0: 7, 1: 7, 2: 7, 3: 7}, []),
], ids=["rank1-fewer", "ranks2-3-fewer", "all-equal"])
def test_behind_names_the_ranks_with_fewest_collectives_and_none_when_all_are_equal(counts, named):
    """Every rank reported, on this rank's group: the ranks fewest collectives into it are
    named, none when all are equal. Red when the most are named (max for min), or the
    least count is named even when every count is equal."""
    others = {r: report(r, c) for r, c in counts.items()}
    assert HangReport.behind(others[0], others, GROUP) == named


def test_behind_names_the_silent_ranks_and_counts_only_this_ranks_group():
    """A rank that wrote no report is named whatever the counts; a rank of another group
    (fewer collectives on its own group) is not compared with this group's."""
    others = {0: report(0, 7), 1: report(1, 7), 3: report(3, 7)}
    assert HangReport.behind(others[0], others, GROUP) == [2]
    others[2] = report(2, 1, group=[2, 3])
    assert HangReport.behind(others[0], others, GROUP) == []


class Clock:
    """time for hang_report: monotonic() is the fake now, sleep() moves it on and delivers
    the reports due by then (arrivals: {seconds after the start: (rank, report)})."""

    def __init__(self, folder, arrivals):
        self.folder, self.arrivals, self.start = folder, dict(arrivals), 1000.0
        self.now = self.start

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds
        for at in sorted(self.arrivals):
            if at <= self.now - self.start:
                rank, rep = self.arrivals.pop(at)
                (self.folder / f"rank{rank}.json").write_text(json.dumps(rep))


def explain(tmp_path, monkeypatch, arrivals, timed_out, timeout_s=30):
    """Rank 0 of 4, blocked in all_reduce #5 over GROUP, explains a failure with
    `timeout_s`; returns (its line, seconds it waited on the clock)."""
    comm = SimpleNamespace(waiting=report(0, 5), where={})
    hangs = HangReport(str(tmp_path), 0, 4, comm, timeout_s)
    clock = Clock(tmp_path / "hang", arrivals)
    (tmp_path / "hang").mkdir()
    monkeypatch.setattr(hang_report, "time", clock)
    line = str(hangs.explain(UserError("all_reduce gave up waiting"), RuntimeError("gloo"),
                             timed_out))
    waited = clock.now - clock.start
    print(f"waited {waited:.1f} s on the clock: {line}")
    return line, waited


def test_after_a_peer_left_explain_returns_within_about_two_seconds(tmp_path, monkeypatch):
    """A peer left (a connection error, not a timeout; parallel.timeout_s 30): rank 1's
    report comes 1 s late, rank 3's at once, rank 2 never writes one: explain returns
    within 2.5 s (GONE_GRACE_S 2 s and one 0.1 s poll), rank 1's report read and rank 2
    named as the one without. Red when it waits the timeout's grace (30 s) instead."""
    line, waited = explain(tmp_path, monkeypatch, {0.0: (3, report(3, 5)), 1.0: (1, report(1, 5))},
                           timed_out=False)
    assert 2.0 <= waited <= 2.5, f"waited {waited:.1f} s after a peer left"
    assert "rank(s) 2 behind (no report" in line, line


def test_after_a_timeout_explain_reads_a_report_that_comes_3_s_late(tmp_path, monkeypatch):
    """A collective timed out (parallel.timeout_s 30): rank 2's report comes 3 s late (it
    gave up later, waiting on rank 3, whose report comes at once); explain waits for it
    and names rank 2, 4 collectives into the group where the others are 5, returning once
    every report is in (by 3.5 s). Red when it waits only GONE_GRACE_S (2 s: rank 2 named
    as having written none)."""
    arrivals = {0.0: (1, report(1, 5)), 0.5: (3, report(3, 5)), 3.0: (2, report(2, 4))}
    line, waited = explain(tmp_path, monkeypatch, arrivals, timed_out=True)
    assert "rank(s) 2 behind (fewer collectives into the group)" in line, line
    assert 3.0 <= waited <= 3.5, f"waited {waited:.1f} s for a report 3 s late"
