"""What one layout costs, per rank and per optimizer step, predicted from the model's shape.

Every count follows the code that a run measures, so that tests/test_planner.py can hold
them equal to metrics.jsonl on real runs:

- `state_bytes`: parameters + gradients + AdamW state resident at the end of a step
  (Strategy.state_bytes): 4 bytes each for parameter, gradient, exp_avg, exp_avg_sq and
  AdamW's 4-byte `step` per optimizer tensor; `fsdp` on flat units padded to a multiple
  of the group (data_parallel/fsdp_units.py): stage 1 keeps the whole unit and its
  gradient, stage 2 the unit and its gradient shard, stage 3 shards of both.
- `comm_<kind>_bytes`: parallel/comm.py's payload per kind (an all-reduce counts its
  tensor, an all-gather its output, a reduce-scatter its input, a send what it sends):
  the data-parallel gradients, fsdp's gathers, Megatron's f/g per layer and
  micro-batch, the vocabulary-parallel loss, sequence parallelism's partial-gradient
  sum, the pipeline's activations and gradients, the tied embedding's gradient
  between the first and the last stage, the context-parallel ring, the norm's scalar.
- `activation_bytes`: what autograd saves for backward (telemetry/activation_meter.py),
  per block 16 x tokens x width floats (LayerNorm inputs, the linears' inputs, q|k|v,
  attention's output, the MLP's 4x wide pair) plus LayerNorm statistics and
  attention's log-sum-exp, split as tensor and sequence parallelism split them, held
  for as many micro-batches as the schedule keeps in flight (its own action list).

All figures are for one TP rank and one cp rank (they hold the same sizes) at a given
pipeline stage and data-parallel rank; `rank_figures` picks the fullest.
"""

import math
from dataclasses import dataclass, asdict
from functools import lru_cache

from parallel import model_plan as plan
from parallel.pipeline_parallel.schedules import (SCHEDULES, build, chunk_blocks, chunk_ranks,
                                                  messages)

F32 = 4


@dataclass(frozen=True)
class Layout:
    """One way to run: the config keys a run takes (`keys()`)."""
    dp_kind: str = "single"   # parallel.dp: single | ddp_bucket | fsdp
    zero_stage: int = 0       # 1-3 for fsdp
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    sp: bool = False          # parallel.sequence_parallel
    schedule: str = "1f1b"    # parallel.pp_schedule (pp > 1)
    V: int = 1                # parallel.pp_virtual_stages (interleaved), zbv: 2
    M: int = 1                # parallel.microbatches
    grad_accum: int = 1       # trainer.grad_accum
    ckpt: bool = False        # trainer.activation_checkpointing

    def keys(self) -> dict:
        out = {"parallel.dp": self.dp_kind, "parallel.tp": self.tp, "parallel.pp": self.pp,
               "parallel.cp": self.cp, "parallel.sequence_parallel": self.sp}
        if self.dp_kind == "fsdp":
            out["parallel.zero_stage"] = self.zero_stage
        if self.pp > 1:
            out.update({"parallel.pp_schedule": self.schedule, "parallel.microbatches": self.M})
            if self.schedule == "interleaved":
                out["parallel.pp_virtual_stages"] = self.V
        out.update({"trainer.grad_accum": self.grad_accum,
                    "trainer.activation_checkpointing": self.ckpt})
        return out

    def name(self) -> str:
        dp = self.dp_kind + (str(self.zero_stage) if self.dp_kind == "fsdp" else "")
        parts = [f"dp{self.dp}", f"tp{self.tp}" + ("sp" if self.sp else ""), f"pp{self.pp}",
                 f"cp{self.cp}"]
        text = " ".join(p for p in parts if not p.endswith("1") or p.startswith("dp")) + " " + dp
        if self.pp > 1:
            text += f" {self.schedule}" + (f" V{self.V}" if self.schedule == "interleaved" else "") \
                + f" M{self.M}"
        if self.grad_accum > 1:
            text += f" ga{self.grad_accum}"
        return text + (" ckpt" if self.ckpt else "")


@dataclass(frozen=True)
class Workload:
    """What the layout does not change: the model, the global batch, precision."""
    n_layer: int
    n_head: int
    n_embd: int
    vocab: int
    block: int            # tokens per sequence
    batch: int            # global batch, sequences per optimizer step
    precision: str = "fp32"
    bias: bool = True

    @property
    def shape(self):
        return (self.n_layer, self.n_head, self.n_embd, self.vocab, self.block, self.bias)


# ------------------------------------------------------------------ what a pipeline rank holds

@dataclass(frozen=True, eq=False)  # one object per (workload, split, rank): cached by identity
class Stage:
    chunks: tuple        # global chunk indices this pipeline rank runs
    layers: dict         # chunk -> number of blocks
    first: bool          # runs chunk 0 (embeddings)
    last: bool           # runs the last chunk (final LayerNorm, LM head, loss)
    tied_across: bool    # the tied embedding's gradient is summed with another rank
    params: tuple        # census Params this rank holds, in named_parameters() order
    blocks_params: tuple  # per held block: its Params (fsdp units)
    n_chunks: int        # chunks of the whole pipeline (P x V)
    chunk_blocks: dict   # chunk -> its block indices


def stage(w: Workload, L: Layout, p: int) -> Stage:
    """What pipeline rank p holds under L (the same on every TP, cp and dp rank)."""
    return _stage(w, L.tp, L.pp, L.schedule if L.pp > 1 else "1f1b", L.V if L.pp > 1 else 1, p)


@lru_cache(maxsize=None)
def _stage(w, tp, pp, schedule, V, p):
    from planner.census import census
    params = census(w.shape, tp)
    ranks = chunk_ranks(schedule, pp, V) if pp > 1 else (0,)
    last = len(ranks) - 1
    layout = chunk_blocks(w.n_layer, len(ranks))
    mine = tuple(c for c in range(len(ranks)) if ranks[c] == p)
    prefixes = tuple(pre for c in mine for pre in plan.chunk_prefixes(layout[c], c == 0, c == last))
    held = tuple(q for q in params if q.name.startswith(prefixes))
    blocks = sorted(b for c in mine for b in layout[c])
    per_block = tuple(tuple(q for q in held if q.name.startswith(plan.block_prefix(b))) for b in blocks)
    first, has_last = 0 in mine, last in mine
    return Stage(mine, {c: len(layout[c]) for c in mine}, first, has_last,
                 pp > 1 and ranks[0] != ranks[-1] and (first or has_last), held, per_block,
                 len(ranks), {c: layout[c] for c in mine})


# ------------------------------------------------------------------ fsdp's flat units

@dataclass(frozen=True, eq=False)  # cached by identity with its stage
class Unit:
    params: tuple  # Params laid end to end, decayed first (FlatUnit's order)
    numel: int
    shard: int     # S: ceil(numel / N)
    touching: int  # this rank's pipeline chunks whose backward reaches it (1 without a pipeline)
    block: bool    # a transformer block's unit (not the root or the tied embedding's)


def units(st: Stage, L: Layout, N: int):
    """FSDP's units on this rank: one per block, the tied embedding alone under a
    pipeline, then the root (everything else), as data_parallel/fsdp.py builds them."""
    return _units(st, L.pp > 1, N)


@lru_cache(maxsize=None)
def _units(st, pipeline, N):
    in_blocks = {q.name for b in st.blocks_params for q in b}
    root = [q for q in st.params if q.name not in in_blocks]
    own = [[q] for q in root if q.name == plan.TIED] if pipeline else []
    root = [q for q in root if not (own and q.name == plan.TIED)]
    chunk_prefixes = [tuple(plan.chunk_prefixes(range(0), c == 0, c == st.n_chunks - 1))
                      + tuple(plan.block_prefix(b) for b in st.chunk_blocks[c]) for c in st.chunks]
    out = []
    blocks = [list(b) for b in st.blocks_params]
    for i, names in enumerate(blocks + own + [root]):
        if names:
            ordered = tuple(sorted(names, key=lambda q: q.group))
            n = sum(q.numel for q in ordered)
            touching = sum(any(q.name.startswith(pre) for q in ordered) for pre in chunk_prefixes)
            out.append(Unit(ordered, n, -(-n // N), touching if pipeline else 1, i < len(blocks)))
    return tuple(out)


def shard_pieces(u: Unit, r: int):
    """Element counts of rank r's shard per optimizer group (padding in none)."""
    lo, hi, at, sizes = r * u.shard, (r + 1) * u.shard, 0, {}
    for q in u.params:
        a, b = max(at, lo), min(at + q.numel, hi)
        if a < b:
            sizes[q.group] = sizes.get(q.group, 0) + b - a
        at += q.numel
    return sizes


def shard_elements(u: Unit, r: int, which):
    """Elements of rank r's shard that belong to Params `which` picks."""
    lo, hi, at, n = r * u.shard, (r + 1) * u.shard, 0, 0
    for q in u.params:
        if which(q):
            n += max(0, min(at + q.numel, hi) - max(at, lo))
        at += q.numel
    return n


# ------------------------------------------------------------------ state bytes

def state_bytes(w: Workload, L: Layout, p: int, r: int) -> int:
    """Parameters + gradients + AdamW state on pipeline rank p, data-parallel rank r
    (within the gradient group dp x cp)."""
    st = stage(w, L, p)
    if L.dp_kind != "fsdp":
        # parameter, gradient, exp_avg, exp_avg_sq, and AdamW's `step` (a 4-byte tensor)
        return sum(4 * F32 * q.numel + F32 for q in st.params)
    N = L.dp * L.cp
    total = 0
    for u in units(st, L, N):
        pieces = shard_pieces(u, r)
        total += sum(2 * F32 * n + F32 for n in pieces.values())  # AdamW moments + step
        full = N * u.shard * F32
        total += {1: 2 * full, 2: full + u.shard * F32, 3: 2 * u.shard * F32}[L.zero_stage]
    return total


def fsdp_candidate_ranks(w, L, p):
    """The dp ranks that can hold the most (rank 0, the last, and each one whose shard
    meets an optimizer-group boundary of a unit): enough to take the max over all."""
    N = L.dp * L.cp
    if L.dp_kind != "fsdp" or N == 1:
        return [0]
    found = {0, N - 1}
    for u in units(stage(w, L, p), L, N):
        at = 0
        for q in u.params:
            at += q.numel
            found.add(min(N - 1, at // u.shard))
    return sorted(found)


# ------------------------------------------------------------------ collective bytes

def micro_rows(w: Workload, L: Layout) -> int:
    """Sequences of one micro-batch (one pipeline micro-batch, or one accumulation step)."""
    return w.batch // (L.dp * L.grad_accum * L.M)


def act_bytes(w):
    """Bytes of one element TP's collectives and saved matmul outputs carry."""
    return F32 if w.precision == "fp32" else 2


def comm_bytes(w: Workload, L: Layout, p: int, r: int) -> dict:
    """{collective kind: payload bytes} this rank hands to parallel/comm.py per step."""
    out = {}
    for (_, kind), n in comm_by_dim(w, L, p, r).items():
        out[kind] = out.get(kind, 0) + n
    return out


def comm_by_dim(w: Workload, L: Layout, p: int, r: int) -> dict:
    """{(group, kind): payload bytes per step}; group: the grid dimension whose group
    carries it ("tp", "cp", "pp", "dp": the gradient group dp x cp), or "norm"."""
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
    # data parallelism over dp x cp
    N = L.dp * L.cp
    if L.dp_kind == "fsdp":
        for u in units(st, L, N):
            full = N * u.shard * F32
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
    sharded = (L.pp, L.tp) + ((L.dp, L.cp) if L.dp_kind == "fsdp" else ())
    if max(sharded) > 1:
        add("norm", "all_reduce", F32)
    return out


# ------------------------------------------------------------------ activations

def block_activations(w: Workload, L: Layout, rows: int):
    """(saved bytes of one block for one micro-batch, the part the weight gradients keep
    until W under a split backward)."""
    n, C, e = rows * (w.block // L.cp), w.n_embd, act_bytes(w)
    t, s = L.tp, (L.tp if L.sp else 1)
    if L.ckpt:  # a checkpointed block keeps its input only
        return n * C * F32 // s, 0
    heads_t = w.n_head // t * rows * (w.block // L.cp)   # attention's log-sum-exp, per head row
    residual = 2 * n * C * F32 // s + 4 * n * F32 // s   # both LayerNorms' inputs and statistics
    lin_in = 2 * n * C * (e if w.precision != "fp32" else F32)  # c_attn's, c_fc's inputs (gathered)
    split = n * C * e * (3 + 1 + 4 + 4) // t              # q|k|v, attention out, c_fc out, GELU out
    # what a split backward's W keeps until it runs: the linears' inputs, and a LayerNorm's
    # input with both LayerNorms' statistics (measured: tests/test_planner.py)
    weights = lin_in + n * C * e * (1 + 4) // t + n * C * F32 // s + 4 * n * F32 // s
    return residual + lin_in + split + heads_t * F32, weights


def end_activations(w: Workload, L: Layout, rows: int, first: bool, last: bool):
    n, C, s = rows * (w.block // L.cp), w.n_embd, (L.tp if L.sp else 1)
    total = 0
    if first:  # token ids (int64) the embedding keeps, positions; TP: its mask (bool)
        total += 8 * n + 8 * (w.block // L.cp) + (n if L.tp > 1 else 0)
    if last:  # final LayerNorm, LM head input, the loss's softmax and targets
        vocab = -(-w.vocab // L.tp)
        total += n * C * F32 // s + 2 * n * F32 // s + n * C * F32
        total += n * vocab * F32 + 8 * n + (n if L.tp > 1 else 0)
    return total


def activation_bytes(w: Workload, L: Layout, p: int) -> int:
    """Peak bytes saved for backward on pipeline rank p (tp and cp rank 0)."""
    st = stage(w, L, p)
    rows = micro_rows(w, L)
    per_block, w_part = block_activations(w, L, rows)
    last_chunk = L.pp * L.V - 1 if L.pp > 1 else 0
    size = {c: st.layers[c] * per_block + end_activations(w, L, rows, c == 0, c == last_chunk)
            for c in st.chunks}
    if L.pp == 1:
        return size[0]
    n = rows * (w.block // L.cp)
    keep = {c: st.layers[c] * w_part + (n * w.n_embd * F32 if c == last_chunk else 0)
            + (8 * n + 8 * (w.block // L.cp) if c == 0 else 0) for c in st.chunks}
    split = SCHEDULES[L.schedule].split_backward
    live = peak = 0
    last_b, pending = None, 0  # split backward: the rank's latest B; what it still holds
    for kind, c, m in build(L.schedule, L.pp, L.M, L.V, p):
        if kind == "F":
            live += size[c]
            peak = max(peak, live)
        elif kind == "B" and not split:
            live -= size[c]
        elif kind == "B":  # retains the graph for W; releases the previous B's hold
            live -= pending
            last_b, pending = (c, m), 0
        else:  # W frees the graph; what it needed stays while its B is the rank's latest
            held = keep[c] if last_b == (c, m) else 0  # (measured: tests/test_planner.py)
            live -= size[c] - held
            pending += held
    return peak


# ------------------------------------------------------------------ per layout

def rank_figures(w: Workload, L: Layout) -> dict:
    """The fullest rank's figures (most state + activation bytes), named as metrics.jsonl
    names them, plus per-stage detail for the time model."""
    best = None
    for p in range(L.pp):
        acts = activation_bytes(w, L, p)
        for r in fsdp_candidate_ranks(w, L, p):
            state = state_bytes(w, L, p, r)
            if best is None or state + acts > best["state_bytes"] + best["activation_bytes"]:
                best = {"pp_rank": p, "dp_rank": r, "state_bytes": state, "activation_bytes": acts}
    best["comm"] = comm_bytes(w, L, best["pp_rank"], best["dp_rank"])
    return {"fullest": best}


def metrics_names(fig) -> dict:
    """A rank's figures as metrics.jsonl names them."""
    comm = fig["comm"]
    out = {"state_bytes": fig["state_bytes"], "comm_bytes": sum(comm.values()),
           "activation_peak_mb": fig["activation_bytes"] / 2**20}
    out.update({f"comm_{k}_bytes": v for k, v in sorted(comm.items())})
    return out


def layout_dict(L: Layout):
    return asdict(L)


# ------------------------------------------------------------------ memory and time

def memory_need(w: Workload, L: Layout, fig: dict) -> int:
    """Bytes the rank needs at its peak: state, saved activations, and what the meter
    does not see: one block recomputed at a time under checkpointing, the logits'
    gradient on the last stage, fsdp stage 3's gathered units (this one and the
    prefetched next)."""
    need = fig["state_bytes"] + fig["activation_bytes"]
    rows = micro_rows(w, L)
    if L.ckpt:
        need += block_activations(w, dataclass_replace(L, ckpt=False), rows)[0]
    st = stage(w, L, fig["pp_rank"])
    if st.last:
        need += rows * (w.block // L.cp) * -(-w.vocab // L.tp) * F32
    if L.dp_kind == "fsdp" and L.zero_stage == 3:
        full = sorted((L.dp * L.cp * u.shard * F32 for u in units(st, L, L.dp * L.cp)), reverse=True)
        need += sum(full[:2])
    return need


def dataclass_replace(obj, **kw):
    from dataclasses import replace
    return replace(obj, **kw)


GRID = ("dp", "pp", "cp", "tp")  # parallel/grid.py's DIMS, slowest- to fastest-varying


def spans_nodes(L: Layout, dims, gpus_per_node):
    """Whether the group over `dims` (rank 0's) has ranks on more than one node: rank r
    sits at its coordinates of arange(world).view(dp, pp, cp, tp), node r // gpus_per_node."""
    sizes = {"dp": L.dp, "pp": L.pp, "cp": L.cp, "tp": L.tp}
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
        from parallel.pipeline_parallel.simulator import unit_time
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
      ZeRO-1/2's all-gather after the optimizer step is exposed.
    """
    from planner.formulas import WIRE_PER_PAYLOAD
    from telemetry.mfu import flops_per_token
    peak = machine.peak.get(w.precision)
    gpt = {"n_embd": w.n_embd, "n_layer": w.n_layer, "block_size": w.block, "vocab_size": w.vocab,
           "bias": w.bias}
    world = L.dp * L.pp * L.cp * L.tp
    flops = flops_per_token(gpt) * w.batch * w.block / world * (4 / 3 if L.ckpt else 1)
    compute = flops / (peak * pcfg.mfu)
    b = bubble(L.schedule, L.pp, L.M, L.V)
    G = pcfg.gpus_per_node
    size = {"tp": L.tp, "cp": L.cp, "pp": L.pp, "dp": L.dp * L.cp, "embed": 2, "norm": world}
    span = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp": ("dp", "cp"), "embed": ("pp",),
            "norm": GRID}
    parts = {"compute": compute, "bubble": compute * b / (1 - b), "tp": 0.0, "cp": 0.0, "pp": 0.0,
             "dp": 0.0}
    dp_overlapped = 0.0
    for (dim, kind), payload in comm_by_dim(w, L, fig["pp_rank"], fig["dp_rank"]).items():
        if dim == "norm":
            continue
        link = machine.inter_node_gbps if spans_nodes(L, span[dim], G) else machine.intra_node_gbps
        seconds = payload * WIRE_PER_PAYLOAD[kind](size[dim]) / (link * 1e9)
        if dim == "pp":  # per schedule pass, the fill and drain path's 2(P x V - 1) messages
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
