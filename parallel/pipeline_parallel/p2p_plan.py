"""When each pipeline rank posts each send and receive: the one batching that the
executor (pipeline.py) runs and the simulator (simulator.py) checks.

A rank's plan is a list of Steps: run `action` (if any), then post `sends` and
`recvs` as one batch (`batch_isend_irecv`). An action waits only for the receive
of its own input, which an earlier step posted.
"""

from collections import namedtuple

from parallel.pipeline_parallel.schedules import build, messages

# action: (kind, chunk, micro-batch) or None; sends / recvs: [(peer pp rank, message)]
Step = namedtuple("Step", "action sends recvs")


def plan(schedule, P, M, V=1):
    """Every pipeline rank's Steps (a list per rank): each action's output is sent in
    one batch with the receive of the rank's next action's input."""
    steps = []
    for r in range(P):
        actions = build(schedule, P, M, V, r)
        first = messages(actions[0], P, V)[0] if actions else []
        mine = [Step(None, [], first)] if first else []
        for k, action in enumerate(actions):
            following = messages(actions[k + 1], P, V)[0] if k + 1 < len(actions) else []
            mine.append(Step(action, messages(action, P, V)[1], following))
        steps.append(mine)
    return steps
