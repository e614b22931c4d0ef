"""Test-only: main.py, except that this replica group SIGKILLs itself in a chosen step.

    python tests/ft_kill_worker.py --die-at-step=3 ft.enabled=true ft.replica_id=0 ...

Before the quorum of the first step numbered 3 or later that the group would compute
(it has committed and snapshotted the step before: the quorum that ReplicaGroup.stepped
starts as that step ends is started here after its snapshot and record, with the read
ahead, next_shares), the process prints `DYING at step <n>` and sends itself SIGKILL: a group lost at a step the test chooses, so that the
others' quorum of that step goes on without it once its heartbeat stops
(tests/test_fault_tolerance.py). (Killed inside the step instead, one survivor of three
would wait ft.timeout_s in its ring all-reduce for a peer that gave up on it.) Everything
else is main.run_and_exit, unchanged.
"""

import os
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fault_tolerance.replica_group import ReplicaGroup  # noqa: E402
import main  # noqa: E402

FLAG = "--die-at-step="
die_at = int(next(a for a in sys.argv[1:] if a.startswith(FLAG))[len(FLAG):])
start_quorum, stepped, next_shares = (ReplicaGroup._start_quorum, ReplicaGroup.stepped,
                                      ReplicaGroup.next_shares)


def dying_start_quorum(self):
    step = self.manager.current_step() + 1  # the quorum's step: after the last committed
    if step >= die_at:
        print(f"DYING at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return start_quorum(self)


def stepped_later(self, more):
    self.more = more


def next_shares_then_stepped(self):
    stepped(self, self.more)
    return next_shares(self)


ReplicaGroup._start_quorum = dying_start_quorum
ReplicaGroup.stepped, ReplicaGroup.next_shares = stepped_later, next_shares_then_stepped

if __name__ == "__main__":
    sys.argv = [os.path.join(REPO, "main.py")] + [a for a in sys.argv[1:] if not a.startswith(FLAG)]
    main.run_and_exit()
