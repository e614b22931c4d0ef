"""The stated step-time model: milliseconds of one optimizer step under a layout on a
machine, by part (compute, the pipeline bubble, each dimension's collectives).

Compute is the model's FLOPs at a fraction of peak; the bubble is the schedule's own
(its simulator); collectives are traffic.py's bytes at the link each group crosses
(`spans_nodes`: parallel/grid.py's rank order), with what overlaps the backward
counted only beyond it. `step_time`'s docstring states every assumption.

May import: planner.shapes, planner.traffic, planner.formulas, telemetry.mfu,
parallel's pipeline simulator.
"""

from functools import lru_cache

from parallel.pipeline_parallel.simulator import unit_time
from planner.formulas import WIRE_PER_PAYLOAD
from planner.shapes import F32, Layout, Workload, micro_rows
from planner.stages import shard_pieces, stage, units
from planner.traffic import comm_by_dim
from telemetry.mfu import flops_per_token

GRID = ("dp_replicate", "dp", "pp", "cp", "tp")  # parallel/grid.py's DIMS, slowest- to fastest-varying


def spans_nodes(L: Layout, dims, gpus_per_node):
    """Whether the group over `dims` (rank 0's) has ranks on more than one node: rank r
    sits at its coordinates of arange(world).view(dp_replicate, dp, pp, cp, tp), node
    r // gpus_per_node."""
    sizes = {"dp_replicate": L.R, "dp": L.dp // L.R, "pp": L.pp, "cp": L.cp, "tp": L.tp}
    far = 0
    for d in dims:
        stride = 1
        for faster in GRID[GRID.index(d) + 1:]:
            stride *= sizes[faster]
        far += (sizes[d] - 1) * stride
    return far >= gpus_per_node


@lru_cache(maxsize=None)
def bubble(schedule, P, M, V):
    """The schedule's idle share: pipeline_parallel/simulator.unit_time (F = B = W), or, for
    long pipelines, the closed forms it reproduces."""
    if P == 1:
        return 0.0
    if P * M * V <= 4096:
        return unit_time(schedule, P, M, V)[1]
    if schedule in ("zb1p",):
        return (P - 1) / (3 * M + P - 1)
    return (P - 1) / (M + P - 1) / (V if schedule in ("interleaved", "zbv") else 1)


def step_time(w: Workload, L: Layout, fig: dict, machine, pcfg) -> dict:
    """Milliseconds of one optimizer step on the fullest rank, by part:

    - compute: the model's FLOPs (telemetry/mfu.flops_per_token, x 4/3 recomputing each
      block under checkpointing) split evenly over the world, at `plan.mfu` of the peak
      for trainer.precision, stretched by the schedule's bubble: / (1 - bubble);
    - each group's collectives at the link it crosses (a group spans nodes iff its ranks
      do), a ring's wire bytes (2(n-1)/n of an all-reduce's payload, (n-1)/n of an
      all-gather's or reduce-scatter's, a send's own): TP and cp on the critical path;
      the pipeline's sends cost those on the fill and drain path, 2(P x V - 1) of its
      messages; data-parallel gradient collectives (and ZeRO-3's gathers) overlap the
      backward (the forward too, for gathers) and cost only what is longer than it;
      ZeRO-1/2's all-gather after the optimizer step is exposed, and so is HSDP's
      all-reduce across replica groups (after the last backward);
    - parallel.offload: the host's AdamW and the PCIe copies (host_seconds).
    """
    peak = machine.peak.get(w.precision)
    gpt = {"n_embd": w.n_embd, "n_layer": w.n_layer, "block_size": w.block, "vocab_size": w.vocab,
           "bias": w.bias}
    world = L.dp * L.pp * L.cp * L.tp
    flops = flops_per_token(gpt) * w.batch * w.block / world * (4 / 3 if L.ckpt else 1)
    compute = flops / (peak * pcfg.mfu)
    b = bubble(L.schedule, L.pp, L.M, L.V)
    G = pcfg.gpus_per_node
    size = {"tp": L.tp, "cp": L.cp, "pp": L.pp, "dp": L.dp // L.R * L.cp, "dpr": L.R, "embed": 2,
            "norm": world}
    span = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp": ("dp", "cp"),
            "dpr": ("dp_replicate",), "embed": ("pp",), "norm": GRID}
    parts = {"compute": compute, "bubble": compute * b / (1 - b), "tp": 0.0, "cp": 0.0, "pp": 0.0,
             "dp": 0.0, "host": host_seconds(w, L, fig, machine)}
    dp_overlapped = 0.0
    for (dim, kind), payload in comm_by_dim(w, L, fig["pp_rank"], fig["dp_rank"]).items():
        if dim == "norm":
            continue
        link = machine.inter_node_gbps if spans_nodes(L, span[dim], G) else machine.intra_node_gbps
        seconds = payload * WIRE_PER_PAYLOAD[kind](size[dim]) / (link * 1e9)
        if dim == "dpr":  # across the replica groups, after the step's last backward: exposed
            parts["dp"] += seconds
        elif dim == "pp":  # per schedule pass, the fill and drain path's 2(P x V - 1) messages
            one = micro_rows(w, L) * (w.block // L.cp // (L.tp if L.sp else 1)) * w.n_embd * F32
            seconds = L.grad_accum * 2 * (L.pp * L.V - 1) * one / (link * 1e9)
            parts["pp"] += seconds
        elif dim == "embed":
            parts["pp"] += seconds
        elif dim == "dp" and not (kind == "all_gather" and L.zero_stage in (1, 2)):
            dp_overlapped += seconds
        else:
            parts[dim if dim in parts else "dp"] += seconds
    window = compute if L.zero_stage == 3 else compute * 2 / 3  # backward is 2/3 of the FLOPs
    parts["dp"] += max(0.0, dp_overlapped - window)
    ms = {k: 1000 * v for k, v in parts.items()}
    ms["step_ms"] = sum(ms.values())
    return ms


def host_seconds(w: Workload, L: Layout, fig: dict, machine) -> float:
    """parallel.offload's time on the critical path: AdamW on the host over this rank's
    shard (fused: reads parameter, gradient and both moments, writes parameter and
    moments, 28 bytes an element, at `host_gbps`), and the copies over PCIe at
    `pcie_gbps` (each reduced gradient shard to the host, the updated shard back)."""
    if not L.offload:
        return 0.0
    st = stage(w, L, fig["pp_rank"])
    shard = sum(sum(shard_pieces(u, fig["dp_rank"]).values()) for u in units(st, L, L.shards))
    padded = sum(u.shard for u in units(st, L, L.shards))
    reduced = comm_by_dim(w, L, fig["pp_rank"], fig["dp_rank"]).get(("dp", "reduce_scatter"), 0)
    copies = reduced / L.shards + padded * F32  # gradient shards down, the shard back up
    return 28 * shard / (machine.host_gbps * 1e9) + copies / (machine.pcie_gbps * 1e9)


def bytes_by_link(L: Layout, fig: dict, gpus_per_node) -> dict:
    """The fullest rank's collective payload per step by the link its group crosses:
    {"intra_node": bytes, "inter_node": bytes} (the norm's scalar spans the world)."""
    span = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp": ("dp", "cp"),
            "dpr": ("dp_replicate",), "embed": ("pp",), "norm": GRID}
    out = {"intra_node": 0, "inter_node": 0}
    for (dim, _), payload in fig["by_dim"].items():
        out["inter_node" if spans_nodes(L, span[dim], gpus_per_node) else "intra_node"] += payload
    return out
