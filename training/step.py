"""One step's computation: the trainer's, and mode=dryrun's (planner/dryrun.py).

Everything it reads is a function of (config, step): the data position (the caller's
micro-batches, char_dataset.GlobalBatches), the LR (lr_at) and the random state (reseed).
So a snapshot needs only the step, the model and the optimizer to continue exactly, under
any layout, and a resumed run's losses equal an uninterrupted run's.
"""

import math


def lr_at(step: int, t) -> float:
    """Linear warm-up to t.lr, then cosine decay to t.min_lr at t.max_steps."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


def reseed(strategy, t, step):
    """Dropout etc. draw from streams fixed by (seed, step) and the rank's place in the
    grid (Strategy.reseed): resumable, under any layout."""
    strategy.reseed((t.seed * 1_000_003 + step) * 1_009)


def compute_step(strategy, micro, step, t, group, meter):
    """Step `step` (from 0) on this rank's micro-batches: forward and backward under the
    activation meter `meter`; the sum of replica group `group`'s shares over the live
    groups (fault_tolerance/: the plain run's group is alone); the clip; the optimizer step
    if the groups' vote commits it, then the group told (a replica group starts the next
    step's quorum while this one ends). Returns (loss, pre-clip gradient norm, lr), on the
    device, unread; None when voted down: the step is dropped, to be redone."""
    reseed(strategy, t, step)
    with meter:
        loss = strategy.loss_and_gradients(micro)
    loss = group.sum_across(loss, strategy.grads())  # this group's shares -> the global batch
    scale = strategy.precision.state()  # fp16: a dropped step keeps its scale
    lr = lr_at(step, t)
    # the pre-clip global norm, logged: it exposes summed-instead-of-averaged
    # gradients, which AdamW's scale invariance hides from the loss
    grad_norm = strategy.clip_gradients(t.grad_clip if t.grad_clip > 0 else math.inf)
    if not group.commit():  # a replica group failed in it
        strategy.drop_step(lr)
        strategy.precision.load_state(scale)
        strategy.comm_stats()  # the dropped step's traffic is not the next one's
        return None
    strategy.optimizer_step(lr)
    group.stepped(step + 1 < t.max_steps)  # the weights are final: the next quorum may start
    return loss, grad_norm, lr
