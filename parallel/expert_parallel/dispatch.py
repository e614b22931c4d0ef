"""The tokens' trip to the ranks that hold their experts, and back: Megatron's all-to-all
token dispatcher, dropless.

Per MoE block and micro-batch, on each rank of an ep group (experts e of rank r: the run
r x E/ep .. (r+1) x E/ep - 1):
  1. its N x k choices sorted by expert (so by destination rank, then expert, then token);
  2. one all-to-all of the choice counts per expert (E integers each way), from which
     every rank knows how many rows it sends each peer and receives from each;
  3. the rows, all-to-all with those uneven splits (`AllToAll`: forward dispatch, its
     backward the same exchange the other way);
  4. what arrived, (source, expert, token), regrouped by expert and computed grouped;
  5. the outputs back in arrival order, all-to-all back, weighted and summed into their
     tokens.
Per micro-batch and block each rank sends its tokens' N x k rows of C activations in 3
and receives as many in 5 (what it hands back depends on the routing: it averages the
same), and the backward does both again: 4 x N x k x C elements of its own tokens
(`comm_all_to_all_bytes` counts those, the same on every rank), in
the experts' compute dtype (bf16 under bf16 autocast), plus the counts
(`comm_all_to_all_counts_bytes`).
"""

import torch
from torch.autograd import Function

from moe.experts import compute_dtype
from moe.layer import combine, sort_by_expert
from parallel.compile import eager_under_compile


class AllToAll(Function):
    """all_to_all_single of rows with uneven splits; the backward sends the gradients back.
    Counted (`mine`): the side holding this rank's own tokens' rows, N x k of them whatever
    the routing: what the dispatch sends and the combine receives (forward), the reverse in
    backward. So each rank's `comm_all_to_all_bytes` is its textbook 4 x N x k x C x bytes."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, exchange, mine):
        ctx.splits, ctx.exchange, ctx.mine = (out_splits, in_splits), exchange, mine
        return exchange.send(x.contiguous(), out_splits, in_splits, mine)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        mine = "received" if ctx.mine == "sent" else "sent"
        return ctx.exchange.send(grad.contiguous(), in_splits, out_splits, mine), None, None, None, None


class AllToAllExchange:
    """The `exchange` of a MoE block whose experts this rank holds a run of (moe/layer.py)."""

    def __init__(self, group, ep, rank, comm):
        self.group, self.ep, self.comm = group, ep, comm

    def send(self, x, out_splits, in_splits, mine):
        """x's rows to the ranks, out_splits[r] of them to rank r; in_splits[r] arrive from
        rank r. mine: which side is this rank's own tokens' rows ("sent" / "received")."""
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        self.comm.all_to_all(out, x, out_splits, in_splits, group=self.group,
                             counted=x if mine == "sent" else out)
        return out

    @eager_under_compile  # collectives and host-side splits: compiled regions stop here
    def __call__(self, tokens, experts, weights, counts, module):
        ep = self.ep
        order, rows = sort_by_expert(experts)                       # 1.
        arriving = torch.empty_like(counts)                         # 2. [source][my expert]
        self.comm.all_to_all(arriving, counts.contiguous(), None, None, group=self.group,
                             kind="all_to_all_counts")
        held = arriving.numel() // ep
        send_splits = counts.view(ep, held).sum(1).tolist()
        by_source = arriving.view(ep, held)
        recv_splits = by_source.sum(1).tolist()
        # in the dtype the experts compute in (under autocast: bf16, half the bytes; the
        # forward is the same to the bit, as tensor parallelism's gather_seq)
        rows_out = tokens[rows].to(compute_dtype(tokens))
        got = AllToAll.apply(rows_out, recv_splits, send_splits, self, "sent")  # 3.
        expert_of_row = torch.arange(held, device=got.device).repeat(ep).repeat_interleave(
            by_source.reshape(-1), output_size=got.size(0))
        by_expert = torch.argsort(expert_of_row, stable=True)       # 4.
        y = module(got[by_expert], by_source.sum(0))
        y = y[torch.argsort(by_expert)]                             # 5. arrival order again
        back = AllToAll.apply(y, send_splits, recv_splits, self, "received")
        return combine(back, order, rows, weights, tokens)
