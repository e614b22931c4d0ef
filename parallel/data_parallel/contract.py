"""What a data-parallel strategy implements: eight methods, below in the order a step calls them.

A strategy holds this rank's share of the model that tensor, context and pipeline
parallelism left (a `LocalModel`), as replicas or shards, and averages gradients over
grid.grad_group. That is all it knows. The rest is given, by the `Strategy` that
parallelize() wraps around it (parallel/strategy.py): the step's forward and backward
over micro-batches or the pipeline's schedule, its random state (forward_backward.py),
the gradient norm across shards and the clip (clipping.py), the optimizer's step, snapshots and
state_dict through `regions()` (placement.py), and the statistics.

`ReplicatedStrategy` (replicated.py) implements build_optimizer, regions, norm_group and
drop_gradients for full replicas: ddp_naive adds `__init__` and `sync_gradients`. PyTorch's references also answer some of
the Strategy's calls themselves, PyTorch's way (`replaces`). parallel/README.md lists the
contract too.
"""

from contextlib import nullcontext

from optimizers.adamw import adamw_kind, build_adamw  # noqa: F401 (the strategies' helpers)
from optimizers.registry import builder as optimizer_builder
from parallel.strategy import hold


class DataParallel:
    name = None    # its registry key (parallel/registry.py)
    replaces = ()  # the Strategy's calls it answers itself (PyTorch's references only)

    def __init__(self, local, grid, cfg):
        """Allocate what this rank holds and fill it from `local.init` (the initial weights,
        through placement.load_regions). local: a LocalModel; cfg: the `parallel:` section."""
        hold(self, local, grid, cfg)  # grid, cfg, device, comm, placements, precision, tp,
        # pipeline, module and model (what forward runs through: the module, or a wrapper)
        self.optimizer = None  # build_optimizer

    def build_optimizer(self, tcfg):
        """Set `self.optimizer`: `build_optimizer`'s over what this rank updates."""
        raise NotImplementedError

    def backward_scope(self, chunk, last):
        """Context around one micro-batch's backward through one pipeline chunk, or (chunk
        None, no pipeline) around its forward and backward through the whole model
        (PyTorch's DDP.no_sync must see the forward too); `last`: no later backward of
        that chunk in this step, so gradient hooks know when to start averaging."""
        return nullcontext()

    def sync_gradients(self):
        """After the step's last backward: a strategy that averages only then (ddp_naive)
        reduces here; one that started from gradient hooks waits here."""

    def regions(self) -> list:
        """The Regions of TP-local parameters this rank holds (parallel/placement.py): the
        gradient norm, snapshots, state_dict and the TP / pipeline gradient sums read them."""
        raise NotImplementedError

    def norm_group(self):
        """The group over which ranks hold different gradient elements (None: every rank
        holds them all); the squared norm is summed over it."""
        raise NotImplementedError

    def update(self, write):
        """Run `write()`, which changes the values this rank holds (AdamW's step, a
        snapshot's load), with whatever must come before and after (fsdp: offload's copies,
        the all-gather of the updated shards)."""
        write()

    def drop_gradients(self) -> tuple:
        """After the update: free the step's gradients. Returns (device bytes, host bytes)
        of parameters, gradients and optimizer state held just before (state_bytes)."""
        raise NotImplementedError


# ---------------------------------------------------------------- helpers a strategy is given

def build_optimizer(param_groups, tcfg, matrices=(), **kwargs):
    """The optimizer trainer.optimizer names (optimizers/registry.py) over `param_groups`
    (torch.optim's [{"params": [...], "weight_decay": ...}], as AdamW takes them);
    `matrices`: those parameters that are whole hidden matrices (model_plan.
    hidden_matrices), which Muon takes from the groups; kwargs: AdamW's kind."""
    return optimizer_builder(tcfg.optimizer)(
        param_groups, tcfg, matrices, **kwargs)


def sharded_group(grid, *dims):
    """The group over those of `dims` (names of grid.DIMS) that have more than one rank, or
    None if none has (a norm_group)."""
    dims = [d for d in dims if grid.sizes[d] > 1]
    return grid.group_over(*dims) if dims else None
