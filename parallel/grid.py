"""The process grid: world = dp x pp x tp, TP fastest-varying.

Built once in main.py and passed to whoever needs it; nothing deep inside
reads environment variables or global state. Rank r sits at coordinates
(dp_rank, pp_rank, tp_rank) of `torch.arange(world).view(dp, pp, tp)`, so the
ranks of one TP group are neighbours (same node), as Megatron arranges them.
"""

import hashlib

import torch
import torch.distributed as dist

from errors import UserError

DIMS = ("dp", "pp", "tp")  # the grid's axes, slowest- to fastest-varying


class ProcessGrid:
    def __init__(self, dp: int, pp: int, tp: int, device: torch.device):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        assert dp * pp * tp == self.world_size, "validated in config.py before we get here"
        self.dp_size, self.pp_size, self.tp_size = dp, pp, tp
        self.device = device
        self.ranks = torch.arange(self.world_size).view(dp, pp, tp)
        self.dp_rank, self.pp_rank, self.tp_rank = (
            int(c) for c in (self.ranks == self.rank).nonzero()[0])
        # every rank must create every group, in the same order
        self._groups = {}
        self.dp_group = self.group_over("dp")
        self.pp_group = self.group_over("pp")
        self.tp_group = self.group_over("tp")

    def group_over(self, *dims):
        """The group of ranks that differ only in the coordinates `dims` (names among
        dp, pp, tp), holding this rank. Collective the first time: every rank must ask
        for the same groups in the same order."""
        axes = tuple(sorted(DIMS.index(d) for d in dims))
        if axes not in self._groups:
            rest = [a for a in range(3) if a not in axes]
            size = 1
            for a in axes:
                size *= self.ranks.size(a)
            lines = self.ranks.permute(*rest, *axes).reshape(-1, size)
            self._groups[axes] = self.group_of_lines(lines.tolist())
        return self._groups[axes]

    def group_of_lines(self, lines):
        """Create a group for each list of global ranks in `lines` (collective: every rank
        passes the same lines) and return the one holding this rank, or None."""
        mine = None
        for line in lines:
            group = dist.new_group(line) if len(line) < self.world_size else dist.group.WORLD
            if self.rank in line:
                mine = group
        return mine

    @property
    def is_main(self):
        """The one rank that writes snapshots, metrics and logs for the whole job."""
        return self.rank == 0

    def all_ok(self, ok: bool) -> bool:
        """True on every rank iff `ok` was true on every rank (so all stop together)."""
        flag = torch.tensor([1 if ok else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def __repr__(self):
        return (f"ProcessGrid(dp={self.dp_size}, pp={self.pp_size}, tp={self.tp_size}; rank {self.rank} "
                f"at dp={self.dp_rank} pp={self.pp_rank} tp={self.tp_rank})")


def together(grid, what, fn):
    """Run fn on every rank; if it fails on any rank, every rank raises, so none is left
    waiting in the next collective for a rank that has gone."""
    try:
        result, error = fn(), None
    except UserError as e:
        result, error = None, e
    except Exception as e:  # s3 errors, a full disk, wandb refusing to start, ...
        result, error = None, UserError(f"{what} failed: {type(e).__name__}: {e}")
    if not grid.all_ok(error is None):
        raise error or UserError(f"stopping: another rank failed while {what} (see its error)")
    return result


def derive_seed(*parts):
    """A 63-bit seed for one random stream of one grid coordinate, from ints and names:
    distinct tuples give unrelated seeds (sums or products of the parts can collide:
    rank 0's stream 2 would be rank 1's stream 1)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
