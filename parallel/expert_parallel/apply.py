"""Wire every mixture-of-experts block this rank holds into the grid, in place (on the
meta device, before the data-parallel strategy allocates):

- tensor parallelism (tp > 1): the router and experts are replicated over TP (they are not
  split: Megatron's expert-tensor-parallel size 1), and each TP rank routes a different
  share of the tokens, so that no token is routed tp times: its sequence shard, which
  sequence parallelism already holds, and which without it the block takes on entry and
  gives back on exit (tensor_parallel/ops.py: take_seq_shard / join_seq_shards). Each TP
  rank's router and expert gradients are then partial sums, summed over TP after the
  data-parallel sync (`partial_grad`, as sequence parallelism's LayerNorms).
- the balance loss counts each sequence's choices over every rank holding part of it
  (context parallelism's chunks, the TP shards): one all-reduce of B x E counts per block
  and micro-batch over the cp x tp group (`sum_counts`), never differentiated.
- expert parallelism (ep > 1): the block keeps experts ep_rank x E/ep .. of the stacked
  expert tensors (Placement dim 0, `expert`: averaged over grid.expert_grad_group), and
  its tokens travel by all-to-all over grid.ep_group (dispatch.py).
"""

import torch
import torch.nn as nn

from parallel import model_plan as plan
from parallel.compile import eager_under_compile
from parallel.placement import Placement
from parallel.registry import EP_IMPLEMENTATIONS, load
from parallel.tensor_parallel import ops


def apply_experts(model, grid, comm, placements, tp, ep_impl="alltoall"):
    """Rewire `model`'s MoE blocks (see above); returns the placements, with those of the
    routers and experts replaced. ep_impl: parallel.ep_impl (registry.EP_IMPLEMENTATIONS)."""
    placements = dict(placements)
    ep = grid.ep_size
    exchange = load(EP_IMPLEMENTATIONS[ep_impl])
    sequence_ranks = grid.cp_size * grid.tp_size
    counts_group = grid.group_over("cp", "tp") if sequence_ranks > 1 else None
    for i, moe in plan.moe_layers(model):
        if tp is not None and not tp.sequence_parallel:
            moe.enter = lambda x, tp=tp: ops.take_seq_shard(x, tp)
            moe.leave = lambda x, tp=tp: ops.join_seq_shards(x, tp)
        if counts_group is not None:
            moe.sum_counts = lambda counts: summed(counts, counts_group, comm)
        moe.summed_ranks = grid.tp_size
        held = moe.num_experts // ep
        for name, p in moe.named_parameters():
            canonical = f"{plan.block_prefix(i)}mlp.{name}"
            shape = tuple(p.shape)
            if ep > 1 and name in plan.EXPERT_WEIGHTS:
                local = (held,) + shape[1:]
                set_param(moe, name, nn.Parameter(torch.empty(local, device=p.device)))
                placements[canonical] = Placement(
                    canonical, shape, local, 0, ((grid.ep_rank * held, 0, held),),
                    tp_replicated=grid.tp_size > 1, partial_grad=grid.tp_size > 1, expert=True)
            else:
                placements[canonical] = Placement.whole(
                    canonical, shape, tp_replicated=grid.tp_size > 1,
                    partial_grad=grid.tp_size > 1)
        if ep > 1:
            moe.exchange = exchange(grid.ep_group, ep, grid.ep_rank, comm)
    return placements


@eager_under_compile  # a collective: eager under trainer.compile (parallel/compile.py), or
# dynamo traces the counted comm's bookkeeping and recompiles at every new byte count
def summed(counts, group, comm):
    """counts summed over `group` (a copy; no gradient flows through counts)."""
    counts = counts.clone()
    comm.all_reduce(counts, group=group)
    return counts


def set_param(module, name, param):
    parent, _, attr = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, attr, param)
