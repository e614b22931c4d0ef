"""`ddp_naive`: data parallelism in its plainest form.

Every rank holds the whole model and runs forward and backward on its own
share of the global batch. After the last backward of a step, each
parameter's *gradient* (never its value) is summed over the data-parallel
group with its own all-reduce, one parameter after another, and divided by
the group size: the mean of the ranks' gradients is the gradient of the
global batch, so every rank takes the same optimizer step.

Per step it communicates: one all-reduce per parameter tensor (4 bytes x
parameter count in all; 2 with `parallel.reduce_dtype=bf16`, which sends a
bf16 copy of each gradient and copies the sum back into the fp32 gradient),
through `dist.all_reduce` or our own ring (`parallel.allreduce`, see
data_parallel/ring.py). Once at start: rank 0 of the
data-parallel group broadcasts parameters and buffers, so all replicas begin
equal even if their initialisations differed.
"""

import torch
import torch.distributed as dist

from errors import UserError
from parallel.data_parallel.ring import ring_all_reduce
from parallel.data_parallel.replicated import ReplicatedStrategy


class DDPNaive(ReplicatedStrategy):
    name = "ddp_naive"

    def __init__(self, local, grid, cfg):
        super().__init__(local, grid, cfg)
        self.group, self.dp_size = grid.grad_group, grid.grad_size
        self.use_ring = cfg.allreduce == "ring"
        self.reduce_dtype = REDUCE_DTYPES[cfg.reduce_dtype]
        expert = self.expert_names()
        named = dict(self.module.named_parameters())  # the tied weight once
        dense = [p for n, p in named.items() if n not in expert] + list(self.module.buffers())
        broadcast_from_dp_root(dense, self.group, self.dp_size, self.comm)
        broadcast_from_dp_root([named[n] for n in named if n in expert],  # other experts
                               grid.expert_grad_group, grid.expert_grad_size, self.comm)

    def expert_names(self):
        """Parameters expert parallelism cut (each rank holds other experts)."""
        return {n for n in self.placements if self.placements[n].expert}

    def sum_group(self, expert):
        """(group, size) a gradient is summed over: the ranks holding the same parameter,
        the expert-data-parallel ones for experts. Divided by dp_size either way: every
        rank of the gradient group contributed tokens to every expert's gradient."""
        g = self.grid
        return (g.expert_grad_group, g.expert_grad_size) if expert else (self.group, self.dp_size)

    @torch.no_grad()
    def sync_gradients(self):
        expert = self.expert_names()
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                raise unused_parameter_error([name])
            group, size = self.sum_group(name in expert)
            if size > 1:
                wire = p.grad if p.grad.dtype == self.reduce_dtype else p.grad.to(self.reduce_dtype)
                if self.use_ring:  # naive: synchronous, in the calling thread
                    ring_all_reduce(wire, self.comm, group)
                else:
                    self.comm.all_reduce(wire, group=group)
                if wire is not p.grad:
                    p.grad.copy_(wire)  # back into the fp32 gradient
            if self.dp_size > 1:
                p.grad.div_(self.dp_size)


# parallel.reduce_dtype: the dtype gradients travel and are summed in (a bf16 collective
# sums in bf16); the sum is copied back into the fp32 .grad the optimizer reads
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def unused_parameter_error(names):
    return UserError(
        f"parameter(s) {', '.join(names)} received no gradient in this step. Our data-parallel "
        "strategies need every trainable parameter to take part in every step (as PyTorch DDP "
        "without find_unused_parameters): use it in forward or set requires_grad=False")


@torch.no_grad()
def broadcast_from_dp_root(tensors, group, dp_size, comm):
    """Copy the group's first rank's `tensors` (parameters, buffers) to the whole group: one
    flat broadcast per dtype (instead of one per tensor), so start-up costs a handful of
    calls, not hundreds."""
    if dp_size == 1 or not tensors:
        return
    root = dist.get_process_group_ranks(group)[0]  # global rank of dp rank 0
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        comm.broadcast(flat, src=root, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
