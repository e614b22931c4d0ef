"""The bytes one rank's collectives move per optimizer step, by grid dimension and kind.

`comm_by_dim` counts parallel/comm.py's payload per kind (an all-reduce counts its
tensor, an all-gather its output, a reduce-scatter its input, a send what it sends):
the data-parallel gradients, fsdp's gathers, Megatron's f/g per layer and
micro-batch, the vocabulary-parallel loss, sequence parallelism's partial-gradient
sum, the pipeline's activations and gradients, the tied embedding's gradient between
the first and the last stage, the context-parallel ring, the norm's scalar. Summed
by kind (`comm_bytes`) they are the `comm_<kind>_bytes` that tests/test_planner.py
holds equal to metrics.jsonl on real runs; by dimension, step_time.py prices each
at the link its group crosses.

May import: planner.shapes, planner.stages, parallel (model_plan, pipeline schedules).
"""

from parallel import model_plan as plan
from parallel.pipeline_parallel.schedules import chunk_ranks, messages
from planner.shapes import F32, Layout, Workload, act_bytes, micro_rows, res_bytes
from planner.stages import shard_elements, stage, units


def moe_layers(w: Workload, st) -> int:
    """The mixture-of-experts blocks among those of a stage."""
    return sum(w.has_experts(b) for c in st.chunks for b in st.chunk_blocks[c])


def comm_bytes(w: Workload, L: Layout, p: int, r: int) -> dict:
    """{collective kind: payload bytes} this rank hands to parallel/comm.py per step."""
    out = {}
    for (_, kind), n in comm_by_dim(w, L, p, r).items():
        out[kind] = out.get(kind, 0) + n
    return out


def comm_by_dim(w: Workload, L: Layout, p: int, r: int) -> dict:
    """{(group, kind): payload bytes per step}; group: the grid dimension whose group
    carries it ("tp", "cp", "pp", "dp": the gradient group dp x cp, under HSDP the
    shard group; "dpr": across the replica groups; "ep": the expert-parallel group;
    "edp": the ranks holding the same experts; "seq": cp x tp), or "norm". r: the rank
    in the shard group."""
    st = stage(w, L, p)
    out = {}

    def add(dim, kind, n):
        if n:
            out[dim, kind] = out.get((dim, kind), 0) + int(n)

    rows, tokens = micro_rows(w, L), w.block // L.cp
    passes = L.grad_accum * L.M                  # micro-batches through this rank's chunks
    layers = sum(st.layers.values())
    moe = moe_layers(w, st)                      # of them, mixture-of-experts blocks
    n_tok = rows * tokens                        # tokens of one micro-batch on this rank
    act = n_tok * w.n_embd * act_bytes(w)        # one full activation (all of the sequence)
    # tensor parallelism: Megatron's f and g, per layer and micro-batch (an MoE block's MLP
    # has none: each TP rank routes its share of the tokens, taken from and given back to
    # the replicated activations by an all-gather each way without sequence parallelism;
    # a recompute stops at the block's last saved tensor, before the one giving them back)
    forwards = passes * moe * (2 if L.ckpt else 1)  # an MoE block's routings (recomputed too)
    if L.tp > 1:
        pairs = 4 * layers - 2 * moe + st.first + st.last
        if L.sp:
            add("tp", "all_gather", passes * pairs * act)
            add("tp", "reduce_scatter", passes * pairs * act)
        else:
            add("tp", "all_reduce", passes * pairs * act)
            add("tp", "all_gather", 2 * passes * moe * act)
        if st.last:  # vocabulary-parallel loss: the max, then (sum of exp, target logit)
            add("tp", "all_reduce", passes * 3 * n_tok * F32)
    # context parallelism: the ring (forward cp-1 hops of K|V; backward cp-1 of K|V with
    # their gradients, then the gradients home)
    if L.cp > 1:  # keys and values at their own width: K/V heads x head size (GQA: fewer)
        kv_fwd = 2 * n_tok * (w.kv_width // L.tp) * act_bytes(w)
        kv = 2 * n_tok * (w.kv_width // L.tp) * F32
        add("cp", "send", passes * layers * ((L.cp - 1) * kv_fwd + (L.cp - 1) * 2 * kv + kv))
    # mixture of experts (forward collectives again in a checkpointed block's recompute):
    # each sequence's choices per expert summed over its cp x tp ranks (the balance loss);
    # under ep, per block and micro-batch the counts (E integers) and the tokens' rows
    # to their experts and back, forward and backward: N x k rows of C each way, N the
    # tokens this TP rank routes, in the experts' compute dtype (parallel/comm.py counts
    # this rank's own rows, the even split's: planner/efficiency.py's MOE_IMBALANCE is
    # the busiest rank's share of the time)
    if L.cp * L.tp > 1:
        add("seq", "all_reduce", forwards * rows * w.experts * F32)
    if L.ep > 1:
        rows_k_c = n_tok // L.tp * w.top_k * w.n_embd
        add("ep", "all_to_all_counts", forwards * w.experts * 8)
        add("ep", "all_to_all", 2 * (forwards + passes * moe) * rows_k_c * act_bytes(w))
    # pipeline: activations forward and gradients back across ranks (the residual stream)
    if L.pp > 1:
        ranks = chunk_ranks(L.schedule, L.pp, L.V)
        crossings = sum(dst != p for c in st.chunks for kind in "FB"
                        for dst, _ in messages((kind, c, 0), ranks)[1])
        shards = L.tp if L.sp else 1
        add("pp", "send", L.grad_accum * L.M * crossings * rows * (tokens // shards) * w.n_embd
            * res_bytes(w))
    # data parallelism over dp x cp (fsdp: shards over a replica group's dp x cp, and under
    # HSDP each unit's gradient shard is all-reduced once a step across the R groups)
    # (expert parallelism: a block's experts over the N / ep ranks holding the same ones,
    # "edp": a unit of their own under fsdp, an all-reduce of their own under ddp)
    N = L.shards if L.dp_kind == "fsdp" else L.dp * L.cp
    if L.dp_kind == "fsdp":
        for u in units(st, L, N):
            full, dim = u.padded * F32, ("edp" if u.stride > 1 else "dp")
            if L.R > 1:
                add("dpr", "all_reduce", u.shard * F32)
            if L.zero_stage == 1:
                add(dim, "reduce_scatter", full)
                add(dim, "all_gather", full)
            elif L.zero_stage == 2:  # every backward through the unit, per chunk touching it
                add(dim, "reduce_scatter", full * passes * u.touching)
                add(dim, "all_gather", full)
            else:  # forward gathers every unit, backward the blocks again (resharded)
                add(dim, "all_gather", L.grad_accum * full * (2 if u.block else 1))
                add(dim, "reduce_scatter", L.grad_accum * full)
    elif N > 1:
        add("dp", "all_reduce", sum(q.numel for q in st.params if not q.expert) * F32)
        if N // L.ep > 1:
            add("edp", "all_reduce", sum(q.numel for q in st.params if q.expert) * F32)
    # after backward: the partial gradients over TP (sequence parallelism's replicated
    # parameters, the routers and experts), the tied embedding's
    def partial(q):
        return q.partial or (L.sp and q.replicated)
    if L.tp > 1:
        if L.dp_kind == "fsdp":
            add("tp", "all_reduce", F32 * sum(shard_elements(u, r, partial)
                                        for u in units(st, L, N)))
        else:
            add("tp", "all_reduce", F32 * sum(q.numel for q in st.params if partial(q)))
    if st.tied_across:
        if L.dp_kind == "fsdp":
            add("embed", "all_reduce", F32 * sum(shard_elements(u, r, lambda q: q.name == plan.TIED)
                                        for u in units(st, L, N)))
        else:
            add("embed", "all_reduce", F32 * next(q.numel for q in st.params if q.name == plan.TIED))
    # the global gradient norm's scalar, over the ranks holding different gradient elements
    sharded = (L.pp, L.tp) + ((L.shards,) if L.dp_kind == "fsdp" else (L.ep,))
    if max(sharded) > 1:
        add("norm", "all_reduce", F32)
    return out
