"""The global gradient norm across shards, and the clip: written once, for every strategy.

Sharded elements are summed over the ranks holding them (the strategy's `norm_group`),
replicated ones counted on one replica (Region.in_norm), from the strategy's `regions()`.
fp16: gradients are unscaled first, and a step whose gradients overflowed anywhere is
skipped by every rank (Precision.skip_step; the Strategy's optimizer step reads it).
Norm and scaling run as foreach kernels (one launch for all tensors, not one per tensor).
"""

import torch

from parallel.placement import by_device, grad_norm_squared


def clip_gradients(dp, precision, grads, max_norm) -> torch.Tensor:
    """Scale `grads` (every gradient this rank holds, each once) so their global norm is
    at most max_norm; return the norm before, a 0-d tensor on the device (not read).
    dp: the data-parallel strategy (its regions and norm group)."""
    precision.unscale_and_check(grads)
    sq = grad_norm_squared(dp.regions(), dp.device)
    group = dp.norm_group()
    if group is not None:
        dp.comm.all_reduce(sq, group=group)
    norm = sq.sqrt()
    if not precision.skip_step:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for device, on_it in by_device(grads).items():  # offloaded gradients: in host memory
            torch._foreach_mul_(on_it, coef.to(device))
    return norm
