"""`trainer.activation_checkpointing`: recompute transformer blocks in backward.

Applied from outside the model: every block's `forward` (the instance
attribute, so module hooks still run around it) becomes
`torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)`. A block
then keeps only its input for backward; when backward reaches it, its forward
runs again (under the same autocast state) to rebuild what it saved, and the
memory of one block's activations is used at a time. The cost: one more
forward per block, about a third more compute.

Two keys refine it (torchtitan's `ac_mode=selective` and `ac_freq`):
- `activation_checkpointing_mode=selective` keeps the outputs of the matrix
  products (mm, addmm, bmm, the fused attention kernels) and recomputes only
  the cheap operations between them (norms, GELU, softmax, dropout, adds):
  torch.utils.checkpoint's selective contexts with a per-op policy. Less
  memory saved than full, almost no extra FLOPs. A fused attention call with
  dropout on draws random numbers, so it is recomputed like every random op
  (saving it would shift the stream the recomputed dropouts draw from).
- `activation_checkpointing_every=n` recomputes block i only when i % n == 0
  (the canonical block index, so pipeline stages agree); the others keep all.

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

from contextlib import contextmanager

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from parallel import model_plan as plan
from telemetry.activation_meter import ActivationMeter

_aten = torch.ops.aten
SAVED_OPS = {getattr(_aten, name).default for name in (  # the matrix products selective keeps
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_grouped_mm") if hasattr(_aten, name)}


def keep_matmuls(ctx, func, *args, **kwargs):
    """The selective policy: save matrix products' outputs (unless the op draws dropout)."""
    if func in SAVED_OPS and not _dropout_p(func, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    """One checkpoint call's selective contexts. The outputs kept are also held for the
    activation meter (trainer.measure_activations), which cannot see checkpoint's cache,
    until the recompute has used them."""
    held = []

    def policy(ctx, func, *args, **kwargs):
        keep = keep_matmuls(ctx, func, *args, **kwargs)
        meter = ActivationMeter.active
        if keep == CheckpointPolicy.MUST_SAVE and meter is not None and not ctx.is_recompute:
            out = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else (ctx.op_output,)
            held.extend(meter.hold(t) for t in out if isinstance(t, torch.Tensor))
        return keep

    @contextmanager
    def recompute(context):
        with context:
            yield
        held.clear()
    forward_context, recompute_context = create_selective_checkpoint_contexts(policy)
    return forward_context, recompute(recompute_context)


def _dropout_p(func, args, kwargs):
    names = [a.name for a in func._schema.arguments]
    i = names.index("dropout_p") if "dropout_p" in names else len(args)
    return kwargs.get("dropout_p", args[i] if i < len(args) else 0.0)


def checkpoint_blocks(gpt, tp_random=None, mode="full", every=1):
    """Make the blocks of `gpt` (a ModuleList, or a pipeline stage's ModuleDict) whose
    canonical index is a multiple of `every` recompute in backward, all of it (full) or
    all but the matrix products (selective). tp_random: the TP context's TPRandom, if any."""
    for i, block in plan.blocks(gpt):
        if i % every == 0 and not getattr(block, "checkpointed", False):
            block.forward = _recomputed(block.forward, tp_random, mode == "selective")
            block.checkpointed = True


def _recomputed(forward, tp_random, selective=False):
    more = {"context_fn": _selective_contexts} if selective else {}
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
        return checkpoint(body, x, use_reentrant=False, preserve_rng_state=True, **more)
    return run
