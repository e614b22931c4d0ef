"""The efficiency model: seconds of one rank's kernels and of one collective, from shapes.

Compute, per micro-batch pass through a rank's blocks (its pipeline stage), as the
kernels a fused GPT step launches:

- matrix products (QKV, projection, MLP in and out, the LM head; backward: two products
  of the same size each) at `MATMUL_EFF` of the peak, plus `RAMP_US` each: a small
  product does not fill the GPU (tail waves, prologue), so its efficiency falls with
  its size; a product bound by memory (small inner size) takes its bytes at HBM speed;
  a product with a dimension whose rows are not a multiple of `GEMM_ALIGN_BYTES` (an
  unpadded vocabulary: GPT-2's 50,257) `UNALIGNED_SLOWDOWN` times slower;
- attention as one fused (flash) kernel forward and one backward: causal, so half the
  score FLOPs, at `ATTN_EFF` of the peak (backward 2.5 x the forward's FLOPs); or, with
  `plan.flash_attention=false` (Megatron-LM before FlashAttention, for replaying its
  runs), as two batched products over the whole s x s scores (the mask does not skip
  work) plus softmax and dropout over the scores at memory bandwidth, the forward
  recomputed in the backward (selective recomputation) unless the whole block is;
- the element-wise work (LayerNorms, GELU, bias, residual adds; the loss's softmax; the
  AdamW step and the gradient norm over this rank's parameters) at HBM bandwidth x
  `HBM_EFF`: bytes counted per token (`ELEMENTWISE_BYTES`) and per parameter;
- a mixture-of-experts block (model.moe_experts): its attention as a dense block's; for
  its MLP the router's product and its experts' two grouped products over the rows they
  receive, k per token this TP rank routes, the busiest rank's (`MOE_IMBALANCE` x the
  even split under expert parallelism), plus the rows' sorting, gathering and weighing
  at memory bandwidth;
- every kernel at least `LAUNCH_US`: a model too small to fill the GPU is bound by
  launches, the same on one GPU as on many.

Communication, per collective: a latency of `hops` x the link's per-hop latency (a ring
or tree: 2 log2 n hops for an all-reduce, log2 n for a gather or scatter, 1 for a send)
plus the wire bytes (formulas.WIRE_PER_PAYLOAD: the algorithm's factor for the group
size) over the link's bandwidth x `LINK_EFF` (NVLink, PCIe) or `NET_EFF` (across nodes).

The constants are the model's only free parameters. MATMUL_EFF, ATTN_EFF and the
efficiencies were set once, from the vendors' and NCCL's published figures (cuBLAS's
large bf16 products reach ~75-80% of the A100's and H100's dense peak; FlashAttention-2
reports 50-73% forward, less backward; NCCL's bus bandwidth reaches ~80% of NVLink and
~90% of the network's line rate: ~360 GB/s over two HGX H100 nodes' 8 x 400 Gb/s
NICs, NVIDIA/nccl issue #1277),
then checked, not fitted per row, against planner/published_runs.py (docs/planner.md
shows every row).

May import: planner.shapes, planner.stages, planner.formulas.
"""

import math

from planner.formulas import WIRE_PER_PAYLOAD
from planner.shapes import F32, Layout, Workload, act_bytes, micro_rows
from planner.stages import stage

MATMUL_EFF = 0.75   # share of the dense peak a large matrix product reaches
ATTN_EFF = 0.45     # share of the peak fused causal attention reaches, forward and backward
HBM_EFF = 0.8       # share of the memory bandwidth element-wise kernels reach
LINK_EFF = 0.8      # share of NVLink's (or PCIe's) bandwidth a collective's bus bandwidth reaches
NET_EFF = 0.9       # the same across nodes: NCCL over InfiniBand with GPUDirect RDMA, per NIC
RAMP_US = 4.0       # a matrix product's fixed cost: fill and tail of its waves
# Unaligned products. NVIDIA's Matrix Multiplication Background guide: tensor cores take
# any shape, "but efficiency is better when matrix dimensions are multiples of 16 bytes"
# (it plots the penalty, states no figure). PyTorch's blog "Accelerating Large Language
# Models with Accelerated Transformers" (2023-04-18) measured it on nanoGPT's LM head on
# A100s: padding GPT-2's vocabulary, 50,257, to 50,304 "achieves nearly a 3x speedup" of
# those products ("unaligned memory accesses significantly reduce efficiency").
GEMM_ALIGN_BYTES = 16
UNALIGNED_SLOWDOWN = 3.0
LAUNCH_US = 5.0     # the least a kernel costs: its launch (PyTorch eager dispatch and launch)

# kernels per block and pass: forward (4 products, attention, 8 element-wise), backward
# (8 products, attention, 12 element-wise)
FWD_ELEMENTWISE_KERNELS, BWD_ELEMENTWISE_KERNELS = 8, 12
OPTIMIZER_KERNELS = 12  # foreach AdamW, the norm, the clip: a few fused kernels each
# Mixture of experts. The busiest expert's tokens over the mean's: routers balanced by their
# loss still leave the busiest expert 1.1-1.5 x the mean (Switch Transformer's capacity
# factors 1.0-1.25; DeepSeek-V3's and Mixtral's published loads); an ep rank's expert
# compute and its all-to-all take that many times the even split's (assumed, stated in the plan)
MOE_IMBALANCE = 1.25
MOE_FWD_KERNELS, MOE_BWD_KERNELS = 6, 8  # sorting, gathering, weighing and summing the rows


def elementwise_bytes(w: Workload):
    """Bytes a block's element-wise kernels read and write per token, forward: the two
    LayerNorms (read the fp32 residual, write the activation), the two residual adds
    with their bias (read both, write fp32), GELU (read and write H = 4C; a gated MLP's
    SiLU and product read 2 H, write H). Backward: twice."""
    C, a = w.n_embd, act_bytes(w)
    return 24 * C + 4 * a * C + a * w.ffn * (3 if w.gated else 2)


def matmul_seconds(m, n, k, w, machine, passes=1):
    """One (m x k) @ (k x n) product, `passes` times: at MATMUL_EFF of the peak plus its
    ramp (UNALIGNED_SLOWDOWN x with a dimension off GEMM_ALIGN_BYTES), or its bytes at HBM
    speed if that is longer; never under one launch."""
    peak = machine.peak[w.precision]
    a = act_bytes(w)
    flops = 2 * m * n * k
    compute = flops / (peak * MATMUL_EFF) + RAMP_US * 1e-6
    if any(d * a % GEMM_ALIGN_BYTES for d in (m, n, k)):
        compute *= UNALIGNED_SLOWDOWN
    memory = a * (m * k + k * n + m * n) / (machine.hbm_gbps * 1e9 * HBM_EFF)
    return passes * max(compute, memory, LAUNCH_US * 1e-6)


def memory_seconds(nbytes, kernels, machine):
    """`kernels` element-wise kernels moving `nbytes` together."""
    return max(nbytes / (machine.hbm_gbps * 1e9 * HBM_EFF), kernels * LAUNCH_US * 1e-6)


def attention_seconds(w, L, rows, s, fwd, flash, machine):
    """One pass's attention on one layer of this rank (heads / tp, s query tokens)."""
    heads, d = w.n_head // L.tp, w.n_embd // w.n_head
    if flash:
        flops = 2 * rows * heads * s * w.block * d   # causal: half of 4 b h s^2 d
        one = max(flops / (machine.peak[w.precision] * ATTN_EFF), LAUNCH_US * 1e-6)
        return one * (fwd + 2.5)
    scores = rows * heads * s * w.block
    a = act_bytes(w)
    products = matmul_seconds(rows * heads * s, w.block, d, w, machine) \
        + matmul_seconds(rows * heads * s, d, w.block, w, machine)
    forward = products + memory_seconds((4 * a + 1) * scores, 2, machine)
    backward = 2 * products + memory_seconds((8 * a + 2) * scores, 3, machine)
    return forward * (fwd + (0 if L.ckpt else 1)) + backward


def compute_seconds(w: Workload, L: Layout, p: int, machine, params: int,
                    flash: bool = True) -> dict:
    """Seconds of pipeline rank p's kernels per optimizer step, by kind:
    {"matmul", "attention", "elementwise", "optimizer"}; `params` the elements this
    rank's AdamW updates (its shard under ZeRO); `flash`: fused attention."""
    st = stage(w, L, p)
    layers = sum(st.layers.values())
    moe = sum(w.has_experts(b) for c in st.chunks for b in st.chunk_blocks[c])
    passes = L.grad_accum * L.M
    C = w.n_embd
    rows, s = micro_rows(w, L), w.block // L.cp
    t = rows * s                                      # tokens of one pass on this rank
    modes = [L.recompute(b) for c in st.chunks for b in st.chunk_blocks[c]]
    fwd = 1 + modes.count("full") / max(layers, 1)    # full recompute runs the matmuls again,
    cheap = fwd + modes.count("selective") / max(layers, 1)  # selective the cheap ops only
    attention_in_out = sum(matmul_seconds(t, n, k, w, machine) for n, k in
                           (((C + 2 * w.kv_width) // L.tp, C), (C, C // L.tp)))
    mlp = sum(matmul_seconds(t, n, k, w, machine) for n, k in ((w.fc_out // L.tp, C),
                                                                 (C, w.ffn // L.tp)))
    per_layer = attention_in_out + mlp
    matmul = (layers * per_layer + moe * (expert_matmuls(w, L, t, machine) - mlp)) * (fwd + 2)
    attention = layers * attention_seconds(w, L, rows, s, fwd, flash, machine)
    sp_tokens = t // L.tp if L.sp else t              # without SP every TP rank repeats them
    eb = elementwise_bytes(w) * sp_tokens
    elementwise = layers * (cheap * memory_seconds(eb, FWD_ELEMENTWISE_KERNELS, machine)
                            + memory_seconds(2 * eb, BWD_ELEMENTWISE_KERNELS, machine))
    if st.last:  # LM head and loss (the logits written, read by the loss, its gradient)
        V = -(-w.padded_vocab // L.tp)
        matmul += matmul_seconds(t, V, C, w, machine, passes=3)
        elementwise += memory_seconds((4 * act_bytes(w) + F32) * t * V, 6, machine)
    if moe:  # the tokens' rows gathered by expert and their outputs weighed and summed back
        rows_k = t // L.tp * w.top_k * imbalance(L)
        moved = rows_k * C * (2 * F32 + 3 * act_bytes(w))
        elementwise += moe * (fwd * memory_seconds(moved, MOE_FWD_KERNELS, machine)
                              + memory_seconds(2 * moved, MOE_BWD_KERNELS, machine))
    # AdamW (read parameter, gradient, both moments; write three) and the gradient norm
    optimizer = memory_seconds(32 * params, OPTIMIZER_KERNELS, machine) if not L.offload else 0.0
    return {"matmul": passes * matmul, "attention": passes * attention,
            "elementwise": passes * elementwise, "optimizer": optimizer}


def imbalance(L: Layout) -> float:
    """The busiest rank's share of its ep group's expert rows over the mean: MOE_IMBALANCE
    under expert parallelism; 1 without it (one rank computes every expert's rows)."""
    return MOE_IMBALANCE if L.ep > 1 else 1.0


def expert_matmuls(w: Workload, L: Layout, t, machine):
    """One pass's forward products of an MoE block on this rank, t its tokens: the router
    over the tokens this TP rank routes (t / tp), and its experts' two grouped products
    over the rows they receive (k per routed token, the busiest rank's under ep), at the
    efficiency of one product of all those rows (torch._grouped_mm: one kernel)."""
    routed, H, C = t // L.tp, w.expert_hidden, w.n_embd
    rows = math.ceil(routed * w.top_k * imbalance(L))
    return matmul_seconds(routed, w.experts, C, w, machine) + matmul_seconds(rows, H, C, w, machine) \
        + matmul_seconds(rows, C, H, w, machine)


def hops(kind, n):
    """Latency steps of one collective over n ranks: a tree's depth each way for an
    all-reduce, once for a gather or scatter, one for a send."""
    if kind in ("send", "all_to_all", "all_to_all_counts"):  # an all-to-all: its sends at once
        return 1
    depth = max(1, math.ceil(math.log2(max(n, 2))))
    return 2 * depth if kind == "all_reduce" else depth


def collective_seconds(kind, payload, n, count, link_gbps, latency_us, efficiency=LINK_EFF):
    """`count` collectives of `kind` over n ranks moving `payload` bytes together, on a
    link of which the collective reaches `efficiency` (LINK_EFF in a node, NET_EFF across)."""
    wire = payload * WIRE_PER_PAYLOAD[kind](n)
    return count * hops(kind, n) * latency_us * 1e-6 + wire / (link_gbps * 1e9 * efficiency)
