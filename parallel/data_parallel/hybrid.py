"""Hybrid sharding (HSDP, `parallel.dp_replicate=R`): ZeRO inside replica groups, replicas across.

The data-parallel ranks form R replica groups of dp ranks each (parallel/grid.py:
dp_replicate is the slowest axis, so a group is neighbouring ranks, a node). Inside a
group `fsdp` shards exactly as it does over dp ranks alone: the same all-gathers and
reduce-scatters, the same state per rank. Across groups, the R ranks that hold the same
shard average their gradient shards: per optimizer step, after its last backward (so
once whatever trainer.grad_accum is), one all-reduce of each unit's gradient shard over
grid.dp_replicate_group. Only that crosses the slow links (torchtitan's dp_replicate x
dp_shard, DeepSpeed's MiCS / ZeRO++ hpZ, Megatron's distributed-optimizer instances).

`ReplicaMean` is that reduction and nothing else, on a group of its own. (Fault-tolerant
replica groups, fault_tolerance/, are another thing: each group its own launch, summed
across after the group's strategy is done, through torchft's reconfigurable group.) Per step each rank sends R's all-reduce of its gradient shards:
2(R-1)/R x 4 bytes x Φ / dp on the wire (fp32; half with parallel.reduce_dtype=bf16).

Only a strategy that shards (its `hybrid_shards` in parallel/registry.py) has replica
groups to make (parallel/rules.py).
"""

import torch


class ReplicaMean:
    """Average a gradient shard with the replicas' (the ranks holding the same shard in
    the other replica groups)."""

    def __init__(self, group, size, comm, device, reduce_dtype):
        self.group, self.size, self.comm = group, size, comm
        self.device, self.dtype = device, reduce_dtype

    def start(self, grad, staged=False):
        """Launch the all-reduce (sum) of `grad`; returns (work, finish): finish() leaves
        the mean in `grad`. staged: `grad` lives in host memory (parallel.offload): it
        travels through a device copy, in the collective's dtype (also for a
        reduce_dtype other than the gradient's)."""
        if staged or grad.dtype != self.dtype:
            wire = grad.to(device=self.device, dtype=self.dtype, copy=True)
        else:
            wire = grad
        work = self.comm.all_reduce(wire, group=self.group, async_op=True)

        def finish():
            if wire is not grad:
                grad.copy_(wire)
            grad.div_(self.size)
        return work, finish

