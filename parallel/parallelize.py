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

Registries (parallel/registry.py): a new data-parallel strategy is one file in
data_parallel/ and one line in STRATEGIES; PyTorch's implementations of a dimension
are chosen per dimension (`parallel.tp_impl`, `parallel.pp_impl`) and replace our
own for it.
"""

from parallel.comm import CommCounter
from parallel.context_parallel.apply import apply_context_parallel
from parallel.pipeline_parallel.pipeline import Pipeline
from parallel.initial import to_meta
from parallel.placement import Placement
from parallel.registry import capabilities, strategy_class
from parallel.strategy import LocalModel
from parallel.tensor_parallel.apply import apply_tensor_parallel


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
    if grid.tp_size > 1 and "parallelizes_tp_itself" not in capabilities(cfg):  # 1. tensor
        local.placements, local.tp = apply_tensor_parallel(model, grid, cfg, comm)
    if grid.cp_size > 1:  # 2. context
        local.split = apply_context_parallel(model, grid, comm, cfg.cp_impl).split
    if grid.pp_size > 1:  # 3. pipeline (PyTorch's schedules too run on our cut)
        local.pipeline = Pipeline(model, grid, cfg, comm, local.placements)
        local.placements = local.pipeline.placements
    return cls(local, grid, cfg)  # 4. data
