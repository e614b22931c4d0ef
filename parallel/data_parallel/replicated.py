"""The shared base of the strategies where every dp rank holds the whole (TP-local)
model: single, torch_ddp, ddp_naive, ddp_bucket (and the torch_fsdp, torch_tp and
torch_pp references, which wrap it). They differ only in how gradients get averaged."""

from contextlib import nullcontext

from parallel.initial import allocate
from parallel.placement import Region, writer_among
from parallel.strategy import Strategy, build_adamw, resident_bytes


class ReplicatedStrategy(Strategy):
    """Every dp rank holds the whole (TP-local) GPT; subclasses say how gradients are averaged.

    Hooks for subclasses: `self.model` is what forward runs through (the GPT
    or a wrapper), `no_sync(last)` is a context for each micro-step, and
    `sync_gradients()` runs once after the last backward.
    """

    def __init__(self, local, grid, cfg):
        super().__init__(local, grid, cfg)
        self._regions = None
        allocate(self.module, self.device)  # the whole (TP-local) stage: a replica's share
        self.materialize()

    def no_sync(self, last_micro_step):
        return nullcontext()

    def configure_optimizer(self, tcfg):
        self.named = dict(self.module.named_parameters())
        groups = self.module.optim_groups(tcfg.weight_decay)
        self.group_names = [g["params"] for g in groups]
        self.optimizer = build_adamw(self.named, groups, tcfg)

    def backward_scope(self, chunk, last):
        return self.no_sync(last)

    def regions(self):
        """One region per parameter. Replicas: every rank of the gradient group, and
        every TP rank for a tensor TP does not split; one of them (spread by name)
        writes it (and of the tied embedding's two pipeline copies, the first stage's)."""
        if self._regions is None:
            g, self._regions = self.grid, []
            for name, p in self.module.named_parameters():
                placement = self.placements[name]
                tp_copies = g.tp_size if placement.tp_replicated else 1
                me = g.grad_rank * tp_copies + (g.tp_rank if placement.tp_replicated else 0)
                self._regions.append(Region(
                    placement, 0, p.numel(), p, 0,
                    writes=writer_among(name, g.grad_size * tp_copies) == me
                    and placement.tied != "last",
                    in_norm=placement.counted_in_norm(g.tp_rank)))
        return self._regions

    def norm_group(self):
        return self.sharded_group("pp", "tp")

    def grads(self):
        return [p.grad for p in self.module.parameters() if p.grad is not None]

    def optimizer_step(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.step_optimizer()
        self.last_state_bytes = resident_bytes(self.module.parameters(), self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
