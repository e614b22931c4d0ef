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
from planner.shapes import F32, Layout, Workload, act_bytes, micro_rows
from planner.stages import shard_elements, stage, units


def comm_bytes(w: Workload, L: Layout, p: int, r: int) -> dict:
    """{collective kind: payload bytes} this rank hands to parallel/comm.py per step."""
    out = {}
    for (_, kind), n in comm_by_dim(w, L, p, r).items():
        out[kind] = out.get(kind, 0) + n
    return out


def comm_by_dim(w: Workload, L: Layout, p: int, r: int) -> dict:
    """{(group, kind): payload bytes per step}; group: the grid dimension whose group
    carries it ("tp", "cp", "pp", "dp": the gradient group dp x cp, under HSDP the
    shard group; "dpr": across the replica groups), or "norm". r: the rank in the
    shard group."""
    st = stage(w, L, p)
    out = {}

    def add(dim, kind, n):
        if n:
            out[dim, kind] = out.get((dim, kind), 0) + int(n)

    rows, tokens = micro_rows(w, L), w.block // L.cp
    passes = L.grad_accum * L.M                  # micro-batches through this rank's chunks
    layers = sum(st.layers.values())
    n_tok = rows * tokens                        # tokens of one micro-batch on this rank
    act = n_tok * w.n_embd * act_bytes(w)        # one full activation (all of the sequence)
    # tensor parallelism: Megatron's f and g, per layer and micro-batch
    if L.tp > 1:
        if L.sp:
            each = (4 * layers + st.first + st.last) * act
            add("tp", "all_gather", passes * each)
            add("tp", "reduce_scatter", passes * each)
        else:
            add("tp", "all_reduce", passes * (4 * layers + st.first + st.last) * act)
        if st.last:  # vocabulary-parallel loss: the max, then (sum of exp, target logit)
            add("tp", "all_reduce", passes * 3 * n_tok * F32)
    # context parallelism: the ring (forward cp-1 hops of K|V; backward cp-1 of K|V with
    # their gradients, then the gradients home)
    if L.cp > 1:
        kv_fwd = 2 * n_tok * (w.n_embd // L.tp) * act_bytes(w)
        kv = 2 * n_tok * (w.n_embd // L.tp) * F32
        add("cp", "send", passes * layers * ((L.cp - 1) * kv_fwd + (L.cp - 1) * 2 * kv + kv))
    # pipeline: activations forward and gradients back across ranks (fp32 residual stream)
    if L.pp > 1:
        ranks = chunk_ranks(L.schedule, L.pp, L.V)
        crossings = sum(dst != p for c in st.chunks for kind in "FB"
                        for dst, _ in messages((kind, c, 0), ranks)[1])
        shards = L.tp if L.sp else 1
        add("pp", "send", L.grad_accum * L.M * crossings * rows * (tokens // shards) * w.n_embd * F32)
    # data parallelism over dp x cp (fsdp: shards over a replica group's dp x cp, and under
    # HSDP each unit's gradient shard is all-reduced once a step across the R groups)
    N = L.shards if L.dp_kind == "fsdp" else L.dp * L.cp
    if L.dp_kind == "fsdp":
        for u in units(st, L, N):
            full = N * u.shard * F32
            if L.R > 1:
                add("dpr", "all_reduce", u.shard * F32)
            if L.zero_stage == 1:
                add("dp", "reduce_scatter", full)
                add("dp", "all_gather", full)
            elif L.zero_stage == 2:  # every backward through the unit, per chunk touching it
                add("dp", "reduce_scatter", full * passes * u.touching)
                add("dp", "all_gather", full)
            else:  # forward gathers every unit, backward the blocks again (resharded)
                add("dp", "all_gather", L.grad_accum * full * (2 if u.block else 1))
                add("dp", "reduce_scatter", L.grad_accum * full)
    elif N > 1:
        add("dp", "all_reduce", sum(q.numel for q in st.params) * F32)
    # after backward: sequence parallelism's partial gradients, the tied embedding's
    if L.sp:
        if L.dp_kind == "fsdp":
            add("tp", "all_reduce", F32 * sum(shard_elements(u, r, lambda q: q.replicated)
                                        for u in units(st, L, N)))
        else:
            add("tp", "all_reduce", F32 * sum(q.numel for q in st.params if q.replicated))
    if st.tied_across:
        if L.dp_kind == "fsdp":
            add("embed", "all_reduce", F32 * sum(shard_elements(u, r, lambda q: q.name == plan.TIED)
                                        for u in units(st, L, N)))
        else:
            add("embed", "all_reduce", F32 * next(q.numel for q in st.params if q.name == plan.TIED))
    # the global gradient norm's scalar, over the ranks holding different gradient elements
    sharded = (L.pp, L.tp) + ((L.shards,) if L.dp_kind == "fsdp" else ())
    if max(sharded) > 1:
        add("norm", "all_reduce", F32)
    return out
