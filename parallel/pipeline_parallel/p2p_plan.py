"""When each pipeline rank posts each send and receive: the one batching that the
executor (pipeline.py) runs and the simulator (simulator.py) checks.

A rank's plan is a list of Steps: run `action` (if any), then post `sends` and
`recvs` as one batch (`batch_isend_irecv`). An action waits only for the receive
of its own input, which an earlier step posted.

Why batches need a plan: NCCL runs a group's batches strictly one after another,
and a large send completes only when the peer has posted the matching receive;
gloo buffers sends. "Post each send with the next receive this rank needs" works
on gloo but can hang on NCCL (interleaved 1F1B, M >= 2P: each of two ranks waits
on a batch whose partner is in the other's next batch).

Rounds. All ranks run their schedules in lock-step ticks: at tick t every rank
whose next action has its input (produced at a tick before t) runs it. A message
produced at tick t travels in round t: the sender posts it right after computing
it, and the receiver posts the receive in its batch of the same round, before its
action of tick t + 1, needed yet or not. Every rank's batches are in round order,
both ends of a message are in batches of the same round, and a rank produces at
most one message per tick, so two ranks exchange at most one message per round
(no order to agree on inside a batch). A message between two chunks of one rank
(zbv's bottom of the V) is no send: the executor hands it over in memory. That cannot hang under NCCL's rules: take
the lowest round r with a batch not complete; every rank with a batch in round r
has posted it (its earlier batches are complete and its computes need only
those), and the partner of each of its operations is in round r too, posted:
every batch of round r completes, then round r + 1, ...
"""

from collections import namedtuple

from parallel.pipeline_parallel.schedules import build, chunk_ranks, messages

# action: (kind, chunk, micro-batch) or None; sends / recvs: [(peer pp rank, message)]
Step = namedtuple("Step", "action sends recvs")


def plan(schedule, P, M, V=1):
    """Every pipeline rank's Steps (a list per rank). Raises RuntimeError if the
    schedule itself can never finish (an action whose input is never produced)."""
    lists = [build(schedule, P, M, V, r) for r in range(P)]
    ranks = chunk_ranks(schedule, P, V)
    pos, produced = [0] * P, set()
    steps = [[] for _ in range(P)]
    while any(pos[r] < len(lists[r]) for r in range(P)):
        ready = [r for r in range(P) if pos[r] < len(lists[r])
                 and all(msg in produced for _, msg in messages(lists[r][pos[r]], ranks)[0])]
        if not ready:
            stuck = {r: lists[r][pos[r]] for r in range(P) if pos[r] < len(lists[r])}
            raise RuntimeError(f"{schedule} P={P} M={M} V={V} never finishes: waiting {stuck}")
        actions, sends, recvs = {}, {r: [] for r in range(P)}, {r: [] for r in range(P)}
        for r in ready:  # this tick's actions; their messages travel in this round
            actions[r] = lists[r][pos[r]]
            pos[r] += 1
            for dst, msg in messages(actions[r], ranks)[1]:
                produced.add(msg)
                if dst != r:  # else handed over in memory
                    sends[r].append((dst, msg))
                    recvs[dst].append((r, msg))
        for r in range(P):
            if r in actions or sends[r] or recvs[r]:
                steps[r].append(Step(actions.get(r), sorted(sends[r]), sorted(recvs[r])))
    return steps
