"""Tensor-parallel layers that replace the GPT's own, each built from the full layer.

Every layer keeps the replaced layer's parameter names (`weight`, `bias`), so
the model's canonical names, optimizer groups and weight tying still hold;
parallel/tensor_parallel/apply.py records which part of each canonical tensor a
layer keeps (its Placement).

- ColumnParallelLinear: this rank's output features (rows of the weight).
  f on the input (or the sequence all-gather), no communication after.
- RowParallelLinear: this rank's input features (columns of the weight);
  g on the output (or the sequence reduce-scatter), then the bias, which is
  replicated and so added once.
- VocabParallelEmbedding: rows [start, start + n_real) of the vocabulary,
  plus zero rows that pad it to a size tp divides; ids of other ranks look
  up zeros, and g sums the ranks' lookups.
- VocabParallelLMHead + VocabParallelLoss: the tied weight's local rows give
  local logits; the loss combines them across ranks (parallel/tensor_parallel/ops.py).
- SequenceShardPositions: under sequence parallelism, the position
  embeddings of this rank's sequence shard.

Between a column- and a row-parallel linear, activations are split across
TP ranks (heads, or MLP features), so dropout there (attention dropout) must
draw different masks on each rank: the column layer switches to the TP rank's
own random stream, the row layer switches back (TPRandom).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel.compile import eager_under_compile
# the operators through their module: under trainer.compile they are replaced there
from parallel.tensor_parallel import ops
from parallel.tensor_parallel.ops import vocab_parallel_cross_entropy


class TPRandom:
    """Two random streams on the device's default generator: the shared one (seeded
    alike on every TP rank: masks on replicated activations agree) and this TP
    rank's own (masks on split activations differ), swapped in and out."""

    def __init__(self, device):
        self.gen = (torch.cuda.default_generators[device.index or 0] if device.type == "cuda"
                    else torch.default_generator)
        self.own_state, self.saved = None, None

    def seed_own(self, seed):
        shared = self.gen.get_state()
        self.gen.manual_seed(seed)
        self.own_state = self.gen.get_state()
        self.gen.set_state(shared)

    # generator states cannot be traced: under trainer.compile these run eagerly
    # between compiled pieces (parallel/compile.py)
    @eager_under_compile
    def enter_own(self):
        if self.own_state is not None and self.saved is None:
            self.saved, state = self.gen.get_state(), self.own_state
            self.gen.set_state(state)

    @eager_under_compile
    def leave_own(self):
        if self.saved is not None:
            self.own_state = self.gen.get_state()
            self.gen.set_state(self.saved)
            self.saved = None


def _rows(weight, rows):
    """Rows [start, start + length) of `weight` for each (start, length), end to end (one
    range: a view, as the callers clone; torch.cat on the planner's meta tensors runs a
    Python reference)."""
    if len(rows) == 1:
        (start, length), = rows
        return weight[start:start + length]
    return torch.cat([weight[start:start + length] for start, length in rows])


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear, rows, tp):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(_rows(linear.weight.detach(), rows).clone())
        self.bias = None if linear.bias is None else nn.Parameter(
            _rows(linear.bias.detach(), rows).clone())

    def forward(self, x):
        x = ops.gather_seq(x, self.tp) if self.tp.sequence_parallel else ops.copy_to_tp(x, self.tp)
        y = F.linear(x, self.weight, self.bias)
        self.tp.random.enter_own()  # activations are split from here to the row layer
        return y


class RowParallelLinear(nn.Module):
    def __init__(self, linear, start, length, tp):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(linear.weight.detach()[:, start:start + length].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        self.tp.random.leave_own()
        y = F.linear(x, self.weight)
        y = ops.scatter_seq(y, self.tp) if self.tp.sequence_parallel else ops.reduce_from_tp(y, self.tp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, embedding, start, n_real, n_local, tp):
        super().__init__()
        self.tp, self.start, self.n_real = tp, start, n_real
        weight = embedding.weight.detach()
        local = weight.new_zeros(n_local, weight.size(1))
        local[:n_real] = weight[start:start + n_real]
        self.weight = nn.Parameter(local)

    def forward(self, idx):
        other = (idx < self.start) | (idx >= self.start + self.n_real)
        out = F.embedding((idx - self.start).masked_fill(other, 0), self.weight)
        out = out.masked_fill(other.unsqueeze(-1), 0.0)
        return ops.scatter_seq(out, self.tp) if self.tp.sequence_parallel else ops.reduce_from_tp(out, self.tp)


class VocabParallelLMHead(nn.Module):
    """Local logits (..., V_local) from the tied embedding's local rows."""

    def __init__(self, embedding, tp):
        super().__init__()
        self.tp = tp
        self.weight = embedding.weight  # tied: the same Parameter

    def forward(self, x):
        x = ops.gather_seq(x, self.tp) if self.tp.sequence_parallel else ops.copy_to_tp(x, self.tp)
        return F.linear(x, self.weight)


class VocabParallelLoss(nn.Module):
    """Mean cross-entropy over tokens from vocabulary-split logits (the GPT's `cross_entropy`)."""

    def __init__(self, embedding, tp):
        super().__init__()
        self.tp, self.start, self.n_real = tp, embedding.start, embedding.n_real

    def forward(self, logits, target):
        return vocab_parallel_cross_entropy(logits, target, self.tp, self.start, self.n_real).mean()


class SequenceShardPositions(nn.Module):
    def __init__(self, embedding, tp):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(embedding.weight.detach().clone())

    def forward(self, pos):
        n = pos.numel() // self.tp.size
        return F.embedding(pos[self.tp.rank * n:(self.tp.rank + 1) * n], self.weight)
