"""The mixture-of-experts figures of a step's metrics record, from every rank's MoE blocks:

- `moe_aux_loss`: the balance loss (moe/router.py) as one process computes it over the
  step's global batch, averaged over the MoE blocks; `moe_z_loss` likewise. Neither is
  in `loss`, which stays the language-model loss (comparable with a dense run's);
- `moe_load_h<i>`: block i's busiest expert's choices over the mean expert's (1.0 is
  perfect balance, E when one expert takes every choice), and `moe_load_max`, the worst
  block's.

Each rank fills the rows of the blocks it holds (a pipeline stage: its own) with its
sums since the step began; one all-reduce over the world (not training traffic) adds them
up. A block's per-rank losses are partial sums over tensor-parallel ranks (each routes
its share of the tokens) and means over the data and context-parallel ranks and the
micro-batches, so the block's loss is the total over `forwards / tp` of them.
"""

import torch


def expert_load(strategy):
    """{figure: value} for the step (see above), {} for a dense model; collective over
    the world."""
    config = strategy.module.config
    if not config.moe_experts:
        return {}
    blocks = [i for i in range(config.n_layer) if config.has_experts(i)]
    return moe_stats(strategy.expert_layers(), strategy.grid, config.moe_experts, blocks)


def moe_stats(layers, grid, num_experts, blocks):
    """expert_load's figures. layers: [(canonical block index, MoE layer)] this rank
    holds; blocks: the canonical indices of every MoE block, on every rank alike. The
    table is filled and summed on the device and read once."""
    rows = torch.zeros(len(blocks), 3 + num_experts, dtype=torch.float64, device=grid.device)
    for i, moe in layers:
        s = moe.stats
        if s["forwards"]:
            row = rows[blocks.index(i)]
            row[0], row[1], row[2] = s["balance"], s["z"], s["forwards"]
            row[3:] = s["counts"]
    if grid.world_size > 1:
        grid.sum_over_ranks(rows)
    out, loads, balance, z = {}, [], [], []
    for block, (b, zz, forwards, *counts) in zip(blocks, rows.tolist()):  # the one read
        if not forwards:  # a block no training forward ran this step
            continue
        samples = forwards / grid.tp_size
        balance.append(b / samples)
        z.append(zz / samples)
        loads.append(max(counts) / max(sum(counts) / len(counts), 1e-12))
        out[f"moe_load_h{block}"] = loads[-1]
    if not loads:
        return {}
    return {"moe_aux_loss": sum(balance) / len(balance), "moe_z_loss": sum(z) / len(z),
            "moe_load_max": max(loads), **out}
