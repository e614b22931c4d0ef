"""Test-only: stands in for `python`, the process forked by tests/fork_server.py.

fork_server.py copies this file behind a shebang of the real interpreter (with -I -S: no
site, so it starts in milliseconds) as DIR/python. Run as `DIR/python [-u] SCRIPT ARGS`
(or -m MODULE, -c CODE), it asks the server at $FORK_SERVER_SOCKET for a forked process
running that, forwards signals to it and leaves as it leaves. Anything else (other
interpreter options, no server, a refusal) starts the real interpreter in its place.
"""

import json
import os
import signal
import socket
import sys

REAL_PYTHON = None  # the copy's first lines set it
FORWARDED = [s for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD)]


def parse(argv):
    """{"kind", "target", "args", "unbuffered"} of python's command line, or None."""
    unbuffered, i = False, 0
    while i < len(argv) and argv[i] == "-u":
        unbuffered, i = True, i + 1
    if i < len(argv) and argv[i] in ("-m", "-c") and i + 1 < len(argv):
        kind = "module" if argv[i] == "-m" else "code"
        return dict(kind=kind, target=argv[i + 1], args=argv[i + 2:], unbuffered=unbuffered)
    if i < len(argv) and not argv[i].startswith("-"):
        return dict(kind="script", target=argv[i], args=argv[i + 1:], unbuffered=unbuffered)
    return None


def real(argv):
    os.execv(REAL_PYTHON, [REAL_PYTHON, *argv])


def main(argv):
    request, path = parse(argv), os.environ.get("FORK_SERVER_SOCKET")
    if request is None or not path:
        real(argv)
    # signals wait until the pid they go to is known
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    request.update(env=dict(os.environ), cwd=os.getcwd(), umask=os.umask(0o22), pid=os.getpid(),
                   sched=(os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)))
    os.umask(request["umask"])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        reply = conn.makefile("rb")
        first = reply.readline().decode().split(" ", 1)
    except OSError:
        first = ["gone"]
    if first[0] != "pid":
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        real(argv)
    pid = int(first[1])
    for sig in FORWARDED:
        try:
            signal.signal(sig, lambda sig, _frame: os.kill(pid, sig))
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    line = reply.readline().decode().split()  # a forwarded signal does not interrupt it (PEP 475)
    if not line:  # the server died: so did the process
        sys.stderr.write("forked_python: the fork server went away\n")
        os._exit(1)
    status = int(line[1])
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)  # die of the same signal, as the process did
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1:])
