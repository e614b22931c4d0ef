"""CPU offload (`parallel.offload=true`, fsdp stages 1-3): the optimizer's half of a shard in host memory.

Per unit, this rank's fp32 shard of the master weights, its gradient and AdamW's
state live in host memory (pinned on CUDA, so the copies are asynchronous DMA), and
the optimizer step runs on the host (torch's fused CPU AdamW). The device keeps what
compute needs: the parameters (stages 1-2: the whole unit; stage 3: the shard it
all-gathers from) and stage 1's full gradient, into which autograd accumulates.

Per micro-step each unit's reduced gradient shard leaves the device by a non-blocking
copy into host memory and is added to the host gradient once it has landed (after
that backward: `land`), so accumulation sums on the host and clipping, the norm and
AdamW read the whole step's gradient there (DeepSpeed #7967 was a norm of the last
micro-step's part only). Under hybrid sharding the cross-replica mean runs once per
step on a device copy of the host gradient (data_parallel/hybrid.py). After the step
the updated shard goes back by a non-blocking copy per unit (`push`): on CUDA they run
while the host goes on (the step's bookkeeping, the next batch) until the stages 1-2
all-gathers or stage 3's first gather of the next forward need them; the next write to
the master waits for them. (The step itself is one fused AdamW over every unit's pieces,
so a unit's copy does not start before the last unit is stepped.) Gradients other code
sums over TP or the pipeline's tied ends travel through a device copy
(forward_backward.finish_gradients).

On CPU the same path runs with separate host tensors and real copies (a CPU device
needs no pinning and has no events), so the parity tests prove the code CUDA runs.

Only a strategy that shards its optimizer state (its `offloads` in parallel/registry.py)
can move it off the device (parallel/rules.py).
"""

import torch


class HostShard:
    """This rank's shard of one unit in host memory: master weights and gradient."""

    def __init__(self, size, dtype, device):
        self.device, self.pin = device, device.type == "cuda"
        self.shard = self._empty(size, dtype).zero_()  # the master weights the optimizer steps on
        self.grad = None                               # allocate_grad, at the first backward
        self._arriving = []  # (host copy, device event, divide by) of reduced gradient shards
        self._pushed = None  # device event after the last copy of the shard to the device

    def _empty(self, size, dtype):
        return torch.empty(size, dtype=dtype, device="cpu", pin_memory=self.pin)

    def allocate_grad(self):
        if self.grad is None:
            self.grad = self._empty(self.shard.numel(), self.shard.dtype).zero_()

    def receive(self, reduced, divide_by):
        """A reduced gradient shard on the device (the collective's dtype): copied to
        the host without waiting; `land` adds it, divided by `divide_by`."""
        host = self._empty(reduced.numel(), reduced.dtype)
        host.copy_(reduced, non_blocking=True)
        self._arriving.append((host, self._event(), divide_by))

    def land(self):
        """Add the gradient shards received since the last call to the host gradient."""
        for host, event, divide_by in self._arriving:
            if event is not None:
                event.synchronize()
            self.grad.add_(host.to(self.grad.dtype).div_(divide_by))
        self._arriving = []

    def push(self, device_shard):
        """The updated master weights to the device, without waiting."""
        device_shard.copy_(self.shard, non_blocking=True)
        self._pushed = self._event()

    def wait_pushed(self):
        """Before anyone writes the master weights again (the next optimizer step, a load)."""
        if self._pushed is not None:
            self._pushed.synchronize()
            self._pushed = None

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in (self.shard, self.grad) if t is not None)

    def _event(self):
        if self.device.type != "cuda":  # a CPU copy is done when copy_ returns
            return None
        event = torch.cuda.Event()
        event.record()
        return event

