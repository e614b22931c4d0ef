"""Run every pipeline rank's plan (p2p_plan.plan, what the executor runs) against
the others, without tensors, under a backend's rules for point-to-point batches:

- "buffered" (gloo): a send completes as soon as it is posted; a rank blocks
  only where an action needs a receive that has not arrived;
- "nccl": a rank's batches run strictly one after another, and an operation
  completes only when its partner is posted too (a send waits for its
  receive): a rank blocks on every batch until all of it is matched.

A B before its own F, or a W before its own B, is reported too.
As on both backends, the k-th send from a to b matches the k-th receive on b
from a, whatever the messages: a plan that pairs them out of order is reported,
as is an action run before its input arrived or a send of a message not yet
computed. Raises RuntimeError naming what each stuck rank waits for (a hang).
"""

from parallel.pipeline_parallel.p2p_plan import plan
from parallel.pipeline_parallel.schedules import chunk_ranks, messages

MODES = ("buffered", "nccl")


def simulate(schedule, P, M, V=1, mode="buffered", steps=None):
    """Returns ({(src, dst): [message, ...] in send order}, the same in receive order).
    steps: the plan to run (default: p2p_plan.plan's)."""
    assert mode in MODES, mode
    steps = plan(schedule, P, M, V) if steps is None else steps
    where = f"{schedule} P={P} M={M} V={V} ({mode})"
    ranks = chunk_ranks(schedule, P, V)
    sent, recvs = {}, {}          # (src, dst) -> messages in posting order
    produced = [set() for _ in range(P)]
    ran = [set() for _ in range(P)]  # actions each rank has run
    at = [0] * P                  # the step each rank is in
    batch = [None] * P            # the operations of that step's batch, once posted

    def matched(pair, k):
        """The k-th receive of pair (src, dst) has its send: check they are the same message."""
        if len(sent.get(pair, [])) <= k or len(recvs.get(pair, [])) <= k:
            return False
        if sent[pair][k] != recvs[pair][k]:
            raise RuntimeError(f"{where}: rank {pair[1]}'s receive of {recvs[pair][k]} from "
                               f"rank {pair[0]} is matched with the send of {sent[pair][k]}")
        return True

    def has_input(r, action):
        for src, msg in messages(action, ranks)[0]:
            if src == r:  # from another chunk of this rank, in memory
                if msg not in produced[r]:
                    return False
                continue
            posted = recvs.get((src, r), [])
            if msg not in posted or not matched((src, r), posted.index(msg)):
                return False
        return True

    def post(r, step):
        ops = []
        for dst, msg in step.sends:
            if msg not in produced[r]:
                raise RuntimeError(f"{where}: rank {r} sends {msg} before computing it")
            ops.append(((r, dst), len(sent.setdefault((r, dst), []))))
            sent[(r, dst)].append(msg)
        for src, msg in step.recvs:
            ops.append(((src, r), len(recvs.setdefault((src, r), []))))
            recvs[(src, r)].append(msg)
        return ops

    def advance(r):
        """Take rank r as far as its rules let it; True if it moved."""
        moved = False
        while at[r] < len(steps[r]):
            step = steps[r][at[r]]
            if batch[r] is None:  # the action first, then its batch
                if step.action is not None:
                    kind, c, m = step.action
                    needs = {"B": "F", "W": "B"}.get(kind)  # what must have run here before
                    if needs and (needs, c, m) not in ran[r]:
                        raise RuntimeError(f"{where}: rank {r} runs {step.action} before {needs}")
                    if not has_input(r, step.action):
                        return moved
                    ran[r].add(step.action)
                    produced[r].update(msg for _, msg in messages(step.action, ranks)[1])
                batch[r], moved = post(r, step), True
            if mode == "nccl" and not all(matched(pair, k) for pair, k in batch[r]):
                return moved  # this batch, and so every later one, waits for its partners
            at[r], batch[r], moved = at[r] + 1, None, True
        return moved

    while any(at[r] < len(steps[r]) for r in range(P)):
        if not any([advance(r) for r in range(P)]):
            stuck = {r: (f"batch {steps[r][at[r]].sends + steps[r][at[r]].recvs} waits for its "
                         "partners" if batch[r] is not None else
                         f"{steps[r][at[r]].action} waits for its input")
                     for r in range(P) if at[r] < len(steps[r])}
            raise RuntimeError(f"{where} hangs: {stuck}")
    for pair in set(sent) | set(recvs):
        for k in range(max(len(sent.get(pair, [])), len(recvs.get(pair, [])))):
            if not matched(pair, k):
                raise RuntimeError(f"{where}: pair {pair} has a send or receive without partner")
    return sent, recvs


def unit_time(schedule, P, M, V=1):
    """The step's length when every F, B and W of a chunk takes one unit (a whole backward
    two), each rank runs its actions in order as soon as their inputs exist, and messages
    are free: (makespan, bubble = idle share of all ranks' time). The textbook model the
    schedules are drawn in (Qi et al. 2023): 1F1B gives 3M + 3(P - 1) for V = 1, ZB-H1
    3M + P - 1."""
    from parallel.pipeline_parallel.schedules import SCHEDULES, build
    split = SCHEDULES[schedule].split_backward
    lists = [build(schedule, P, M, V, r) for r in range(P)]
    last = P * V - 1
    cost = {"F": 1, "B": 1 if split else 2, "W": 1}
    done, clock, at = {}, [0] * P, [0] * P
    while any(at[r] < len(lists[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while at[r] < len(lists[r]):
                kind, c, m = lists[r][at[r]]
                needs = {"F": [("F", c - 1, m)] if c > 0 else [],
                         "B": [("F", c, m)] + ([("B", c + 1, m)] if c < last else []),
                         "W": [("B", c, m)]}[kind]
                if not all(n in done for n in needs):
                    break
                start = max([clock[r]] + [done[n] for n in needs])
                done[kind, c, m] = clock[r] = start + cost[kind]
                at[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"{schedule} P={P} M={M} V={V} cannot finish in unit time")
    makespan = max(clock)
    busy = sum(cost[a[0]] for lst in lists for a in lst)
    return makespan, 1 - busy / (P * makespan)
