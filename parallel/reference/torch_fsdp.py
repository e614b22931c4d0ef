"""`torch_fsdp`: PyTorch's FSDP2 (`fully_shard`), kept as the reference for `fsdp`.

Not one of our strategies: it is what `fsdp` (ZeRO-3) is measured against,
parity and speed, in the same run. Each transformer block is one FSDP unit,
then the root (embeddings, final LayerNorm, tied LM head). Parameters are
DTensors sharded on dim 0; per micro-step FSDP2 all-gathers a unit before its
forward and (after resharding) before its backward, and reduce-scatters its
gradients after. `parallel.reshard_after_forward` and `parallel.prefetch`
are passed through, so both implementations run the same schedule. Its
traffic goes through torch, so comm_* metrics do not count it.

A reference only, so snapshots simply gather: full canonical tensors, each
written by one rank (our fsdp writes and reads its own shard ranges instead).
With tensor parallelism (parallel.tp > 1) it is refused (parallel/rules.py): PyTorch
composes FSDP2 with its own DTensor TP, not with ours.

It is also the reference for hybrid sharding and offload: `parallel.dp_replicate=R`
shards over a 2-D mesh (replicate x shard: FSDP2's HSDP, grid.dp_replicate_group x
grid.shard_group), and `parallel.offload=true` passes FSDP2's CPUOffloadPolicy
(pinned on CUDA): sharded parameters, gradients and AdamW's state in host memory. On a
GPU its mesh is then made of groups that take host tensors too (gloo beside NCCL), since
the gradient norm, the clip and the snapshots' full tensors reduce those host DTensors.
"""

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from parallel import model_plan as plan
from parallel.grid import DIMS, GRAD_DIMS, SHARD_DIMS
from parallel.reference.dtensor_state import DTensorReference, full, local_part


class TorchFSDP(DTensorReference):
    name = "torch_fsdp"  # hybrid_shards: a 2-D mesh; offloads: CPUOffloadPolicy
    replaces = DTensorReference.replaces + ("clip_gradients",)

    def __init__(self, local, grid, cfg):
        super().__init__(local, grid, cfg)
        mesh = data_parallel_mesh(grid, host_tensors=cfg.offload)
        kw = {"reshard_after_forward": cfg.reshard_after_forward}
        if cfg.offload:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        blocks = [block for _, block in plan.blocks(self.module)]
        for block in blocks:
            fully_shard(block, mesh=mesh, **kw)
        fully_shard(self.module, mesh=mesh, **kw)
        if cfg.prefetch:  # explicit one-unit-ahead prefetch, as in our fsdp
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
                block.set_modules_to_backward_prefetch(blocks[max(i - 1, 0):i])

    def clip_gradients(self, max_norm):
        self.precision.unscale_and_check([local_part(p.grad) for p in self.module.parameters()
                                          if p.grad is not None])
        if self.precision.skip_step:
            max_norm = float("inf")  # the gradients are dropped: just measure
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        # offloaded: a host tensor like the gradients; the trainer reads it beside the
        # device's loss
        return full(norm).to(self.device)

    def local(self, name, canonical, like):
        """FSDP2's shard of `canonical` (dim 0), where `like`'s lives (offload: the host)."""
        shard = distribute_tensor(canonical.to(self.device), like.device_mesh, like.placements)
        return DTensor.from_local(shard.to_local().to(local_part(like).device), like.device_mesh,
                                  like.placements)


def data_parallel_mesh(grid, host_tensors=False):
    """The ranks averaging gradients as FSDP2's mesh: 1-D over grid.grad_group, or with
    replica groups (HSDP) 2-D, replicate x shard, the ranks laid out as in the grid.
    host_tensors (offload): over groups that also take host tensors (grid.group_over):
    with CPUOffloadPolicy the gradients and AdamW's state are host DTensors, and the
    gradient norm, the clip and the snapshot's full tensors reduce and gather them over
    the mesh, which on a GPU's NCCL-only groups fails at step 1 (a known limitation of
    FSDP2; torchtune starts gloo beside NCCL, as here)."""
    if grid.dp_replicate_size == 1:
        return DeviceMesh.from_group(grid.group_over(*GRAD_DIMS, host_tensors=host_tensors),
                                     grid.device.type)
    mine = tuple(slice(None) if d in GRAD_DIMS else grid.coords[d] for d in DIMS)
    ranks = grid.ranks[mine].reshape(grid.dp_replicate_size, grid.shard_size)
    groups = [grid.group_over("dp_replicate", host_tensors=host_tensors),
              grid.group_over(*SHARD_DIMS, host_tensors=host_tensors)]
    return DeviceMesh.from_group(groups, grid.device.type, mesh=ranks,
                                 mesh_dim_names=("replicate", "shard"))
