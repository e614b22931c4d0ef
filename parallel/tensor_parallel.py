"""`parallel.tp=N`: Megatron-style tensor parallelism, applied to the GPT from outside.

`apply_tensor_parallel` swaps the GPT's layers for the TP layers of
parallel/tp_layers.py, in place, and returns each parameter's Placement
(parallel/placement.py). On TP rank r of N, with C = n_embd and c = C / N:

    attention c_attn   column-parallel by whole heads: rows [r*c, (r+1)*c) of
                       each of q, k and v (three pieces of the canonical weight)
    attention c_proj   row-parallel: columns [r*c, (r+1)*c); bias replicated
    MLP c_fc           column-parallel: rows [4rc, 4(r+1)c)
    MLP c_proj         row-parallel: columns [4rc, 4(r+1)c); bias replicated
    wte = LM head      vocabulary-parallel: rows [r*Vl, (r+1)*Vl) of the
                       vocabulary padded to N*Vl; padded rows belong to no
                       canonical tensor, get -inf logits, never a gradient
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

from parallel.grid import derive_seed
from parallel.placement import Placement
from parallel.tp_layers import (ColumnParallelLinear, RowParallelLinear, SequenceShardPositions,
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
    """Shard `model` (a GPT) in place over grid.tp_group; returns (placements, TPContext)."""
    tp = TPContext(grid.tp_group, grid.tp_size, grid.tp_rank, comm, cfg.sequence_parallel,
                   TPRandom(grid.device))
    C, N, r = model.config.n_embd, tp.size, tp.rank
    c = C // N
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

    for i, block in enumerate(model.transformer.h):
        at = f"transformer.h.{i}"
        qkv = [(part * C + r * c, c) for part in range(3)]  # this rank's heads of q, k and v
        block.attn.c_attn = column(block.attn.c_attn, qkv, f"{at}.attn.c_attn")
        block.attn.c_proj = row(block.attn.c_proj, r * c, c, f"{at}.attn.c_proj")
        block.mlp.c_fc = column(block.mlp.c_fc, [(4 * r * c, 4 * c)], f"{at}.mlp.c_fc")
        block.mlp.c_proj = row(block.mlp.c_proj, 4 * r * c, 4 * c, f"{at}.mlp.c_proj")

    V = model.config.vocab_size
    rows = padded_vocab(V, N)
    start, n_real = r * rows, max(0, min(rows, V - r * rows))
    wte = VocabParallelEmbedding(model.transformer.wte, start, n_real, rows, tp)
    model.transformer.wte = wte
    model.lm_head = VocabParallelLMHead(wte, tp)  # tied: the same local rows
    model.cross_entropy = VocabParallelLoss(wte, tp)
    sharded["transformer.wte.weight"] = (0, ((start, 0, n_real),) if n_real else (), (rows, C))
    if tp.sequence_parallel:
        model.transformer.wpe = SequenceShardPositions(model.transformer.wpe, tp)

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
