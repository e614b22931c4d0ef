"""The shared base of the strategies where every dp rank holds the whole (TP-local)
model: single, torch_ddp, ddp_naive, ddp_bucket (and the torch_fsdp, torch_tp and
torch_pp references, which wrap it). They differ only in how gradients get averaged:
a subclass adds `__init__` and `sync_gradients` or `backward_scope` (contract.py)."""

import torch

from parallel import model_plan as plan
from parallel.data_parallel.contract import DataParallel, build_optimizer, sharded_group
from parallel.initial import allocate
from parallel.placement import Region, load_regions, writer_among


class ReplicatedStrategy(DataParallel):
    """Every dp rank holds the whole (TP-local) GPT; subclasses say how gradients are averaged."""

    def __init__(self, local, grid, cfg):
        super().__init__(local, grid, cfg)
        self._regions = None
        allocate(self.module, self.device)  # the whole (TP-local) stage: a replica's share
        load_regions(self.regions(), None, local.init)

    def regions(self):
        """One region per parameter. Replicas: every rank of the gradient group, and
        every TP rank for a tensor TP does not split; one of them (spread by name)
        writes it (and of the tied embedding's two pipeline copies, the first stage's)."""
        if self._regions is None:
            g, self._regions = self.grid, []
            for name, p in self.module.named_parameters():
                placement = self.placements[name]
                tp_copies = g.tp_size if placement.tp_replicated else 1
                copies, at = ((g.expert_grad_size, g.expert_grad_rank) if placement.expert
                              else (g.grad_size, g.grad_rank))
                me = at * tp_copies + (g.tp_rank if placement.tp_replicated else 0)
                self._regions.append(Region(
                    placement, 0, p.numel(), p, 0,
                    writes=writer_among(name, copies * tp_copies) == me
                    and placement.tied != "last",
                    # the ranks of an ep group hold the same dense parameters: one counts
                    in_norm=placement.counted_in_norm(g.tp_rank)
                    and (placement.expert or g.ep_rank == 0)))
        return self._regions

    def norm_group(self):
        if self.grid.ep_size > 1:  # pp x tp x the ep group: other experts
            return self.grid.expert_norm_group
        return sharded_group(self.grid, "pp", "tp")

    def build_optimizer(self, tcfg):
        self.named = dict(self.module.named_parameters())
        groups = self.module.optim_groups(tcfg.weight_decay)
        matrices = {self.named[n]: in_out for n, in_out in plan.hidden_matrices(self.module).items()}
        self.optimizer = build_optimizer([{**g, "params": [self.named[n] for n in g["params"]
                                                           if n in self.named]} for g in groups],
                                         tcfg, matrices)

    def drop_gradients(self):
        held = resident_bytes(self.module.parameters(), self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return held, 0


def resident_bytes(params, optimizer):
    """Parameters + their gradients + optimizer state tensors, in bytes (each tensor once)."""
    seen, total = set(), 0
    tensors = []
    for p in params:
        tensors += [p, p.grad]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
