"""`torch_tp`: PyTorch's DTensor tensor parallelism, kept as the reference for `parallel.tp`.

Not one of our strategies: it is what our TP is measured against (parity and
speed) in the same benchmark run, on the same model and layout. Pure TP only
(data-parallel degree 1), chosen as `parallel.tp_impl=torch parallel.tp=N`.

`parallelize_module` with the plan torchtitan uses for a GPT, built from our
model plan (parallel/model_plan.py): ColwiseParallel for the column linears
(c_attn, c_fc), RowwiseParallel for the row ones (both c_proj),
RowwiseParallel for the token embedding (vocabulary rows, output
all-reduced) and ColwiseParallel with vocabulary-sharded output for the LM
head, whose loss runs under `loss_parallel()` (no rank holds the full
logits). Two adaptations to our model: a fused column linear (c_attn is
[q | k | v]) has its rows permuted to [q0 k0 v0 | q1 k1 v1 | ...] before
sharding, making a contiguous column shard hold whole heads (and permuted
back for snapshots); and parallelize_module replaces the embedding's weight,
so the LM head is tied to it again after.

Its traffic goes through torch, so comm_* metrics do not count it.
Snapshots gather full canonical tensors (a reference, like torch_fsdp).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)

from parallel import model_plan as plan
from parallel.reference.dtensor_state import DTensorReference, full


def head_major_rows(out_features, fused, tp):
    """Row order of a fused column linear ([q | k | v]: `fused` parts) that puts each
    rank's rows of every part next to each other."""
    part = out_features // fused
    c = part // tp
    return torch.cat([torch.arange(k * part + r * c, k * part + (r + 1) * c)
                      for r in range(tp) for k in range(fused)])


class TorchTP(DTensorReference):
    name = "torch_tp"
    replaces = DTensorReference.replaces + ("loss_and_gradients", "eval_loss", "clip_gradients")

    def __init__(self, local, grid, cfg):
        super().__init__(local, grid, cfg)
        self.mesh = DeviceMesh.from_group(grid.tp_group, self.device.type)
        # fused column linears (c_attn) are permuted to head-major rows, and back for snapshots
        self.perms = {}  # canonical name -> (permutation, its inverse)
        dtensor_plan = {plan.TOKEN_EMBEDDING: RowwiseParallel(input_layouts=Replicate()),
                        plan.LM_HEAD: ColwiseParallel(output_layouts=Shard(-1),
                                                      use_local_output=False)}
        styles = {"column": ColwiseParallel, "row": RowwiseParallel}
        with torch.no_grad():
            for i, block in plan.blocks(self.module):
                for linear in plan.TP_LINEARS:
                    name = plan.block_prefix(i) + linear.path
                    dtensor_plan[name] = styles[linear.style]()
                    if linear.fused > 1:
                        self._permute(name, block.get_submodule(linear.path), linear.fused)
        parallelize_module(self.module, self.mesh, dtensor_plan)
        plan.tie_lm_head(self.module)  # parallelize_module replaced the embedding's weight

    def _permute(self, name, layer, fused):
        perm = head_major_rows(layer.out_features, fused, self.grid.tp_size)
        for p, suffix in ((layer.weight, ".weight"), (layer.bias, ".bias")):
            if p is not None:
                p.copy_(p[perm])
                self.perms[name + suffix] = (perm, torch.argsort(perm))

    def loss_and_gradients(self, micro_batches):
        total = torch.zeros((), device=self.device)
        with loss_parallel():
            for x, y in micro_batches:
                _, loss = self.model(x.to(self.device), y.to(self.device))
                (loss / len(micro_batches)).backward()
                total += full(loss).detach()
        return total / len(micro_batches)

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.module.eval()
        try:
            with loss_parallel():
                _, loss = self.module(x.to(self.device), y.to(self.device))
        finally:
            self.module.train()
        return full(loss).item()

    def clip_gradients(self, max_norm):
        """Sharded gradients' squares summed over TP; replicated ones (plain tensors)
        counted once (torch's clip_grad_norm_ does not take DTensors and tensors mixed)."""
        sharded = torch.zeros((), device=self.device)
        replicated = torch.zeros((), device=self.device)
        for p in self.module.parameters():
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor):
                local = p.grad.to_local()
                if any(isinstance(pl, Shard) for pl in p.grad.placements):
                    sharded += local.pow(2).sum()
                else:
                    replicated += local.pow(2).sum()
            else:
                replicated += p.grad.pow(2).sum()
        dist.all_reduce(sharded, group=self.grid.tp_group)
        norm = (sharded + replicated).sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in self.module.parameters():
            if p.grad is not None:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(coef)
        return norm

    def canonical(self, name, t):
        t = super().canonical(name, t)
        return t[self.perms[name][1]] if name in self.perms else t

    def local(self, name, canonical, like):
        if name in self.perms:
            canonical = canonical[self.perms[name][0]]
        canonical = canonical.to(self.device)
        if isinstance(like, DTensor):
            return distribute_tensor(canonical, like.device_mesh, like.placements)
        return canonical
