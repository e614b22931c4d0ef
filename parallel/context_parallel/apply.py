"""`parallel.cp=N`: context parallelism, applied to the GPT from outside.

Each sequence of a micro-batch is split over the N ranks of the cp group in the
zigzag order (ring_attention.py): rank r keeps chunks r and 2N-1-r of its 2N
chunks, for tokens, targets and positions alike (`CPContext.split`, called by
the strategy on every micro-batch). Everything but attention is per token, so
it runs on the local tokens unchanged; attention, the model plan's one seam
(`attend`), becomes the ring. The position embedding gets each token's true
position (a forward pre-hook maps the model's 0..T/N-1 to them, so under
sequence parallelism the TP shard then takes its part of the true positions).

Every cp rank sees other tokens of the same parameters: the loss of a rank is
the mean over its tokens, and gradients are averaged over dp x cp, the grid's
gradient group (cp is in GRAD_DIMS), by whichever data-parallel strategy runs.

Per layer and micro-batch: N-1 exchanges of this rank's keys and values (2 x
the local K/V bytes) in forward, N-1 of keys, values and their gradients plus
one of the gradients in backward.
"""

import functools
from dataclasses import dataclass, field

import torch

from parallel import model_plan as plan
from parallel.context_parallel.ring_attention import zigzag_positions
from parallel.registry import CP_IMPLEMENTATIONS, load


@dataclass
class CPContext:
    group: object
    size: int
    rank: int
    comm: object
    right: int   # global rank this rank sends keys to
    left: int    # global rank it receives them from
    _positions: dict = field(default_factory=dict)

    def positions(self, length, device=None):
        """True positions of this rank's `length` tokens (cached per length and device)."""
        return self.positions_of(self.rank, length, device)

    def positions_of(self, rank, length, device=None):
        """True positions of cp rank `rank`'s `length` tokens, on `device` (None: the
        host). Cached: every forward asks again, and a copy to the GPU each time would
        be a host-to-device transfer per layer and step."""
        key = (rank, length, None if device is None else torch.device(device))
        if key not in self._positions:
            host = self._positions.get((rank, length, None))
            if host is None:
                host = zigzag_positions(rank, self.size, length)
                self._positions[rank, length, None] = host
            self._positions[key] = host.to(key[2]) if key[2] is not None else host
        return self._positions[key]

    def split(self, x, y):
        """This rank's zigzag chunks of every sequence of a micro-batch (B, T)."""
        keep = self.positions(x.size(1) // self.size).to(x.device)
        return x[:, keep], y[:, keep]

    def pass_on(self, tensor):
        """Send `tensor` to the right, receive the left's (same shape); returns a function
        that waits for both and gives what came in (call it after overlapping work)."""
        incoming = torch.empty_like(tensor)
        works = self.comm.exchange(sends=[(tensor, self.right)], recvs=[(incoming, self.left)],
                                   group=self.group)

        def arrived():
            for work in works:
                work.wait()
            return incoming
        return arrived


def apply_context_parallel(model, grid, comm, impl="ring"):
    """Give every block's attention the ring (or the all-gather reference), and the
    position embedding the true positions; returns the CPContext (whose `split` the
    strategy applies to batches)."""
    me = grid.cp_rank
    cp = CPContext(grid.cp_group, grid.cp_size, me, comm,
                   right=grid.rank_at(cp=(me + 1) % grid.cp_size),
                   left=grid.rank_at(cp=(me - 1) % grid.cp_size))
    for _, block in plan.blocks(model):
        plan.set_attention(block, functools.partial(load(CP_IMPLEMENTATIONS[impl]), cp=cp))

    def true_positions(module, args):
        (pos,) = args
        return (cp.positions(pos.numel(), pos.device)[pos],)
    plan.position_embedding(model).register_forward_pre_hook(true_positions)
    return cp
