"""Worker sessions run ahead of the tests that read them, on CPU the tests leave idle.

A worker's session (harness.worker_result: layout_worker.py on 8 ranks, the compile
worker, ...) costs tens of seconds of CPU, while the suite spends about a fifth of its
time with a core idle: an interpreter starting alone, a test waiting for a signal to
land, pytest's own work between jobs. So once pytest has collected the tests,
conftest.py starts the sessions their modules declare (`pytestmark =
pytest.mark.worker_sessions((script, world, timeout, *args), ...)`), one at a time in
the order the tests will ask for them, under SCHED_IDLE (nice 19 where Linux's idle
policy is missing): the kernel gives them a core only when no test wants it, so the
tests keep the CPU they use. A test that asks for a session still running waits for it
(and the session then has the CPU); one still queued, the test runs itself, as before.

What a worker computes and reports is the same either way; only when its CPU is spent
changes. A starved rank can keep its peers waiting in a collective far longer than in
the foreground, so a session run ahead gets a longer gloo timeout
(TEST_WORKER_TIMEOUT_S, read by dp_worker.serve) and launch timeout (SLACK x its own);
a hang still fails the test that reads the session.

No thread: the queue moves between tests (conftest.py calls advance() after each one) and
when a test claims a session. A thread in pytest's process would hold locks that a fork
made there (data/prepare.py's worker pool) copies locked.
"""

import os
import subprocess
import time

SLACK = 4             # a session run ahead may take this many times its own timeout
GLOO_TIMEOUT_S = 900  # dp_worker.serve's timeout for a session run ahead

_queue = []           # specs not started yet, in the order the tests ask for them
_running = None       # (spec, handle, deadline) of the session running ahead
_done = {}            # key -> its outcome
_hooks = {}           # start's launch, finish and kill


def key(spec):
    """A session's identity: (script, world, args); its timeout (spec[2]) is not part of it."""
    script, world, _timeout, *args = spec
    return script, world, tuple(args)


def start(specs, launch, finish, kill):
    """Queue the specs (script, world, timeout, *args) to run one after another ahead of
    the tests: `launch(spec)` starts one in the background (idle priority, output kept)
    and returns its handle (its launcher's Popen first); `finish(spec, handle, hung)`
    returns its outcome; `kill(pid)` ends a launch with every process below it."""
    _hooks.update(launch=launch, finish=finish, kill=kill)
    known = {key(s) for s in _queue} | set(_done) | ({key(_running[0])} if _running else set())
    for spec in specs:
        if key(spec) not in known:
            _queue.append(tuple(spec))
            known.add(key(spec))
    advance()


def advance():
    """Between tests: collect the session running ahead if it has ended (or passed its
    deadline), and start the next one."""
    global _running
    if _running is not None:
        spec, handle, deadline = _running
        if handle[0].poll() is None and time.time() < deadline:
            return
        _collect(handle[0].poll() is None)
    if _queue:
        spec = _queue.pop(0)
        _running = spec, _hooks["launch"](spec), time.time() + spec[2] * SLACK


def _collect(hung):
    global _running
    spec, handle, _ = _running
    _running = None
    _done[key(spec)] = _hooks["finish"](spec, handle, hung)


def claim(wanted):
    """(True, outcome) when the session `wanted` (a key) was run ahead, waiting for it if
    it is still running; (False, None) when the caller runs it itself (never queued, or
    taken off the queue now)."""
    for spec in _queue:
        if key(spec) == wanted:
            _queue.remove(spec)
            return False, None
    if _running is not None and key(_running[0]) == wanted:
        proc, deadline = _running[1][0], _running[2]
        try:
            proc.wait(timeout=max(0, deadline - time.time()))
        except subprocess.TimeoutExpired:  # past its deadline: finish kills it
            pass
        _collect(proc.poll() is None)
        advance()
    if wanted in _done:
        return True, _done.pop(wanted)
    return False, None


def stop():
    """At the end of the session: nothing more starts, and what runs is killed."""
    global _running
    _queue.clear()
    if _running is not None:
        _hooks["kill"](_running[1][0].pid)
        _running = None


def idle_priority():
    """In the child before exec (inherited by torchrun's workers): the idle CPU policy."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def env_for_background(env):
    return dict(env, TEST_WORKER_TIMEOUT_S=str(GLOO_TIMEOUT_S))
