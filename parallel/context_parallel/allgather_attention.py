"""The reference our ring is measured against (`parallel.cp_impl=allgather`): every rank
all-gathers the keys and values of the whole sequence, then attends its own queries to
them with a causal mask on the true positions (Llama 3's context parallelism).

PyTorch's own (torch.distributed.tensor.experimental.context_parallel) does not run on
CPU in torch 2.13: its ring handles only the CUDA attention kernels (docs/benchmarks.md).
Simpler than the ring and with fewer, larger messages, but every rank holds the whole
sequence's keys and values and a (T/N) x T score matrix: what the ring avoids. Per
layer and micro-batch: one all-gather of K and V forward, one reduce-scatter of their
gradients backward, through the counted comm.
"""

import torch
import torch.nn.functional as F
from torch.autograd import Function

from parallel.compile import eager_under_compile


class _GatherKV(Function):
    """(2, B, H, T/N, d) on each rank -> (N, 2, B, H, T/N, d), ranks in cp order;
    backward: each rank's slice of the summed gradient (reduce-scatter)."""

    @staticmethod
    def forward(ctx, kv, cp):
        ctx.cp = cp
        out = kv.new_empty((cp.size,) + tuple(kv.shape))
        cp.comm.all_gather(out.view(-1, *kv.shape[1:]), kv.contiguous(), group=cp.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        grad = grad.contiguous()
        mine = grad.new_empty(grad.shape[1:])
        cp.comm.reduce_scatter(mine, grad.view(-1, *grad.shape[2:]), group=cp.group)
        return mine, None


@eager_under_compile  # a collective: eager under trainer.compile (parallel/compile.py)
def gather_kv(kv, cp):
    return _GatherKV.apply(kv, cp)


def allgather_attention(q, k, v, dropout_p, cp):
    """Causal attention of this rank's zigzag chunks against the gathered sequence."""
    length = q.size(2)
    everyone = gather_kv(torch.stack([k, v]), cp)  # (N, 2, B, H, T/N, d)
    positions = torch.cat([cp.positions_of(r, length) for r in range(cp.size)]).to(q.device)
    order = torch.argsort(positions)  # gathered tokens in their true order
    kv = everyone.permute(1, 2, 3, 0, 4, 5).reshape(2, q.size(0), q.size(1), -1, q.size(3))
    keys, values = kv[0][:, :, order], kv[1][:, :, order]
    mine = cp.positions(length).to(q.device)
    mask = torch.arange(keys.size(2), device=q.device)[None, :] <= mine[:, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout_p)
