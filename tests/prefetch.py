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
"""

import os
import threading


SLACK = 4             # a session run ahead may take this many times its own timeout
GLOO_TIMEOUT_S = 900  # dp_worker.serve's timeout for a session run ahead

_lock = threading.Condition()
_queue = []           # specs not started yet, in the order the tests ask for them
_running = {}         # key -> the Popen of the session running ahead (None until started)
_done = {}            # key -> what run(spec) returned
_thread = None
_stopped = False
_kill = None          # start's `kill`


def key(spec):
    """A session's identity: (script, world, args); its timeout (spec[2]) is not part of it."""
    script, world, _timeout, *args = spec
    return script, world, tuple(args)


def start(specs, run, kill):
    """Run `run(spec, background=True)` for each spec (script, world, timeout, *args) in
    turn on a thread of its own; `run` starts the session with `idle_priority` as its
    preexec_fn and reports its launcher with `started` (harness._run_worker); `kill(pid)`
    ends a launch with every process below it (harness.kill_tree)."""
    global _thread, _kill
    _kill = kill
    with _lock:
        known = {key(s) for s in _queue} | set(_done) | set(_running)
        for spec in specs:
            if key(spec) not in known:
                _queue.append(tuple(spec))
                known.add(key(spec))
    if _thread is None and _queue:
        _thread = threading.Thread(target=_work, args=(run,), daemon=True, name="prefetch")
        _thread.start()


def _work(run):
    while True:
        with _lock:
            if not _queue:
                return
            spec = _queue.pop(0)
            _running[key(spec)] = None
        result = run(spec, background=True)
        with _lock:
            _running.pop(key(spec), None)
            _done[key(spec)] = result
            _lock.notify_all()


def claim(wanted):
    """(True, result) when the session `wanted` (a key) was run ahead, waiting for it if
    it is still running; (False, None) when the caller runs it itself (never queued, or
    taken off the queue now)."""
    with _lock:
        for spec in _queue:
            if key(spec) == wanted:
                _queue.remove(spec)
                return False, None
        while wanted in _running:
            _lock.wait()
        if wanted in _done:
            return True, _done.pop(wanted)
    return False, None


def started(session, proc):
    """Called by `run` with the session's launcher, so that stop() can end it."""
    with _lock:
        if session in _running:
            _running[session] = proc
        late = _stopped
    if late:  # the test session ended while this one was starting
        _kill(proc.pid)


def stop():
    """At the end of the session: nothing more starts, and what runs is killed."""
    global _stopped
    with _lock:
        _stopped = True
        _queue.clear()
        procs = [p for p in _running.values() if p is not None]
    for proc in procs:
        _kill(proc.pid)
    if _thread is not None:  # a session starting now kills itself (started); wait for that
        _thread.join(timeout=60)


def idle_priority():
    """In the child before exec (inherited by torchrun's workers): the idle CPU policy."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def env_for_background(env):
    return dict(env, TEST_WORKER_TIMEOUT_S=str(GLOO_TIMEOUT_S))

