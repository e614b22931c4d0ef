"""Killing a torchrun launch with every process below it (tests and benchmarks that kill jobs).

torchrun starts each worker in a session of its own (torch 2.13), so killing the
launcher's process group leaves the ranks running: they would finish the job and write
its last snapshot. The launcher is stopped first, so it can neither start nor restart a
worker while its tree is collected. Linux only (/proc).
"""

import glob
import os
import signal
import time


def workers_of(launcher_pid):
    """PIDs of the processes whose parent is `launcher_pid` (for torchrun: the ranks)."""
    pids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == launcher_pid:
            pids.append(int(stat.split("/")[2]))
    return sorted(pids)


def alive(pid):
    """Running (not gone, not a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_tree(launcher_pid, timeout=10, children=workers_of):
    """SIGKILL a launcher and every process below it, and wait up to `timeout` s until they
    are gone. Returns (the processes below the launcher, those still alive after it).
    Each process is stopped before its children are listed, so none starts another
    unseen. `children(pid)`: the processes below `pid` (the tests' fork server adds the
    process it forked for a stand-in)."""
    try:
        os.kill(launcher_pid, signal.SIGSTOP)
    except ProcessLookupError:
        return [], []
    tree, todo = [launcher_pid], [launcher_pid]
    while todo:
        found = [pid for pid in children(todo.pop()) if pid not in tree]
        for pid in found:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        tree += found
        todo += found
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + timeout
    while any(alive(pid) for pid in tree[1:]) and time.time() < deadline:
        time.sleep(0.01)
    return tree[1:], [pid for pid in tree[1:] if alive(pid)]
