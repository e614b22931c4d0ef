"""`trainer.precision`: fp32, bf16 or fp16 compute, with fp32 master weights.

The parameters, their gradients and AdamW's state stay fp32 whatever the
precision: only forward (and so backward) runs under `torch.autocast`, which
casts matmul inputs to bf16/fp16 on the fly. In this GPT the residual stream
stays fp32 (embeddings, LayerNorms and residual adds run in fp32; only the
outputs of matmuls are low precision), and the loss is computed in fp32
(autocast runs cross-entropy in fp32; the vocabulary-parallel loss upcasts
its logits itself).

fp16 needs a loss scaler: its range ends at 65504 and small gradients
underflow to zero, so the loss is multiplied by `scale` before backward,
gradients are divided by it again (`unscale_`) before anyone reads them
(clipping, the logged norm, AdamW), and a step whose gradients hold an inf or
a NaN is skipped. Gradients are sharded and partitioned across ranks (fsdp
shards, pipeline stages, TP slices), so whether *any* rank found one is
agreed in one scalar all-reduce (MAX) over the whole world, and every rank
skips that step together. The scale then halves; after `growth_interval`
steps without overflow it doubles (torch.amp.GradScaler's policy and
defaults). Its state (scale, good steps since the last change) goes into the
snapshot, so a resumed run continues exactly. bf16 has fp32's range: no scaler.

parallelize() makes one Precision per rank (parallel/parallelize.py, step 6), which the
Strategy, the pipeline and the step's forward and backward share: every forward runs in
`autocast()`, each backward's loss is multiplied by `loss_scale`, and
`unscale_and_check` runs before the gradient norm (parallel/clipping.py).
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist

from parallel.comm import checked_all_reduce
from parallel.placement import by_device

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """Dynamic loss scaling, as torch.amp.GradScaler (same defaults)."""

    def __init__(self, init_scale=2.0**16, growth_interval=2000, growth_factor=2.0,
                 backoff_factor=0.5):
        self.scale, self.good_steps = float(init_scale), 0
        self.growth_interval, self.growth_factor = growth_interval, growth_factor
        self.backoff_factor = backoff_factor
        self.skipped_steps = 0

    def update(self, found_inf):
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def state(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state(self, state: dict):
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def unscale_and_find_inf(grads, inv_scale, device):
    """Multiply `grads` by inv_scale in place and return a 1-element tensor on `device`,
    non-zero iff one of them holds an inf or a NaN. GradScaler's own kernel, one launch
    per device: it needs the gradients, the flag and the scale on one device (CUDA's
    raises otherwise; the CPU's, handed a flag on another device, silently unscales
    nothing), and with parallel.offload the gradients are host tensors while the device
    computes. So each device's gradients get a flag and a scale of their own (as
    torch.amp.GradScaler does per device), and the flags are summed on `device`. Every
    gradient on `device`: one launch on the flag itself, no copy."""
    found = torch.zeros(1, device=device)
    for on, group in by_device(grads).items():
        flag = found if on == found.device else torch.zeros(1, device=on)
        torch._amp_foreach_non_finite_check_and_unscale_(
            group, flag, torch.full((1,), inv_scale, device=on))
        if flag is not found:
            found += flag.to(found.device)
    return found


class Precision:
    def __init__(self, name="fp32", device=torch.device("cpu"), init_scale=2.0**16,
                 growth_interval=2000, world_size=1):
        self.device, self.world_size = device, world_size
        self.configure(name, init_scale, growth_interval)

    def configure(self, name, init_scale=2.0**16, growth_interval=2000):
        """trainer.precision (parallelize's step 6): set in place, as the strategy, its
        pipeline and its forward and backward hold this one object."""
        self.name, self.dtype = name, DTYPES.get(name)
        self.scaler = LossScaler(init_scale, growth_interval) if name == "fp16" else None
        self.skip_step = False  # the last unscale_and_check found an inf/NaN somewhere

    def autocast(self):
        """Context for every forward (training, recompute, evaluation)."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    @property
    def loss_scale(self) -> float:
        """What each backward's loss is multiplied by (1 unless fp16)."""
        return self.scaler.scale if self.scaler else 1.0

    @torch.no_grad()
    def unscale_and_check(self, grads):
        """fp16: divide gradients by the scale, then agree over the whole world whether
        any rank holds an inf/NaN (sets skip_step and updates the scale). Must run on
        every rank once per step, before the gradient norm is computed."""
        if self.scaler is None:
            self.skip_step = False
            return
        found = unscale_and_find_inf([g for g in grads if g is not None],
                                     1.0 / self.scaler.scale, self.device)
        if self.world_size > 1:
            # every gradient element lives on some rank: one MAX over all of them (not
            # training traffic: uncounted, like the preemption flag)
            checked_all_reduce(found, self.device, op=dist.ReduceOp.MAX)
        # read every step, as torch.amp.GradScaler reads it: whether to step is the host's
        # decision (fp16 only)
        self.skip_step = bool(found.item())
        self.scaler.update(self.skip_step)

    def metrics(self) -> dict:
        """Fields for metrics.jsonl (fp16 only): the scale and whether this step was skipped."""
        if self.scaler is None:
            return {}
        return {"loss_scale": self.scaler.scale, "step_skipped": int(self.skip_step),
                "skipped_steps": self.scaler.skipped_steps}

    def state(self) -> dict:
        """JSON-able, for the snapshot's manifest."""
        return {"precision": self.name, **({"loss_scaler": self.scaler.state()} if self.scaler else {})}

    def load_state(self, state):
        if self.scaler is not None and state and "loss_scaler" in state:
            self.scaler.load_state(state["loss_scaler"])
