"""A step whose gradients are not finite never reaches the weights (fp32 and bf16; fp16's
loss scaler skips its own overflows: precision.py).

The pre-clip global norm (clipping.py) is already summed over every rank's gradients, each
element once: an inf or a NaN anywhere makes it non-finite on every rank, so whether to
skip is agreed without another collective. A skipped step leaves the weights, AdamW's state
(its step count included) and DeepSeek-V3's choice biases as they were, on every rank; the
data moves on, and the trainer counts it (telemetry/loss_watch.py).

Where reading the flag would wait for a device, nothing reads it: fused AdamW (CUDA's, and
the host's under parallel.offload) takes it as `found_inf`, as torch.amp.GradScaler hands
it, and skips inside its kernel. foreach AdamW, the CPU's (kept so that CPU runs compute
what they did), has no such input: there the flag is read, on the host, which waits for
nothing.
"""

import torch


def not_finite(norm) -> torch.Tensor:
    """A 0-d bool tensor, on the norm's device: the step's gradients hold an inf or a NaN."""
    return ~torch.isfinite(norm)


def step_unless(optimizer, found):
    """optimizer.step(), skipped if `found` (not_finite's) is true."""
    if not optimizer.defaults.get("fused"):
        if not bool(found):  # foreach: the CPU's, a host read that waits for nothing
            optimizer.step()
        return
    device = optimizer.param_groups[0]["params"][0].device
    optimizer.found_inf = found.to(device=device, dtype=torch.float32)  # fused: no read
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
