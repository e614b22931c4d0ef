"""`parallelize(model, grid, cfg)`: this rank's share of the GPT, and the strategy that trains it.

Every transformation is applied here, in one order, each to what the previous one
left (as torchtitan's parallelize_llama and picotron's train.py do):

  1. tensor parallelism   (parallel.tp > 1): the model plan's linears, the
     embedding, LM head and loss become their Megatron versions, in place
     (parallel/tensor_parallel/);
     Mixture-of-experts blocks (model.moe_experts > 0) are wired in the same step:
     each TP rank routes its share of the tokens, and expert parallelism
     (parallel.ep > 1) cuts the experts and sends tokens by all-to-all
     (parallel/expert_parallel/);
  2. context parallelism  (parallel.cp > 1): every block's attention becomes a
     ring over the cp group, positions become the tokens' true ones, and the
     strategy keeps this rank's chunks of every sequence (parallel/context_parallel/);
  3. pipeline parallelism (parallel.pp > 1): the model is cut to this rank's
     chunks, and a Pipeline runs their schedule (parallel/pipeline_parallel/);
  4. compilation          (trainer.compile): each block's forward (parallel/compile.py);
  5. activation checkpointing (trainer.activation_checkpointing): each block recomputed
     in backward (parallel/checkpointing.py). After compilation, not before (torchtitan's
     order): the recompute wraps the compiled forward, so it runs compiled too, and the
     switch of TP's random stream around it stays outside the compiled code;
  6. precision            (trainer.precision): autocast and the fp16 loss scaler, one
     Precision that every forward and backward of the step runs under (parallel/precision.py);
  7. data parallelism     (parallel.dp): a data-parallel strategy holds what is left --
     as replicas, or as ZeRO shards -- and averages gradients over grid.grad_group
     (parallel/data_parallel/); last, as it wraps or hooks into the model the steps
     before made. The Strategy around it is returned ready: its optimizer is built.

The model arrives on the meta device: steps 1-3 cut shapes, and step 7 allocates and
fills only what this rank holds, from the initial weights (parallel/initial.py).

Registries (parallel/registry.py): a new data-parallel strategy is one file in
data_parallel/ and one line in STRATEGIES; PyTorch's implementations of a dimension
are chosen per dimension (`parallel.tp_impl`, `parallel.pp_impl`) and replace our
own for it.
"""

import torch

from parallel.checkpointing import checkpoint_blocks
from parallel.comm import CommCounter
from parallel.compile import compile_model
from parallel.context_parallel.apply import apply_context_parallel
from parallel import model_plan as plan
from parallel.expert_parallel.apply import apply_experts
from parallel.expert_parallel.balance import ChoiceBalancer
from parallel.pipeline_parallel.pipeline import Pipeline
from parallel.initial import to_meta
from parallel.placement import Placement
from parallel.precision import Precision
from parallel.registry import capabilities, strategy_class
from parallel.strategy import LocalModel, Strategy
from parallel.tensor_parallel.apply import apply_tensor_parallel


def parallelize(model, grid, cfg, init=None):
    """Apply steps 1-7 to `model` (a whole GPT); returns this rank's Strategy, ready to
    train. cfg: the run's config (its `parallel:` and `trainer:` sections), or the
    `parallel:` section alone (tests): then steps 4-6 and the optimizer wait for
    Strategy.configure_compute and configure_optimizer. `model` is built on the meta
    device and `init` reads its initial weights (parallel/initial.py): the strategy
    materializes only what this rank holds. Without `init`, the model's own values are
    the initial weights (it is moved to the meta device first, so the same path runs)."""
    p, t = getattr(cfg, "parallel", cfg), getattr(cfg, "trainer", None)
    cls = strategy_class(p)
    if init is None:
        init = to_meta(model)
    comm = CommCounter(grid.device)  # counts training traffic; checks every tensor's device
    precision = Precision("fp32", grid.device, world_size=grid.world_size)  # step 6 sets it
    canonical = model.canonical_shapes()  # a padded vocabulary's rows in none (model.vocab_pad_to)
    local = LocalModel(model, {n: Placement.leading_rows(n, canonical[n], w.shape)
                               for n, w in model.named_parameters()},
                       comm, init=init, precision=precision)
    if grid.tp_size > 1 and "parallelizes_tp_itself" not in capabilities(p):  # 1. tensor
        local.placements, local.tp = apply_tensor_parallel(model, grid, p, comm)
    if model.config.moe_experts:  # 1. the experts, over TP and the ep ranks
        local.placements = apply_experts(model, grid, comm, local.placements, local.tp,
                                         p.ep_impl)
    if grid.cp_size > 1:  # 2. context
        local.split = apply_context_parallel(model, grid, comm, p.cp_impl).split
    if grid.pp_size > 1:  # 3. pipeline (PyTorch's schedules too run on our cut)
        local.pipeline = Pipeline(model, grid, p, comm, local.placements, local.precision)
        local.placements = local.pipeline.placements
    if t is not None:  # 4-6. compilation, recompute, precision (below)
        prepare_compute(model, local.tp, local.precision, t)
    strategy = Strategy(local, grid, p, cls(local, grid, p))  # 7. data
    config = model.config
    if config.moe_experts and config.moe_bias_rate:  # the choice biases (DeepSeek-V3's)
        strategy.balancer = ChoiceBalancer(
            plan.moe_layers(model), [i for i in range(config.n_layer) if config.has_experts(i)],
            config.moe_experts, config.moe_bias_rate, grid, comm)
    if t is not None:
        strategy.configure_optimizer(t)
        strategy.applied = t
    return strategy


def prepare_compute(model, tp, precision, t):
    """Steps 4-6 on this rank's (TP-local, stage-cut) GPT. t: the `trainer:` section."""
    if t.compile:  # 4. compilation
        compile_model(model, t.compile_backend, t.compile_scope)
    if t.activation_checkpointing:  # 5. recompute, around the compiled forward
        checkpoint_blocks(model, tp.random if tp is not None else None,
                          t.activation_checkpointing_mode, t.activation_checkpointing_every)
    precision.configure(t.precision, t.fp16_init_scale, t.fp16_growth_interval)  # 6.
    for module in model.modules():  # one-time probes, here and not inside a step (moe/experts.py)
        if hasattr(module, "before_training"):
            module.before_training(precision.device, precision.dtype or torch.float32)
