"""The lighthouse: torchft's quorum service, and how a replica group waits for it.

    python main.py mode=lighthouse ft.lighthouse=HOST:PORT ft.min_replicas=N

runs it in the foreground until SIGINT or SIGTERM. Every group's main rank heartbeats to
it and asks it, before every step, which groups are alive; it answers once every
heartbeating group has asked (or JOIN_TIMEOUT_MS passed) and at least ft.min_replicas did.
"""

import os
import signal
import socket
import threading
import time

from errors import UserError
from fault_tolerance.config import host_port

# a group silent this long is dead: the survivors' next quorum goes on without it
HEARTBEAT_TIMEOUT_MS = 3000
# a live group that has not asked for the next quorum yet (a slow step, a group starting
# up) is waited for this long before the others go on without it (it joins a later step)
JOIN_TIMEOUT_MS = 5000


def serve(ft):
    """mode=lighthouse: serve until a stop signal. Returns when stopped."""
    # a line per quorum request otherwise (each group's every step); RUST_LOG=info shows them
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer
    _, port = host_port(ft.lighthouse)
    try:
        server = LighthouseServer(bind=f"[::]:{port}", min_replicas=ft.min_replicas,
                                  join_timeout_ms=JOIN_TIMEOUT_MS,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    except Exception as e:  # the port taken, no permission, ...
        raise UserError(f"cannot start the lighthouse on port {port}: {e}") from None
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    print(f"lighthouse: serving {server.address()} (ft.lighthouse={ft.lighthouse}), quorum of at "
          f"least {ft.min_replicas} group{'s' if ft.min_replicas > 1 else ''}; stop with Ctrl-C",
          flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("lighthouse: stopped", flush=True)


def answers(address, timeout_s=2.0):
    """Whether something accepts connections at ft.lighthouse now: after a failed quorum,
    it tells a group that was away (stopped, a paused VM) from a lighthouse that is gone."""
    try:
        with socket.create_connection(host_port(address), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_for(address, timeout_s, say=None):
    """Return once something accepts connections at ft.lighthouse, or raise the one error
    a user needs after timeout_s (torchft itself would retry for its own timeouts, then fail
    with a Rust error chain). A group waits here with its model built and its data open,
    so it joins the moment the lighthouse answers. say: prints the line saying it waits."""
    host, port = host_port(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as e:
            if say is not None:
                say(f"ft: waiting up to ft.timeout_s={timeout_s:g} s for the lighthouse at "
                    f"{address}")
                say = None
            last = e
        if time.monotonic() >= deadline:
            raise UserError(f"no lighthouse at ft.lighthouse={address} after ft.timeout_s="
                            f"{timeout_s:g} s ({last.strerror or last}): start one with `python "
                            f"main.py mode=lighthouse ft.lighthouse={address} ft.min_replicas=N` "
                            "and point every group at it")
        time.sleep(0.2)
