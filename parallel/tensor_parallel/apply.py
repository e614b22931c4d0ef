"""`parallel.tp=N`: Megatron-style tensor parallelism, applied to the GPT from outside.

`apply_tensor_parallel` swaps the GPT's layers for the TP layers of
parallel/tensor_parallel/layers.py, in place, where the model plan
(parallel/model_plan.py) names them, and returns each parameter's Placement
(parallel/placement.py). On TP rank r of N, with C = n_embd and c = C / N:

    attention c_attn   column-parallel by whole heads: rows [r*c, (r+1)*c) of
                       each of q, k and v (three pieces of the canonical weight)
    attention c_proj   row-parallel: columns [r*c, (r+1)*c); bias replicated
    MLP c_fc           column-parallel: rows [4rc, 4(r+1)c)
    MLP c_proj         row-parallel: columns [4rc, 4(r+1)c); bias replicated
    embedding = head   vocabulary-parallel: rows [r*Vl, (r+1)*Vl) of the
                       vocabulary (its model.vocab_pad_to rows) padded to N*Vl;
                       padded rows belong to no canonical tensor, get -inf
                       logits, never a gradient
    LayerNorms, wpe    replicated

Per layer and micro-batch that is one all-reduce after attention and one
after the MLP in forward (g), and the matching two in backward (f); plus one
all-reduce after the embedding (forward), one before the LM head (backward)
and two scalar-per-token all-reduces in the loss (forward).

Sequence parallelism (`parallel.sequence_parallel`) splits the sequence
between those regions: LayerNorms, dropout and residual adds work on T/N
tokens per rank; each g becomes a reduce-scatter and each f an all-gather
(same bytes, activations 1/N). Replicated parameters used on sequence shards
(LayerNorms, row-parallel biases, wpe) then get a partial gradient on each
rank, marked `partial_grad`: the data-parallel strategy sums them over TP
after backward.

Random state: dropout on replicated activations must draw the same mask on
every TP rank, dropout on split activations different ones (Megatron's RNG
tracker). Every step, the default generator is seeded from (trainer.seed,
step, dp rank) -- the same on all TP ranks -- and each TP rank's own stream
from that and its TP rank; attention dropout (heads split) draws from the
own stream. Under sequence parallelism every activation outside attention
is split too, so the default generator is seeded per TP rank as well. All of
it is a function of the step: a resumed run draws the same masks.
"""

from dataclasses import dataclass

import torch

from parallel import model_plan as plan
from parallel.grid import derive_seed
from parallel.placement import Placement
from parallel.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, SequenceShardPositions,
                                TPRandom, VocabParallelEmbedding, VocabParallelLMHead,
                                VocabParallelLoss)


@dataclass
class TPContext:
    """What the TP layers share: the group, the counted collectives, the random streams."""
    group: object
    size: int
    rank: int
    comm: object
    sequence_parallel: bool
    random: TPRandom

    def reseed(self, seed):
        """`seed` is the same on every TP rank of a step; derive this rank's streams."""
        if self.sequence_parallel:  # every activation outside attention is split too
            torch.manual_seed(derive_seed(seed, "tp sequence shard", self.rank))
        self.random.seed_own(derive_seed(seed, "tp own", self.rank))


def padded_vocab(vocab_size, tp):
    """Rows per rank of a vocabulary padded to a multiple of tp."""
    return -(-vocab_size // tp)


def apply_tensor_parallel(model, grid, cfg, comm):
    """Shard `model` (a GPT) in place over grid.tp_group, as the model plan says
    (parallel/model_plan.py); returns (placements, TPContext)."""
    tp = TPContext(grid.tp_group, grid.tp_size, grid.tp_rank, comm, cfg.sequence_parallel,
                   TPRandom(grid.device))
    N, r = tp.size, tp.rank
    canonical = {name: tuple(p.shape) for name, p in model.named_parameters()}
    sharded = {}  # name -> (dim, pieces, local shape)

    def column(module, rows, name):
        """rows: [(canonical start, length)], laid end to end in the local weight."""
        layer = ColumnParallelLinear(module, rows, tp)
        pieces = tuple((start, sum(n for _, n in rows[:i]), n) for i, (start, n) in enumerate(rows))
        sharded[f"{name}.weight"] = (0, pieces, tuple(layer.weight.shape))
        if layer.bias is not None:
            sharded[f"{name}.bias"] = (0, pieces, tuple(layer.bias.shape))
        return layer

    def row(module, start, length, name):
        layer = RowParallelLinear(module, start, length, tp)
        sharded[f"{name}.weight"] = (1, ((start, 0, length),), tuple(layer.weight.shape))
        return layer

    for i, block in plan.blocks(model):
        for linear in plan.tp_linears(block):
            name = plan.block_prefix(i) + linear.path
            module = block.get_submodule(linear.path)
            if linear.style == "column":  # this rank's share of each fused part (q, k, v)
                part = module.out_features // linear.fused
                share = part // N
                layer = column(module, [(k * part + r * share, share) for k in range(linear.fused)], name)
            else:
                share = module.in_features // N
                layer = row(module, r * share, share, name)
            plan.swap_linear(block, linear.path, layer)

    V, C = model.config.vocab_size, model.config.n_embd
    canonical[plan.TIED] = (V, C)  # model.vocab_pad_to's rows are padding too: in no piece
    rows = padded_vocab(plan.token_embedding(model).weight.size(0), N)
    start, n_real = r * rows, max(0, min(rows, V - r * rows))
    embedding = VocabParallelEmbedding(plan.token_embedding(model), start, n_real, rows, tp)
    plan.set_vocab_parallel(model, embedding, VocabParallelLMHead(embedding, tp),  # tied: same rows
                            VocabParallelLoss(embedding, tp))
    sharded[plan.TIED] = (0, ((start, 0, n_real),) if n_real else (), (rows, C))
    if tp.sequence_parallel:
        plan.set_position_embedding(model, SequenceShardPositions(plan.position_embedding(model), tp))

    placements = {}
    for name, p in model.named_parameters():
        if name in sharded:
            dim, pieces, local_shape = sharded[name]
            placements[name] = Placement(name, canonical[name], local_shape, dim, pieces)
        else:
            placements[name] = Placement.whole(name, canonical[name], tp_replicated=True,
                                               partial_grad=tp.sequence_parallel)
        assert tuple(p.shape) == placements[name].local_shape, name
    return placements, tp
