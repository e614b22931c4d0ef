"""The expert groups' membership (parallel/grid.py's carve_experts), in process.

Every rank of a few layouts builds its ProcessGrid under PyTorch's fake process-group
backend (no peer answers; a group is its list of ranks), and the groups it holds are
held to lists written out by hand:
- the ep group: the ranks of one replica group, pipeline stage and TP rank whose dp x cp
  slots (slot = dp x cp_size + cp) share slot // ep: they trade tokens;
- the expert-data-parallel group (expert_grad_group): the ranks of one pipeline stage and
  TP rank, over every replica group, at the same slot % ep: they hold the same experts
  and average their gradients (ddp_naive, ddp_bucket);
- the expert shard group (expert_shard_group): those of one replica group: fsdp shards
  the experts over it;
and each rank's ep_rank, expert_grad_rank and expert_shard_rank is its place in its
group, each size its group's length.

The parity cases (test_experts.py) see a group only where it makes a collective: an
expert-data-parallel group of one rank sends nothing, and a group taken for another of
the same size trains the same. These lists see every member.
"""

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from parallel.grid import ProcessGrid


@contextmanager
def fake_rank(rank, world):
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


GROUPS = (("ep_group", "ep_rank", "ep_size"),
          ("expert_grad_group", "expert_grad_rank", "expert_grad_size"),
          ("expert_shard_group", "expert_shard_rank", "expert_shard_size"))


def groups_seen(sizes, ep):
    """{group attribute: sorted list of the rank lists the ranks hold}, after checking on
    every rank that it is in its group, at its index, of its size."""
    world = 1
    for n in sizes.values():
        world *= n
    seen = {name: set() for name, _, _ in GROUPS}
    for rank in range(world):
        with fake_rank(rank, world):
            grid = ProcessGrid(sizes, torch.device("cpu"), ep=ep)
            for name, rank_attr, size_attr in GROUPS:
                members = dist.get_process_group_ranks(getattr(grid, name))
                assert members.index(rank) == getattr(grid, rank_attr), (name, rank, members)
                assert len(members) == getattr(grid, size_attr), (name, rank, members)
                seen[name].add(tuple(members))
    return {name: sorted(list(m) for m in lists) for name, lists in seen.items()}


# (grid sizes, ep, ep groups, expert-data-parallel groups, expert shard groups), by hand:
# rank = ((((r x dp + d) x pp + p) x cp + c) x tp + t), slowest to fastest
LAYOUTS = {
    "dp6-ep2": ({"dp": 6}, 2,
                [[0, 1], [2, 3], [4, 5]],
                [[0, 2, 4], [1, 3, 5]],
                [[0, 2, 4], [1, 3, 5]]),
    "dp6-ep3": ({"dp": 6}, 3,
                [[0, 1, 2], [3, 4, 5]],
                [[0, 3], [1, 4], [2, 5]],
                [[0, 3], [1, 4], [2, 5]]),
    # slot = d x 2 + c = the rank
    "dp4cp2-ep4": ({"dp": 4, "cp": 2}, 4,
                   [[0, 1, 2, 3], [4, 5, 6, 7]],
                   [[0, 4], [1, 5], [2, 6], [3, 7]],
                   [[0, 4], [1, 5], [2, 6], [3, 7]]),
    # rank = d x 2 + t: the even ranks are TP rank 0, the odd ones TP rank 1
    "dp6tp2-ep3": ({"dp": 6, "tp": 2}, 3,
                   [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]],
                   [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]],
                   [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]),
    "dp6tp2-ep2": ({"dp": 6, "tp": 2}, 2,
                   [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11]],
                   [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]],
                   [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]),
    # rank = d x 2 + p
    "dp4pp2-ep2": ({"dp": 4, "pp": 2}, 2,
                   [[0, 2], [1, 3], [4, 6], [5, 7]],
                   [[0, 4], [1, 5], [2, 6], [3, 7]],
                   [[0, 4], [1, 5], [2, 6], [3, 7]]),
    # HSDP, rank = r x 4 + d: the expert-DP group spans both replica groups, the shard
    # group one
    "hsdp2x4-ep2": ({"dp_replicate": 2, "dp": 4}, 2,
                    [[0, 1], [2, 3], [4, 5], [6, 7]],
                    [[0, 2, 4, 6], [1, 3, 5, 7]],
                    [[0, 2], [1, 3], [4, 6], [5, 7]]),
    # rank = (r x 3 + d) x 2 + t
    "hsdp2x3tp2-ep3": ({"dp_replicate": 2, "dp": 3, "tp": 2}, 3,
                       [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]],
                       [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]],
                       [[r] for r in range(12)]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_groups_hold_the_ranks_written_out_by_hand(layout):
    sizes, ep, ep_groups, expert_dp, expert_shard = LAYOUTS[layout]
    got = groups_seen(sizes, ep)
    assert got["ep_group"] == ep_groups
    assert got["expert_grad_group"] == expert_dp
    assert got["expert_shard_group"] == expert_shard
