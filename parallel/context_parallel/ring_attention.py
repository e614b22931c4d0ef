"""Ring attention over a zigzag split: causal attention when each of N ranks holds two
of the sequence's 2N chunks, without any rank holding the whole sequence's keys.

The sequence is cut into 2N chunks of c tokens; rank r holds chunks r and 2N-1-r
(its "head" and "tail": every rank then has the same amount of causal work). Each
rank keeps its queries; keys and values travel around the cp group, one rank's pair
of chunks per step, by point-to-point exchange through the counted comm: in step s
rank r holds the keys of rank j = r - s (mod N). Query chunk i sees key chunk k
fully if k < i, causally if k == i, not at all if k > i; so per step

    j == r: head x head (causal), tail x head (full), tail x tail (causal)
    j <  r: head x head (full),   tail x head (full)
    j >  r: tail x head (full),   tail x tail (full)

and the blocks that are entirely masked (head x tail, always) are never computed.
Partial results merge by the running log-sum-exp (online softmax), in fp32; a
block is c x c, so no rank holds a T x T score matrix.

Backward is a ring too: keys and values go around again together with the
gradients of keys and values accumulated so far; after N steps those gradients
are back on the rank that owns the keys. Dropout on the attention probabilities
draws each block's mask from a seed taken from the default generator in forward
(so it follows the step's random state and a recompute), regenerated in backward.
"""

import math

import torch
from torch.autograd import Function

from parallel.compile import eager_under_compile
from parallel.grid import derive_seed


def zigzag_chunks(rank, size):
    """The two chunk indices (of 2 * size) that `rank` holds."""
    return rank, 2 * size - 1 - rank


def zigzag_positions(rank, size, length):
    """The true positions of a rank's `length` tokens in a sequence of length * size."""
    c = length // 2
    head, tail = zigzag_chunks(rank, size)
    return torch.cat([torch.arange(head * c, (head + 1) * c), torch.arange(tail * c, (tail + 1) * c)])


def blocks(me, src, size):
    """[(query part, key part, causal)] that rank `me` computes against rank `src`'s keys
    (parts: 0 head, 1 tail); the rest is entirely masked."""
    if src == me:
        return [(0, 0, True), (1, 0, False), (1, 1, True)]
    if src < me:
        return [(0, 0, False), (1, 0, False)]
    return [(1, 0, False), (1, 1, False)]


def _scores(q, k, causal, scale):
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if causal:
        c = s.size(-1)
        s = s.masked_fill(torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _keep(seed, qp, kp, src, shape, p, device):
    """The dropout keep-mask of one block, scaled by 1 / (1 - p): a function of the seed
    and the block's identity only, so backward regenerates it."""
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(seed, qp, kp, src))
    return (torch.rand(shape, generator=gen, device=device) >= p).float() / (1.0 - p)


class _RingAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, cp, dropout_p):
        me, N = cp.rank, cp.size
        scale = 1.0 / math.sqrt(q.size(-1))
        # the masks' seed follows the step's random state (and a recompute's replay of it)
        seed = int(torch.randint(2**62, (), device=q.device)) if dropout_p > 0 else 0
        qs = q.chunk(2, dim=2)
        m = [torch.full(x.shape[:-1], float("-inf"), device=q.device) for x in qs]
        l = [torch.zeros(x.shape[:-1], device=q.device) for x in qs]  # noqa: E741
        acc = [torch.zeros(x.shape, device=q.device) for x in qs]
        kv = torch.stack([k, v]).contiguous()
        for step in range(N):
            src = (me - step) % N
            nxt = cp.pass_on(kv) if step < N - 1 else None  # overlaps this step's compute
            ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            for qp, kp, causal in blocks(me, src, N):
                s = _scores(qs[qp], ks[kp], causal, scale)
                m_new = torch.maximum(m[qp], s.amax(-1))
                p = torch.exp(s - m_new.unsqueeze(-1))
                correction = torch.exp(m[qp] - m_new)
                l[qp] = l[qp] * correction + p.sum(-1)
                if dropout_p > 0:
                    p = p * _keep(seed, qp, kp, src, p.shape, dropout_p, q.device)
                acc[qp] = acc[qp] * correction.unsqueeze(-1) + torch.matmul(p, vs[kp].float())
                m[qp] = m_new
            if nxt is not None:
                kv = nxt()
        # laid out (B, T, heads, d) in memory, as SDPA's output is: the model's transpose
        # back to (B, T, C) is then free, and the one tensor saved here is c_proj's input
        B, H, T, d = q.shape
        out = torch.empty(B, T, H, d, dtype=q.dtype, device=q.device).transpose(1, 2)
        c = T // 2
        for part, (a, li) in enumerate(zip(acc, l)):
            out[:, :, part * c:(part + 1) * c] = a / li.unsqueeze(-1)
        lse = torch.cat([mi + torch.log(li) for mi, li in zip(m, l)], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.dropout_p, ctx.seed, ctx.scale = cp, dropout_p, seed, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp, dropout_p, seed, scale = ctx.cp, ctx.dropout_p, ctx.seed, ctx.scale
        me, N = cp.rank, cp.size
        dout = grad_out.float()
        delta = (dout * out.float()).sum(-1)  # rowsum(dO * O): the softmax backward's correction
        qs, dos = q.chunk(2, dim=2), dout.chunk(2, dim=2)
        lses, deltas = lse.chunk(2, dim=2), delta.chunk(2, dim=2)
        dq = [torch.zeros(x.shape, device=q.device) for x in qs]
        # what travels: this rank's keys and values, then everyone's, with their gradients
        travel = torch.stack([k.float(), v.float(), torch.zeros_like(k, dtype=torch.float32),
                              torch.zeros_like(v, dtype=torch.float32)]).contiguous()
        for step in range(N):
            src = (me - step) % N
            ks, vs = travel[0].chunk(2, dim=2), travel[1].chunk(2, dim=2)
            dks, dvs = travel[2].chunk(2, dim=2), travel[3].chunk(2, dim=2)
            for qp, kp, causal in blocks(me, src, N):
                s = _scores(qs[qp], ks[kp], causal, scale)
                p = torch.exp(s - lses[qp].unsqueeze(-1))
                dp = torch.matmul(dos[qp], vs[kp].transpose(-2, -1))
                if dropout_p > 0:
                    keep = _keep(seed, qp, kp, src, p.shape, dropout_p, q.device)
                    dvs[kp].add_(torch.matmul((p * keep).transpose(-2, -1), dos[qp]))
                    dp = dp * keep
                else:
                    dvs[kp].add_(torch.matmul(p.transpose(-2, -1), dos[qp]))
                ds = p * (dp - deltas[qp].unsqueeze(-1)) * scale
                dq[qp].add_(torch.matmul(ds, ks[kp]))
                dks[kp].add_(torch.matmul(ds.transpose(-2, -1), qs[qp].float()))
            if step < N - 1:
                travel = cp.pass_on(travel)()
        dk, dv = cp.pass_on(travel[2:].contiguous())()  # one more hop: the gradients come home
        return (torch.cat(dq, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None)


def ring_attention(q, k, v, dropout_p, cp):
    """Causal attention of this rank's zigzag chunks; q, k, v: (B, heads, 2c, d)."""
    return _ring(q, k, v, dropout_p, cp)  # a global: under trainer.compile, the disabled one


@eager_under_compile  # exchanges between ranks: eager under trainer.compile (parallel/compile.py)
def _ring(q, k, v, dropout_p, cp):
    return _RingAttention.apply(q, k, v, cp, dropout_p)
