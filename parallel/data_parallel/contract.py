"""What a data-parallel strategy implements: eight methods, in the order a step calls them.

A strategy holds this rank's share of the model that tensor, context and pipeline
parallelism left (a `LocalModel`, parallel/strategy.py), as replicas or shards, and
averages gradients over grid.grad_group. That is all it knows. What every strategy
needs beside it is given, by the `Strategy` that parallelize() wraps around it
(parallel/strategy.py), and written once:

    the step's forward and backward      parallel/forward_backward.py (micro-batches, the
      and its random state                 pipeline's schedule, TP and tied-embedding sums)
    the gradient norm across shards      parallel/clipping.py (fp16 unscaling, the clip)
    AdamW's step                         parallel/strategy.py (the learning rate, fp16 skips)
    snapshots and state_dict             parallel/placement.py (through `regions()`)
    statistics                           parallel/comm.py (traffic), the pipeline's timeline

The contract (parallel/README.md lists it too):

    __init__(local, grid, cfg)   allocate what this rank holds and fill it from `local.init`
                                 (placement.load_regions); `self.model` is what forward runs
                                 through (the GPT, or a wrapper of it)
    backward_scope(chunk, last)  context around each micro-batch's backward
    sync_gradients()             after the step's last backward
    regions()                    what this rank holds, as Regions (placement.py)
    norm_group()                 the group over which ranks hold other gradient elements
    build_optimizer(tcfg)        `self.optimizer`: AdamW over the tensors this rank updates
    update(write)                around `write()`, which changes this rank's values
    drop_gradients()             the step's end: free its gradients

`ReplicatedStrategy` (replicated.py) implements the last five for full replicas: ddp_naive
adds `__init__` and `sync_gradients`. PyTorch's references (parallel/reference/) also
answer some of the Strategy's calls themselves, PyTorch's way (`replaces`).
"""

from contextlib import nullcontext

import torch

from parallel.strategy import hold


class DataParallel:
    name = None    # its registry key (parallel/registry.py)
    replaces = ()  # the Strategy's calls it answers itself (PyTorch's references only)

    def __init__(self, local, grid, cfg):
        """local: a LocalModel; cfg: the `parallel:` section."""
        hold(self, local, grid, cfg)  # grid, cfg, device, comm, placements, precision, tp,
        # pipeline, module and model (what forward runs through: the module, or a wrapper)
        self.optimizer = None  # build_optimizer

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

    def build_optimizer(self, tcfg):
        """Set `self.optimizer`: AdamW (`build_adamw`) over what this rank updates."""
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

def build_adamw(param_groups, tcfg, **kwargs):
    """AdamW over `param_groups` (torch.optim's [{"params": [...], ...}]) with the
    trainer's hyperparameters."""
    return torch.optim.AdamW(param_groups, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2),
                             weight_decay=tcfg.weight_decay, **kwargs)


def sharded_group(grid, *dims):
    """The group over those of `dims` (names of grid.DIMS) that have more than one rank, or
    None if none has (a norm_group)."""
    dims = [d for d in dims if grid.sizes[d] > 1]
    return grid.group_over(*dims) if dims else None
