"""What one rank keeps in memory under a layout: model state, the activations saved for
backward, and the peak the planner holds against the GPU's memory.

Every count follows the code that a run measures, so that tests/test_planner.py can
hold them equal to metrics.jsonl on real runs:

- `state_bytes`: parameters + gradients + AdamW state resident at the end of a step
  (Strategy.state_figures): 4 bytes each for parameter, gradient, exp_avg, exp_avg_sq and
  AdamW's 4-byte `step` per optimizer tensor; `fsdp` on flat units padded to a multiple
  of the shard group (data_parallel/fsdp_units.py; under HSDP a replica group's):
  stage 1 keeps the whole unit and its gradient, stage 2 the unit and its gradient
  shard, stage 3 shards of both; `host_state_bytes`: what parallel.offload moves to host
  memory (the shard's master weights, gradient and AdamW state).
- `activation_bytes`: what autograd saves for backward (telemetry/activation_meter.py),
  per block 16 x tokens x width floats (LayerNorm inputs, the linears' inputs, q|k|v,
  attention's output, the MLP's 4x wide pair) plus LayerNorm statistics and
  attention's log-sum-exp, split as tensor and sequence parallelism split them, held
  for as many micro-batches as the schedule keeps in flight (its own action list).
- `memory_need`: the two, plus what the activation meter does not see.

All figures are for one TP rank and one cp rank (they hold the same sizes) at a given
pipeline stage and data-parallel rank.

May import: planner.shapes, planner.stages, planner.efficiency (the imbalance), parallel's
pipeline schedules.
"""

from dataclasses import replace

from parallel.pipeline_parallel.schedules import SCHEDULES, build
from planner.efficiency import imbalance
from planner.shapes import F32, Layout, Workload, act_bytes, logit_bytes, micro_rows, res_bytes
from planner.stages import shard_pieces, stage, units


# ------------------------------------------------------------------ state bytes

def state_bytes(w: Workload, L: Layout, p: int, r: int) -> int:
    """Parameters + gradients + AdamW state on the device of pipeline rank p, shard rank r
    (within the shard group: dp x cp, or a replica group's dp x cp under HSDP)."""
    return state_split(w, L, p, r)[0]


def host_state_bytes(w: Workload, L: Layout, p: int, r: int) -> int:
    """What parallel.offload keeps in host memory on that rank (0 without it)."""
    return state_split(w, L, p, r)[1]


def state_split(w: Workload, L: Layout, p: int, r: int):
    """(device bytes, host bytes) of parameters + gradients + AdamW state. Offloaded, a
    unit's shard of master weights, gradient and AdamW state is the host's; the device
    keeps the parameters compute needs (stages 1-2 the unit, stage 3 its shard) and
    stage 1's full gradient (data_parallel/offload.py)."""
    st = stage(w, L, p)
    if L.dp_kind != "fsdp":
        # parameter, gradient, exp_avg, exp_avg_sq, and AdamW's `step` (a 4-byte tensor)
        return sum(4 * F32 * q.numel + F32 for q in st.params), 0
    device = host = 0
    for u in units(st, L, L.shards):
        pieces = shard_pieces(u, r)
        adam = sum(2 * F32 * n + F32 for n in pieces.values())  # AdamW moments + step
        full, shard = u.padded * F32, u.shard * F32
        if L.offload:
            host += adam + 2 * shard  # master weights and their gradient
            device += {1: 2 * full, 2: full, 3: shard}[L.zero_stage]
        else:
            device += adam + {1: 2 * full, 2: full + shard, 3: 2 * shard}[L.zero_stage]
    return device, host


def fsdp_candidate_ranks(w, L, p):
    """The dp ranks that can hold the most (rank 0, the last, and each one whose shard
    meets an optimizer-group boundary of a unit): enough to take the max over all."""
    N = L.shards
    if L.dp_kind != "fsdp" or N == 1:
        return [0]
    found = {0, N - 1}
    for u in units(stage(w, L, p), L, N):
        at = 0
        for q in u.params:
            at += q.numel
            found.add(min(u.ranks - 1, at // u.shard) * u.stride)  # experts: their first rank
    return sorted(found)


# ------------------------------------------------------------------ activations

def block_activations(w: Workload, L: Layout, rows: int, experts=False, busiest=1.0, index=0):
    """(saved bytes of block `index` for one micro-batch, the part the weight gradients
    keep until W under a split backward); experts: a mixture-of-experts block's, its
    expert rows `busiest` x the even split."""
    n, C, e, r = rows * (w.block // L.cp), w.n_embd, act_bytes(w), res_bytes(w)
    t, s = L.tp, (L.tp if L.sp else 1)
    heads_t = w.n_head // t * rows * (w.block // L.cp)   # attention's log-sum-exp, per head row
    mode = L.recompute(index)
    if mode == "full":  # a checkpointed block keeps its input only
        return n * C * r // s, 0
    qkv = C + 2 * w.kv_width                  # q|k|v's width (GQA: fewer K/V heads)
    if mode == "selective" and not experts:  # its input and the matmuls' outputs: q|k|v and
        # attention out (split over TP), c_fc's (4 C, split), both projections' (full rows)
        return n * C * r // s + n * e * (qkv + C + w.fc_out) // t + 2 * n * C * e \
            + heads_t * F32, 0
    residual = 2 * n * C * r // s + 4 * n * F32 // s   # both LayerNorms' inputs and statistics
    lin_in = n * C * (e if w.precision != "fp32" else F32)  # c_attn's (c_fc's) input, gathered
    split = n * e * (qkv + C) // t                        # q|k|v, attention out
    # what a split backward's W keeps until it runs: the linears' inputs, and a LayerNorm's
    # input with both LayerNorms' statistics (measured: tests/test_planner.py)
    weights = lin_in + n * C * e // t + n * C * r // s + 4 * n * F32 // s
    if experts:
        mlp, mlp_weights = expert_activations(w, L, rows, n, busiest)
    else:  # c_fc's input, its output and GELU's (4 C each; gated: gate|up 2 H, SiLU's
        # and the product's H each), c_proj's input (GELU's output, the product) for W
        mlp, mlp_weights = lin_in + n * e * 2 * w.fc_out // t, lin_in + n * e * w.ffn // t
    copies = weight_copies(w, C * qkv + C * C + (0 if experts else C * w.fc_out + w.ffn * C)) // t
    if experts:  # each of this rank's experts' two matrices (whole under TP: it splits tokens)
        copies += weight_copies(w, w.experts // L.ep * 2 * C * w.expert_hidden)
    return residual + lin_in + split + mlp + heads_t * F32 + copies, weights + mlp_weights


def head_input_bytes(w: Workload) -> int:
    """Bytes of an element of the LM head's saved input: the final LayerNorm's output as
    the product reads it (autocast's low-precision copy of the fp32 stream)."""
    return act_bytes(w) if w.precision != "fp32" else F32


def weight_copies(w: Workload, elements: int) -> int:
    """Bytes of the low-precision copies autocast makes of fp32 weights (`elements` of
    them), each saved by its product for the input's gradient, one set per micro-batch's
    forward (measured: tests/test_dryrun.py, bf16 against fp32); none in fp32 or for a
    bf16 model, whose weights are used as they are."""
    return elements * act_bytes(w) if w.precision != "fp32" and w.model_bytes == 4 else 0


def expert_activations(w: Workload, L: Layout, rows: int, n: int, busiest=1.0):
    """(saved bytes, what W keeps) of a mixture-of-experts block's MLP part (moe/layer.py,
    measured: tests/test_planner_experts.py) for n tokens of this rank, of which this TP
    rank routes r = n / tp: the router's input, its probabilities and logits (fp32), the
    k chosen weights with their sum, the log-sum-exp; the choices, their order and rows
    (int64); the expert rows R = r x k (the even split under ep) in the compute dtype:
    the grouped products' inputs (C, H) and GELU's (H), the bias rows' indices; back in
    choice order the outputs (C), weighed (C), and the weights; ep: the arrival order's
    two indices. W keeps the products' inputs and the gradients where their weights'
    branch off (assumed, not measured). busiest: R that many times the even split."""
    r, C, H, e, k = n // L.tp, w.n_embd, w.expert_hidden, act_bytes(w), w.top_k
    R = int(r * k * busiest)
    router = F32 * r * (C + 2 * w.experts + k + 2) + 8 * r * k * 3 + F32 * rows * w.experts
    experts = e * R * (C + 2 * H) + (16 * R if w.bias else 0) + (16 * R if L.ep > 1 else 0)
    combine = e * r * k * (2 * C + 1)
    return router + experts + combine, F32 * r * C + 2 * e * R * (C + H)


def end_activations(w: Workload, L: Layout, rows: int, first: bool, last: bool):
    n, C, s = rows * (w.block // L.cp), w.n_embd, (L.tp if L.sp else 1)
    total = 0
    if first:  # token ids (int64) the embedding keeps, positions; TP: its mask (bool)
        total += 8 * n + 8 * (w.block // L.cp) + (n if L.tp > 1 else 0)
    if last:  # final LayerNorm, LM head input, the loss's softmax (or logits) and targets
        vocab = -(-w.padded_vocab // L.tp)
        r = res_bytes(w)
        total += n * C * r // s + 2 * n * F32 // s + n * C * head_input_bytes(w)
        total += n * vocab * logit_bytes(w) + 8 * n + (n if L.tp > 1 else 0)
        total += weight_copies(w, vocab * C)  # the LM head's
    return total


def activation_bytes(w: Workload, L: Layout, p: int, busiest=1.0) -> int:
    """Peak bytes saved for backward on pipeline rank p (tp and cp rank 0); busiest: its
    MoE blocks' expert rows that many times the even split."""
    st = stage(w, L, p)
    rows = micro_rows(w, L)
    last_chunk = L.pp * L.V - 1 if L.pp > 1 else 0

    def blocks(c, part):  # chunk c's blocks' (part 0: saved, 1: kept for W)
        return sum(block_activations(w, L, rows, w.has_experts(b), busiest, b)[part]
                   for b in st.chunk_blocks[c])
    size = {c: blocks(c, 0) + end_activations(w, L, rows, c == 0, c == last_chunk)
            for c in st.chunks}
    if L.pp == 1:
        return size[0]
    n = rows * (w.block // L.cp)
    keep = {c: blocks(c, 1) + (n * w.n_embd * head_input_bytes(w) if c == last_chunk else 0)
            + (8 * n + 8 * (w.block // L.cp) if c == 0 else 0) for c in st.chunks}
    # split backward: W keeps the graph below the weights' gradients; what lies above them
    # (the last chunk's loss: its softmax, the targets) lives as long as the pipeline still
    # holds the chunk's output, until its next F has run or its next B starts
    top = {c: (n * -(-w.padded_vocab // L.tp) * logit_bytes(w) + 8 * n + (n if L.tp > 1 else 0))
           if c == last_chunk else 0 for c in st.chunks}
    split = SCHEDULES[L.schedule].split_backward
    live = peak = 0
    last_b, pending, above = None, 0, 0  # split backward: the rank's latest B; what it still holds
    for kind, c, m in build(L.schedule, L.pp, L.M, L.V, p):
        if kind == "F":
            live += size[c]
            peak = max(peak, live)
            live, above = live - above, 0
        elif kind == "B" and not split:
            live -= size[c]
        elif kind == "B":  # retains the graph for W; releases the previous B's hold
            live -= pending + above
            last_b, pending, above = (c, m), 0, top[c]
        else:  # W frees the graph; what it needed stays while its B is the rank's latest
            held = keep[c] if last_b == (c, m) else 0  # (measured: tests/test_planner.py)
            live -= size[c] - top[c] - held
            pending += held
    return peak


# ------------------------------------------------------------------ the peak

def memory_need(w: Workload, L: Layout, fig: dict) -> int:
    """Bytes the rank needs at its peak: state, saved activations, and what the meter
    does not see: one block recomputed at a time under checkpointing, the logits'
    gradient on the last stage (shapes.logit_bytes: fp32 from autocast's loss, the
    logits' dtype from a fused one), fsdp stage 3's gathered units (this one and the
    prefetched next, in the model's dtype); under expert parallelism the busiest rank's
    expert rows (efficiency.MOE_IMBALANCE x the even split's that `activation_bytes`
    counts). Not counted: the allocator's fragmentation and the libraries' workspaces
    (a published peak of reserved memory includes them: docs/planner.md)."""
    need = fig["state_bytes"] + fig["activation_bytes"]
    rows = micro_rows(w, L)
    st = stage(w, L, fig["pp_rank"])
    moe = any(w.has_experts(b) for c in st.chunks for b in st.chunk_blocks[c])
    busiest = imbalance(L) if moe else 1.0  # the busiest ep rank's expert rows
    if L.ckpt:
        need += block_activations(w, replace(L, ckpt=False), rows, moe, busiest)[0]
    elif busiest > 1:
        need += activation_bytes(w, L, fig["pp_rank"], busiest) - fig["activation_bytes"]
    if st.last:  # the logits' gradient (fp32 from autocast's loss, a fused loss's in their dtype)
        need += rows * (w.block // L.cp) * -(-w.padded_vocab // L.tp) * logit_bytes(w)
    if L.dp_kind == "fsdp" and L.zero_stage == 3:
        full = []  # a block's units (its experts with the rest) are gathered together, in
        # the model's dtype (a bf16 model's FSDP gathers bf16 parameters)
        for u in units(st, L, L.shards):
            if u.with_previous:
                full[-1] += u.padded * w.model_bytes
            else:
                full.append(u.padded * w.model_bytes)
        need += sum(sorted(full, reverse=True)[:2])
    return need
