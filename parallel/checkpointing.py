"""`trainer.activation_checkpointing`: recompute each transformer block in backward.

Applied from outside the model: every block's `forward` (the instance
attribute, so module hooks still run around it) becomes
`torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)`. A block
then keeps only its input for backward; when backward reaches it, its forward
runs again (under the same autocast state) to rebuild what it saved, and the
memory of one block's activations is used at a time. The cost: one more
forward per block, about a third more compute.

What recompute must reproduce, for the gradients to be those of the run
without checkpointing:
- dropout masks: checkpoint saves the default generator's state at the
  block's entry and replays it (preserve_rng_state). Tensor parallelism
  also draws attention dropout from the TP rank's own stream (TPRandom),
  which checkpoint does not know about: the block's entry value of that
  stream is captured here and put back around the recompute, then the live
  stream is restored (a 1F1B pipeline runs later micro-batches' forwards
  between recomputes).
- sharded parameters: fsdp stage 3 frees a block after its forward and
  gathers it again from a hook on the block's output gradient, which fires
  before the block's backward and so before the recompute: the recompute
  finds the parameters gathered. Recompute calls `forward`, not the module,
  so the gather/free hooks do not run twice.
- tensor parallelism: recompute repeats the block's forward collectives
  (2 per block and micro-batch), as Megatron's full recompute does.
"""

import torch
from torch.utils.checkpoint import checkpoint

from parallel import model_plan as plan


def checkpoint_blocks(gpt, tp_random=None):
    """Make every block of `gpt` (a ModuleList, or a pipeline stage's ModuleDict)
    recompute in backward. tp_random: the TP context's TPRandom, if any."""
    for _, block in plan.blocks(gpt):
        if not getattr(block, "checkpointed", False):
            block.forward = _recomputed(block.forward, tp_random)
            block.checkpointed = True


def _recomputed(forward, tp_random):
    def run(x):
        if not torch.is_grad_enabled():  # evaluation: nothing to save
            return forward(x)
        entry = {"own": tp_random.own_state if tp_random is not None else None, "calls": 0}

        def body(x):
            entry["calls"] += 1
            if tp_random is None or entry["calls"] == 1:
                return forward(x)
            live, tp_random.own_state = tp_random.own_state, entry["own"]
            try:
                return forward(x)  # the recompute: the TP stream as at the block's entry
            finally:
                tp_random.own_state = live
        return checkpoint(body, x, use_reentrant=False, preserve_rng_state=True)
    return run
