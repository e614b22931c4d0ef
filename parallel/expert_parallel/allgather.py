"""The reference expert-parallel exchange (`parallel.ep_impl=allgather`), what the
all-to-all (dispatch.py) is measured against: no rank learns where tokens go first.

Per MoE block and micro-batch, on each rank of an ep group (all holding N tokens):
  1. all-gather every rank's tokens (ep x N x C) and their choices;
  2. compute this rank's experts on the choices that picked them, grouped by expert;
  3. each choice's output in its place of an (ep x N x k, C) tensor of zeros, and one
     reduce-scatter: every rank gets the outputs of its own tokens' choices, each
     computed by exactly one rank, then weighs and sums them as the all-to-all does.
The backward mirrors both (reduce-scatter of the tokens' gradients, all-gather of the
outputs'). It moves ep x N x C elements gathered and ep x N x k x C reduce-scattered a
way, where the all-to-all moves N x k x C: what the all-to-all saves grows with ep.
"""

import torch
from torch.autograd import Function

from moe.experts import compute_dtype
from moe.layer import combine, sort_by_expert
from parallel.compile import eager_under_compile


class _GatherRows(Function):
    @staticmethod
    def forward(ctx, x, exchange):
        ctx.exchange = exchange
        return exchange.gather(x.contiguous())

    @staticmethod
    def backward(ctx, grad):
        return ctx.exchange.scatter(grad.contiguous()), None


class _ScatterRows(Function):
    @staticmethod
    def forward(ctx, x, exchange):
        ctx.exchange = exchange
        return exchange.scatter(x.contiguous())

    @staticmethod
    def backward(ctx, grad):
        return ctx.exchange.gather(grad.contiguous()), None


class AllGatherExchange:
    def __init__(self, group, ep, rank, comm):
        self.group, self.ep, self.rank, self.comm = group, ep, rank, comm

    def gather(self, x):
        out = x.new_empty((self.ep * x.size(0),) + tuple(x.shape[1:]))
        self.comm.all_gather(out, x, group=self.group)
        return out

    def scatter(self, x):
        out = x.new_empty((x.size(0) // self.ep,) + tuple(x.shape[1:]))
        self.comm.reduce_scatter(out, x, group=self.group)
        return out

    @eager_under_compile  # collectives: compiled regions stop here (parallel/compile.py)
    def __call__(self, tokens, experts, weights, counts, module):
        N, k = experts.shape
        held = module.fc_weight.size(0)
        everyone = _GatherRows.apply(tokens.to(compute_dtype(tokens)), self)  # 1.
        with self.comm.uncounted():  # the choices: small integers, not what is compared
            choices = self.gather(experts.contiguous())
        mine = choices.reshape(-1) - self.rank * held                   # this rank's experts
        picked = ((mine >= 0) & (mine < held)).nonzero().squeeze(1)    # 2. flat choice indices
        local = mine[picked]
        order = torch.argsort(local, stable=True)
        picked = picked[order]
        y = module(everyone[picked // k], torch.bincount(local, minlength=held))
        outputs = y.new_zeros(self.ep * N * k, y.size(1)).index_copy(0, picked, y)  # 3.
        mine_back = _ScatterRows.apply(outputs, self)                  # (N x k, C) in choice order
        order, rows = sort_by_expert(experts)
        return combine(mine_back[order], order, rows, weights, tokens)
