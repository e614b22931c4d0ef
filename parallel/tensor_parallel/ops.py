"""Tensor parallelism's communication, as small autograd Functions (Megatron's f and g).

    f  copy_to_tp        forward: identity              backward: all-reduce over TP
    g  reduce_from_tp    forward: all-reduce over TP    backward: identity

A column-parallel linear starts with f (every rank has the whole input and
computes its own output features; each rank's input gradient is a partial
sum), a row-parallel linear ends with g (each rank computes a partial sum of
the output). Under sequence parallelism the activations outside those pairs
are split along the sequence, and the pair becomes

    gather_seq           forward: all-gather sequence   backward: reduce-scatter
    scatter_seq          forward: reduce-scatter seq    backward: all-gather

moving the same bytes as one all-reduce (which is a reduce-scatter plus an
all-gather) while activations between blocks stay 1/tp the size. Under bf16/fp16
autocast the all-gathered activation (a LayerNorm's fp32 output) feeds a matmul that
would cast it to the low precision anyway: `gather_seq` casts it first, so the
all-gather, and its backward's reduce-scatter, move half the bytes (Megatron moves
them in bf16 too); the forward is unchanged to the bit, the backward's sum is
rounded to bf16 once per rank.

`vocab_parallel_cross_entropy` computes the loss from vocabulary-sharded
logits without any rank holding all of them: the max, the sum of exponentials
and the target's logit are combined by two all-reduces (a MAX, then one SUM
of both sums stacked).

Every collective goes through the TP context's counted `comm` (parallel/comm.py).
Under `trainer.compile` the four operators run eagerly between compiled pieces of a
block (`eager_under_compile`, parallel/compile.py says why).
"""

import torch
import torch.distributed as dist
from torch.autograd import Function

from parallel.compile import eager_under_compile


class _CopyToTP(Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        ctx.tp.comm.all_reduce(grad, group=ctx.tp.group)
        return grad, None


class _ReduceFromTP(Function):
    @staticmethod
    def forward(ctx, x, tp):
        x = x.contiguous().clone()  # all-reduce works in place; autograd may still need x
        tp.comm.all_reduce(x, group=tp.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _all_gather_seq(x, tp):
    """(B, T/tp, ...) on each rank -> (B, T, ...), ranks' shards in rank order."""
    x = x.transpose(0, 1).contiguous()
    out = x.new_empty((x.size(0) * tp.size,) + tuple(x.shape[1:]))
    tp.comm.all_gather(out, x, group=tp.group)
    return out.transpose(0, 1)


def _reduce_scatter_seq(x, tp):
    """(B, T, ...) partial sums on each rank -> this rank's (B, T/tp, ...) of the sum."""
    x = x.transpose(0, 1).contiguous()
    out = x.new_empty((x.size(0) // tp.size,) + tuple(x.shape[1:]))
    tp.comm.reduce_scatter(out, x, group=tp.group)
    return out.transpose(0, 1)


class _GatherSeq(Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _all_gather_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.tp), None


class _ScatterSeq(Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.tp), None


@eager_under_compile  # a collective: compiled regions stop here (parallel/compile.py)
def copy_to_tp(x, tp):
    return _CopyToTP.apply(x, tp)


@eager_under_compile  # a collective: compiled regions stop here (parallel/compile.py)
def reduce_from_tp(x, tp):
    return _ReduceFromTP.apply(x, tp)


def compute_dtype(x):
    """The dtype a matmul under the current autocast would cast `x` to (its own if none)."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


@eager_under_compile  # a collective: compiled regions stop here (parallel/compile.py)
def gather_seq(x, tp):
    """All-gather the sequence shards of x, the input of a column-parallel matmul: in the
    dtype that matmul computes in (under autocast: the low precision)."""
    return _GatherSeq.apply(x.to(compute_dtype(x)), tp)


@eager_under_compile  # a collective: compiled regions stop here (parallel/compile.py)
def scatter_seq(x, tp):
    return _ScatterSeq.apply(x, tp)


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, target, tp, vocab_start, n_real):
        """logits: (N, V_local) for vocabulary ids [vocab_start, vocab_start + V_local), of
        which the first n_real are real (the rest pad a vocabulary tp does not divide)."""
        logits = logits.float().clone()
        logits[:, n_real:] = float("-inf")  # padded ids take no probability mass
        top = logits.max(dim=1).values
        tp.comm.all_reduce(top, group=tp.group, op=dist.ReduceOp.MAX)
        logits -= top.unsqueeze(1)
        mine = (target >= vocab_start) & (target < vocab_start + n_real)
        local_target = torch.where(mine, target - vocab_start, 0)
        # where, not * mine: a rank of padding only (model.vocab_pad_to) gathers -inf
        target_logit = torch.where(mine, logits.gather(1, local_target.unsqueeze(1)).squeeze(1), 0.0)
        exp = logits.exp_()
        sums = torch.stack([exp.sum(dim=1), target_logit])
        tp.comm.all_reduce(sums, group=tp.group)  # sum of exponentials, target logit
        sum_exp, target_logit = sums
        exp /= sum_exp.unsqueeze(1)  # now the softmax, kept for backward
        ctx.save_for_backward(exp, mine, local_target)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, local_target = ctx.saved_tensors
        grad_logits = softmax  # d loss_i / d logit_ij = softmax_ij - [j == target_i]
        rows = torch.arange(grad_logits.size(0), device=grad_logits.device)
        grad_logits[rows, local_target] -= mine.to(grad_logits.dtype)
        return grad_logits * grad.unsqueeze(1), None, None, None, None


def vocab_parallel_cross_entropy(logits, target, tp, vocab_start, n_real):
    """Per-token losses, identical on every TP rank."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp, vocab_start, n_real)


# ---------------------------------------------------------------- a replicated region's tokens
# Between the TP pairs (without sequence parallelism) every TP rank holds the same
# activations; a module there that must not compute every token on every rank (a
# mixture-of-experts block: a token routed tp times) takes its sequence shard and gives
# the shards back. Megatron's scatter_to / gather_from_sequence_parallel_region.

class _TakeSeqShard(Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.chunk(tp.size, dim=1)[tp.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):  # each rank's share of the (replicated) input's gradient
        return _all_gather_seq(grad.contiguous(), ctx.tp), None


class _JoinSeqShards(Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _all_gather_seq(x.contiguous(), tp).contiguous()

    @staticmethod
    def backward(ctx, grad):  # the same gradient on every rank: keep this rank's shard
        return grad.chunk(ctx.tp.size, dim=1)[ctx.tp.rank].contiguous(), None


@eager_under_compile  # a collective: compiled regions stop here (parallel/compile.py)
def take_seq_shard(x, tp):
    """forward: this rank's sequence shard of replicated x; backward: all-gather."""
    return _TakeSeqShard.apply(x, tp)


@eager_under_compile  # a collective: compiled regions stop here (parallel/compile.py)
def join_seq_shards(x, tp):
    """forward: all-gather the ranks' sequence shards; backward: this rank's shard."""
    return _JoinSeqShards.apply(x, tp)
