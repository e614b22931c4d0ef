"""`parallelize(model, grid, cfg)`: this rank's share of the GPT, and the strategy that trains it.

The dimensions are applied in one order, each to what the previous one left
(as torchtitan's parallelize_llama and picotron's train.py do):

  1. tensor parallelism   (parallel.tp > 1): the model plan's linears, the
     embedding, LM head and loss become their Megatron versions, in place
     (parallel/tensor_parallel/);
  2. context parallelism  (parallel.cp > 1): every block's attention becomes a
     ring over the cp group, positions become the tokens' true ones, and the
     strategy keeps this rank's chunks of every sequence (parallel/context_parallel/);
  3. pipeline parallelism (parallel.pp > 1): the model is cut to this rank's
     chunks, and a Pipeline runs their schedule (parallel/pipeline_parallel/);
  4. data parallelism     (parallel.dp): a Strategy holds what is left -- as
     replicas, or as ZeRO shards -- and averages gradients over
     grid.grad_group (parallel/data_parallel/).

The model arrives on the meta device: steps 1-3 cut shapes, and step 4 allocates and
fills only what this rank holds, from the initial weights (parallel/initial.py).

Compute options (precision, activation checkpointing) are set afterwards by
the trainer through `Strategy.configure_compute`, on whatever step 3 built.

Registries: a new data-parallel strategy is one file in data_parallel/ and
one line in DATA_PARALLEL; PyTorch's implementations of a dimension are
chosen per dimension (`parallel.tp_impl`, `parallel.pp_impl`) and replace
our own for it.
"""

from parallel.comm import CommCounter
from parallel.context_parallel.apply import apply_context_parallel
from parallel.data_parallel.bucket import DDPBucket
from parallel.data_parallel.fsdp import FSDP
from parallel.data_parallel.naive import DDPNaive
from parallel.data_parallel.single import Single
from parallel.pipeline_parallel.pipeline import Pipeline
import importlib

from parallel.initial import to_meta
from parallel.placement import Placement
from parallel.strategy import LocalModel
from parallel.tensor_parallel.apply import apply_tensor_parallel

DATA_PARALLEL = {  # parallel.dp
    "single": Single,          # one data-parallel rank; the parity reference
    "ddp_naive": DDPNaive,     # own DP: one all-reduce per parameter after backward
    "ddp_bucket": DDPBucket,   # own DP: bucketed all-reduces overlapping backward
    "fsdp": FSDP,              # own ZeRO stage 1/2/3 (parallel.zero_stage) on flat units
    # PyTorch's, named by "module:class" and imported only when chosen: importing
    # torch.distributed.fsdp and .pipelining costs ~0.9 s, paid by every rank at start
    "torch_ddp": "parallel.reference.torch_ddp:TorchDDP",     # PyTorch DDP; the reference for ddp_*
    "torch_fsdp": "parallel.reference.torch_fsdp:TorchFSDP",  # FSDP2 fully_shard; the reference for fsdp
}
IMPLEMENTATIONS = ("own", "torch")  # parallel.tp_impl, parallel.pp_impl
TORCH_REFERENCES = {  # <dim>_impl=torch: PyTorch's, for that dim
    "tp": "parallel.reference.torch_tp:TorchTP",
    "pp": "parallel.reference.torch_pp:TorchPP",
}
# old parallel.dp values, now chosen per dimension
MOVED = {"torch_tp": "parallel.tp_impl=torch", "torch_pp": "parallel.pp_impl=torch"}


def strategy_class(p):
    """The Strategy class a `parallel:` section asks for."""
    for dim, entry in TORCH_REFERENCES.items():
        if getattr(p, f"{dim}_impl") == "torch":
            return _load(entry)
    return _load(DATA_PARALLEL[p.dp])


def _load(entry):
    """A registry entry: a class, or "module:class" imported now."""
    if not isinstance(entry, str):
        return entry
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def parallelize(model, grid, cfg, init=None):
    """Apply tensor, context, pipeline and data parallelism to `model` (a whole GPT), in
    that order; returns this rank's Strategy. cfg: the `parallel:` section
    (parallel/config.py). `model` is built on the meta device and `init` reads its
    initial weights (parallel/initial.py): the strategy materializes only what this
    rank holds. Without `init`, the model's own values are the initial weights (it is
    moved to the meta device first, so the same path runs)."""
    cls = strategy_class(cfg)
    if init is None:
        init = to_meta(model)
    comm = CommCounter(grid.device)  # counts training traffic; checks every tensor's device
    local = LocalModel(model, {n: Placement.whole(n, p.shape) for n, p in model.named_parameters()},
                       comm, init=init)
    if grid.tp_size > 1 and cls.own_tensor_parallel:  # 1. tensor
        local.placements, local.tp = apply_tensor_parallel(model, grid, cfg, comm)
    if grid.cp_size > 1:  # 2. context
        local.split = apply_context_parallel(model, grid, comm, cfg.cp_impl).split
    if grid.pp_size > 1:  # 3. pipeline (PyTorch's schedules too run on our cut)
        local.pipeline = Pipeline(model, grid, cfg, comm, local.placements)
        local.placements = local.pipeline.placements
    return cls(local, grid, cfg)  # 4. data
