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
import torch.distributed as dist


def expert_load(strategy):
    """{figure: value} for the step (see above), {} for a dense model; collective over
    the world."""
    config = strategy.module.config
    if not config.moe_experts:
        return {}
    blocks = [i for i in range(config.n_layer) if config.has_experts(i)]
    return moe_stats(strategy.expert_layers(), strategy.grid, strategy.comm,
                     config.moe_experts, blocks)


def moe_stats(layers, grid, comm, num_experts, blocks):
    """expert_load's figures. layers: [(canonical block index, MoE layer)] this rank
    holds; blocks: the canonical indices of every MoE block, on every rank alike."""
    rows = torch.zeros(len(blocks), 3 + num_experts, dtype=torch.float64)
    for i, moe in layers:
        s = moe.stats
        if s["forwards"]:
            row = rows[blocks.index(i)]
            row[0], row[1], row[2] = float(s["balance"]), float(s["z"]), s["forwards"]
            row[3:] = s["counts"].double().cpu()
    rows = rows.to(grid.device)
    if grid.world_size > 1:
        with comm.uncounted():
            dist.all_reduce(rows)
    rows = rows.cpu()
    computed = rows[:, 2] > 0
    if not computed.any():  # no training forward this step
        return {}
    per_block = rows[computed]
    samples = per_block[:, 2] / grid.tp_size
    counts = per_block[:, 3:]
    load = counts.max(1).values / counts.mean(1).clamp(min=1e-12)
    out = {"moe_aux_loss": float((per_block[:, 0] / samples).mean()),
           "moe_z_loss": float((per_block[:, 1] / samples).mean()),
           "moe_load_max": float(load.max())}
    for i, value in zip([b for b, c in zip(blocks, computed.tolist()) if c], load.tolist()):
        out[f"moe_load_h{i}"] = value
    return out
