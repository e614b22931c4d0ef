"""The stated step-time model: milliseconds of one optimizer step under a layout on a
machine, by part (compute, the pipeline bubble, each dimension's collectives).

Compute is the efficiency model's (planner/efficiency.py: the kernels from the shapes);
the bubble is the schedule's own (its simulator); collectives are traffic.py's bytes at
the link each group crosses (`spans_nodes`: parallel/grid.py's rank order), with what
overlaps the backward counted only beyond it. `step_time`'s docstring states every
assumption; MFU is an output.

May import: planner.shapes, planner.stages, planner.traffic, planner.efficiency,
parallel's pipeline simulator.
"""

import math
from functools import lru_cache

from parallel.pipeline_parallel.simulator import unit_time
from planner.efficiency import LINK_EFF, NET_EFF, collective_seconds, compute_seconds, imbalance
from planner.shapes import F32, Layout, Workload, micro_rows, res_bytes
from planner.stages import shard_pieces, stage, units
from planner.traffic import comm_by_dim, moe_layers

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
    long pipelines, the closed forms it reproduces (`closed_form_bubble`)."""
    if P == 1:
        return 0.0
    if P * M * V <= 4096:
        return unit_time(schedule, P, M, V)[1]
    return closed_form_bubble(schedule, P, M, V)


def closed_form_bubble(schedule, P, M, V):
    """The simulator's idle share in closed form (the units of unit_time: F = 1, B = 2, or
    B = W = 1 for the zero-bubble schedules): P - 1 idle units of each rank over its busy
    work, which is 3 M V units (GPipe, 1F1B, interleaved: V chunks; ZB-H1 and ZBV, whose
    W fill the cool-down, keep only the warm-up's P - 1)."""
    work = {"gpipe": 3 * M, "1f1b": 3 * M, "interleaved": 3 * M * V, "zb1p": 3 * M,
            "zbv": 3 * M * V}[schedule]
    idle = 3 * (P - 1) if schedule in ("gpipe", "1f1b", "interleaved") else P - 1
    return idle / (work + idle)


# what each dimension's group spans (for the link it crosses) and how many ranks it has
SPAN = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp": ("dp", "cp"),
        "dpr": ("dp_replicate",), "embed": ("pp",), "norm": GRID, "seq": ("cp", "tp")}
BUCKET = 25e6  # bytes a data-parallel collective carries at most (ddp's bucket, ~a unit)


def group_spans_nodes(L: Layout, dim, gpus_per_node):
    """Whether the group carrying traffic.py's `dim` spans nodes. Expert parallelism's are
    carved out of a replica group's dp x cp ranks in row-major order (slots, grid.py's
    carve_experts): an ep group is ep consecutive slots ("ep"), the ranks holding the same
    experts every ep-th slot ("edp")."""
    if dim not in ("ep", "edp"):
        return spans_nodes(L, SPAN[dim], gpus_per_node)
    last = L.ep - 1 if dim == "ep" else L.shards - L.ep  # rank 0's group's farthest slot
    return (last // L.cp) * L.pp * L.cp * L.tp + (last % L.cp) * L.tp >= gpus_per_node


def group_ranks(L: Layout, dim):
    """The ranks of rank 0's group over traffic.py's `dim` (parallel/grid.py's rank order;
    an expert-parallel group's slots as grid.carve_experts lays them)."""
    if dim in ("ep", "edp"):
        slots = range(L.ep) if dim == "ep" else range(0, L.shards, L.ep)
        return [(s // L.cp) * L.pp * L.cp * L.tp + (s % L.cp) * L.tp for s in slots]
    sizes = {"dp_replicate": L.R, "dp": L.dp // L.R, "pp": L.pp, "cp": L.cp, "tp": L.tp}
    ranks = [0]
    for d in SPAN[dim]:
        stride = 1
        for faster in GRID[GRID.index(d) + 1:]:
            stride *= sizes[faster]
        ranks = [r + c * stride for r in ranks for c in range(sizes[d])]
    return ranks


@lru_cache(maxsize=None)
def ranks_per_node(L: Layout, dim, G) -> int:
    """How many ranks of rank 0's group over `dim` sit on its node (of G GPUs)."""
    return sum(r < G for r in group_ranks(L, dim))


def nic_share(machine, G) -> float:
    """GB/s of network one GPU's own sends get: the node's cards over its G GPUs."""
    return machine.inter_node_gbps * machine.nics_per_node / G


def _link(L, dim, machine, G, kind="all_reduce"):
    """(GB/s, per-hop latency in us, the share of the bandwidth a collective reaches) of
    the link the group over `dim` crosses. Inside a node, NVLink (or PCIe). Across nodes:
    NCCL runs one ring (channel) per network card, so a collective of a group with g
    ranks on each node drives the node's cards' g / G share (the node's G / g groups of
    that dimension share them: tp = 8 leaves each data-parallel group one card, tp = 1
    gives it all 8), each at NET_EFF, and never faster than the NVLink its ring also
    crosses inside the node (NCCL's ring and tree algorithms, NVIDIA/nccl issue #1277:
    two HGX H100 nodes' 8 x 400 Gb/s reach ~360 GB/s of bus bandwidth); a send or an
    all-to-all goes out through the sender's own share of the cards."""
    if not group_spans_nodes(L, dim, G):
        return machine.intra_node_gbps, machine.intra_latency_us, LINK_EFF
    share = nic_share(machine, G)
    if kind in ("send", "all_to_all", "all_to_all_counts"):
        return share, machine.inter_latency_us, NET_EFF
    g = ranks_per_node(L, dim, G)
    network = share * g * NET_EFF
    nvlink = machine.intra_node_gbps * LINK_EFF
    return min(network, nvlink), machine.inter_latency_us, 1.0


def _count(w, L, st, dim, kind, payload):
    """How many collectives of (dim, kind) carry `payload` per step (their latencies)."""
    passes = L.grad_accum * L.M
    layers, moe = sum(st.layers.values()), moe_layers(w, st)
    forwards = passes * moe * (2 if L.ckpt else 1)  # an MoE block's, recomputed ones too
    if dim == "tp":  # Megatron's f and g per layer and pass (+ embedding, LM head input)
        per_layer = passes * (4 * layers - 2 * moe + st.first + st.last)
        loss = 3 * passes * st.last  # the vocabulary-parallel loss's three all-reduces
        summed = any(q.partial for q in st.params)  # routers' and experts' partial gradients
        if kind == "all_gather" and not L.sp:  # an MoE block's tokens taken and given back
            return 2 * passes * moe
        if kind != "all_reduce":
            return per_layer
        return loss + 1 if L.sp else per_layer + loss + summed  # + the partial gradients' sum
    if dim == "cp":
        return passes * layers * 3 * (L.cp - 1)
    if dim in ("dp", "dpr", "edp"):
        return max(1, math.ceil(payload / BUCKET))
    if dim == "ep":  # per MoE block and pass: rows there and back, forward and backward
        return forwards if kind == "all_to_all_counts" else 2 * forwards + 2 * passes * moe
    return forwards if dim == "seq" else 1


def rank_params(w: Workload, L: Layout, p: int, r: int) -> int:
    """Elements rank (p, r)'s optimizer updates: its stage's (its shard under ZeRO)."""
    st = stage(w, L, p)
    if L.dp_kind == "fsdp":
        return sum(sum(shard_pieces(u, r).values()) for u in units(st, L, L.shards))
    return sum(q.numel for q in st.params)


def slowest_stage(w: Workload, L: Layout, fig: dict, machine, flash: bool,
                  stack: str = "fused") -> dict:
    """The compute of the pipeline stage that takes longest (it sets every stage's pace:
    the last one also runs the LM head and the loss), by kind (efficiency.compute_seconds)."""
    stages = [compute_seconds(w, L, p, machine, rank_params(w, L, p, fig["dp_rank"]), flash,
                              stack) for p in range(L.pp)]
    return max(stages, key=lambda kinds: sum(kinds.values()))


def model_flops(w: Workload) -> float:
    """The step's model FLOPs (telemetry/mfu.flops_per_token x tokens; no recomputation)."""
    return w.flops_per_token() * w.batch * w.block


def step_time(w: Workload, L: Layout, fig: dict, machine, pcfg) -> dict:
    """Milliseconds of one optimizer step on the fullest rank, by part, and its MFU:

    - compute: the slowest pipeline stage's kernels (planner/efficiency.py: matrix
      products at a size-dependent efficiency, fused attention, element-wise work and the
      optimizer at memory bandwidth, a launch at least per kernel); `plan.mfu` > 0 overrides it with
      the model's FLOPs (x 4/3 under checkpointing) over the world at that share of peak;
    - bubble: compute stretched by the schedule's idle share b: compute x b / (1 - b);
    - each group's collectives (traffic.py's bytes) at the link it crosses (a group spans
      nodes iff its ranks do: parallel/grid.py's rank order), each a latency plus its wire
      bytes (the algorithm's factor for the group size) over the link's bandwidth: TP and
      cp on the critical path; the pipeline's sends on the fill and drain path, 2(P x V -
      1) messages per schedule pass; data-parallel gradient collectives overlap the
      backward of the last pass (ZeRO-3's gathers the whole step) and cost only what is
      longer; ZeRO-1/2's all-gather after the optimizer step is exposed, and so is HSDP's
      all-reduce across replica groups (after the last backward); expert parallelism's
      all-to-alls on the critical path, MOE_IMBALANCE times the even split's (the busiest
      rank's), the experts' own gradient collectives ("edp") as the data-parallel ones;
    - what this product does not do but a replayed system does (off by default):
      `plan.tp_comm_overlap`, TP's per-layer gathers and scatters cut in tp chunks and
      pipelined with their GEMMs' chunks (Transformer Engine's userbuffers), so a
      collective costs its first (or last) chunk, 1/tp of it, plus what the step's
      matrix products cannot cover; `plan.param_gather_overlap`, ZeRO-1/2's parameter
      all-gather waited for by the next step's first forward, so it costs only what
      outlasts one pass's forward; `plan.param_gather_bytes=2`, the parameter
      all-gathers (ZeRO-1/2's, ZeRO-3's) moving a bf16 copy (Megatron's distributed
      optimizer, FSDP's bf16 param_dtype) instead of our fp32 parameters;
      `plan.grad_reduce_bytes=2`, the gradient reductions in bf16 (FSDP's reduce_dtype);
    - `plan.kernel_slowdown`: every kernel of the step that many times slower than the
      efficiency model's fused ones (a stack that fuses less: nanoGPT's PyTorch step);
    - parallel.offload: the host's AdamW and the PCIe copies (host_seconds).

    "mfu" (not a part): the model's FLOPs (no recomputation) over step_ms x world x peak.
    """
    peak = machine.peak[w.precision]
    world = L.dp * L.pp * L.cp * L.tp
    if pcfg.mfu:
        full = sum(L.recompute(b) == "full" for b in range(w.n_layer)) / w.n_layer
        compute = model_flops(w) / world * (1 + full / 3) / (peak * pcfg.mfu)
        backward = compute * 2 / 3 / (L.grad_accum * L.M)
    else:
        kinds = {kind: seconds * pcfg.kernel_slowdown for kind, seconds in
                 slowest_stage(w, L, fig, machine, pcfg.flash_attention,
                               pcfg.stack or "eager").items()}
        compute = sum(kinds.values())
        backward = (compute - kinds["optimizer"]) * (2 / 3) / (L.grad_accum * L.M)
    matmul = compute if pcfg.mfu else kinds["matmul"]
    b = bubble(L.schedule, L.pp, L.M, L.V)
    G = pcfg.gpus_per_node
    size = {"tp": L.tp, "cp": L.cp, "pp": L.pp, "dp": L.dp // L.R * L.cp, "dpr": L.R, "embed": 2,
            "norm": world, "ep": L.ep, "edp": L.shards // L.ep, "seq": L.cp * L.tp}
    parts = {"compute": compute, "bubble": compute * b / (1 - b), "tp": 0.0, "cp": 0.0, "pp": 0.0,
             "dp": 0.0, "host": host_seconds(w, L, fig, machine), "ep": 0.0}
    st = stage(w, L, fig["pp_rank"])
    dp_overlapped = gather = pipelined = 0.0
    for (dim, kind), payload in comm_by_dim(w, L, fig["pp_rank"], fig["dp_rank"]).items():
        if dim == "norm":
            continue
        gbps, latency, eff = _link(L, dim, machine, G, "send" if dim in ("pp", "cp") else kind)
        if dim == "pp":  # per schedule pass, the fill and drain path's 2(P x V - 1) messages
            one = micro_rows(w, L) * (w.block // L.cp // (L.tp if L.sp else 1)) * w.n_embd \
                * res_bytes(w)
            n = L.grad_accum * 2 * (L.pp * L.V - 1)
            parts["pp"] += collective_seconds("send", n * one, 2, n, gbps, latency, eff)
            continue
        param_gather = dim in ("dp", "edp") and kind == "all_gather" and L.zero_stage in (1, 2)
        if dim in ("dp", "edp") and kind == "all_gather":  # parameters (ZeRO-1/2 after the step, 3)
            payload = payload * pcfg.param_gather_bytes // F32
        elif dim in ("dp", "edp", "dpr"):  # gradients: reduce-scatters, all-reduces
            payload = payload * pcfg.grad_reduce_bytes // F32
        seconds = collective_seconds(kind, payload, size[dim], _count(w, L, st, dim, kind, payload),
                                     gbps, latency, eff)
        if param_gather:
            gather += seconds
        elif dim == "tp" and kind != "all_reduce" and pcfg.tp_comm_overlap:  # SP's per layer
            pipelined += seconds
        elif dim == "dpr":  # across the replica groups, after the step's last backward: exposed
            parts["dp"] += seconds
        elif dim == "embed":
            parts["pp"] += seconds
        elif dim in ("dp", "edp"):
            dp_overlapped += seconds
        elif dim == "ep":  # the busiest rank's rows: the imbalance's share more
            parts["ep"] += seconds * imbalance(L)
        elif dim == "seq":
            parts["cp" if L.cp > 1 else "tp"] += seconds
        else:
            parts[dim if dim in parts else "dp"] += seconds
    window = compute if L.zero_stage == 3 else backward
    parts["dp"] += max(0.0, dp_overlapped - window)
    forward = backward / 2  # one pass's forward: a third of its compute, the backward two
    parts["dp"] += max(0.0, gather - forward) if pcfg.param_gather_overlap else gather
    parts["tp"] += pipelined / L.tp + max(0.0, pipelined * (L.tp - 1) / L.tp - matmul)
    ms = {k: 1000 * v for k, v in parts.items()}
    ms["step_ms"] = sum(ms.values())
    ms["mfu"] = model_flops(w) / (ms["step_ms"] / 1000 * world * peak)
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
    by_dim = comm_by_dim(w, L, fig["pp_rank"], fig["dp_rank"])
    reduced = by_dim.get(("dp", "reduce_scatter"), 0) / L.shards \
        + by_dim.get(("edp", "reduce_scatter"), 0) / (L.shards // L.ep)  # experts' shards
    copies = reduced + padded * F32  # gradient shards down, the shard back up
    return 28 * shard / (machine.host_gbps * 1e9) + copies / (machine.pcie_gbps * 1e9)


def bytes_by_link(L: Layout, fig: dict, gpus_per_node) -> dict:
    """The fullest rank's collective payload per step by the link its group crosses:
    {"intra_node": bytes, "inter_node": bytes} (the norm's scalar spans the world)."""
    out = {"intra_node": 0, "inter_node": 0}
    for (dim, _), payload in fig["by_dim"].items():
        out["inter_node" if group_spans_nodes(L, dim, gpus_per_node) else "intra_node"] += payload
    return out
