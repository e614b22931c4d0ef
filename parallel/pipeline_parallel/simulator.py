"""Run every pipeline rank's plan (p2p_plan.plan, what the executor runs) against
the others, without tensors, under a backend's rules for point-to-point batches:

- "buffered" (gloo): a send completes as soon as it is posted; a rank blocks
  only where an action needs a receive that has not arrived;
- "nccl": a rank's batches run strictly one after another, and an operation
  completes only when its partner is posted too (a send waits for its
  receive): a rank blocks on every batch until all of it is matched.

As on both backends, the k-th send from a to b matches the k-th receive on b
from a, whatever the messages: a plan that pairs them out of order is reported,
as is an action run before its input arrived or a send of a message not yet
computed. Raises RuntimeError naming what each stuck rank waits for (a hang).
"""

from parallel.pipeline_parallel.p2p_plan import plan
from parallel.pipeline_parallel.schedules import messages

MODES = ("buffered", "nccl")


def simulate(schedule, P, M, V=1, mode="buffered", steps=None):
    """Returns ({(src, dst): [message, ...] in send order}, the same in receive order).
    steps: the plan to run (default: p2p_plan.plan's)."""
    assert mode in MODES, mode
    steps = plan(schedule, P, M, V) if steps is None else steps
    where = f"{schedule} P={P} M={M} V={V} ({mode})"
    sent, recvs = {}, {}          # (src, dst) -> messages in posting order
    produced = [set() for _ in range(P)]
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
        for src, msg in messages(action, P, V)[0]:
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
                    if not has_input(r, step.action):
                        return moved
                    produced[r].update(msg for _, msg in messages(step.action, P, V)[1])
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
