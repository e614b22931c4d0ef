"""The efficiency model: seconds of one rank's kernels and of one collective, from shapes.

Compute, per micro-batch pass through a rank's blocks (its pipeline stage), as the
kernels a step launches, each a physical term with its source beside its constant:

- matrix products (QKV, projection, MLP in and out, the LM head; backward: two products
  of the same size each) at `MATMUL_EFF` of the peak for the GPU's generation (Ampere
  0.75; Hopper scaled by the measured matmul ceilings, 80.3% against 86.9%), plus
  `RAMP_US` each: a small product does not fill the GPU (tail waves, prologue), so its
  efficiency falls with its size; a product bound by memory (small inner size) takes
  its bytes at HBM speed; a product with a dimension whose rows are not a multiple of
  `GEMM_ALIGN_BYTES` (an unpadded vocabulary: GPT-2's 50,257) `UNALIGNED_SLOWDOWN` times
  slower;
- attention as one fused (flash) kernel forward and one backward: causal, so half the
  score FLOPs, the forward at FlashAttention-2's share of the peak on that generation
  (`FA2_FWD_EFF`: A100 50%, H100 35%), the backward's 2.5 x FLOPs at `ATTN_BWD_RATIO`
  (0.66) of the forward's rate; or, with `plan.flash_attention=false` (Megatron-LM before
  FlashAttention, for replaying its runs), as two batched products over the whole s x s
  scores (the mask does not skip work) plus softmax and dropout over the scores at
  memory bandwidth, the forward recomputed in the backward (selective recomputation)
  unless the whole block is;
- the element-wise work (LayerNorms, GELU, bias, residual adds; the loss's softmax; the
  AdamW step and the gradient norm over this rank's parameters) at HBM bandwidth x
  `HBM_EFF`: bytes counted per token by the software stack (`plan.stack`, `STACKS`):
  fused kernels once (`elementwise_bytes`, `loss_bytes`), eager PyTorch op by op;
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
size) over the link's bandwidth x `LINK_EFF` (NVLink, PCIe) or `NET_EFF` (across nodes,
per network card; step_time._link: the cards a group drives).

Which constants are measured (cited beside them) and which were set once and checked
against planner/published_runs.py (MATMUL_EFF's Ampere 0.75, HBM_EFF, RAMP_US,
LAUNCH_US): docs/planner.md, "What is physical, what is calibrated".

May import: planner.shapes, planner.stages, planner.formulas.
"""

import math

from planner.formulas import WIRE_PER_PAYLOAD
from planner.shapes import F32, Layout, Workload, act_bytes, micro_rows
from planner.stages import stage

# Matrix products, per GPU generation (Machine.generation): the share of the dense peak a
# training-sized bf16 product reaches. Ampere 0.75 (the constant the published runs were
# checked with since the planner began); the others scaled by their measured ceilings
# against Ampere's: stas00/ml-engineering compute/accelerator/README.md, "Maximum
# Achievable Matmul FLOPS" (mamf-finder.py, best shape of a brute-force search): A100 SXM
# 271.2 of 312 TFLOP/s (86.9%), H100 SXM 794.5 of 989 (80.3%; "H200 is the same"). No
# measurement here of Ada (L4) or Volta (V100): Ampere's assumed; nor of Blackwell (B200):
# Hopper's assumed.
MATMUL_EFF = {"ampere": 0.75, "hopper": 0.75 * 80.3 / 86.9, "ada": 0.75, "volta": 0.75}
MATMUL_EFF["blackwell"] = MATMUL_EFF["hopper"]
# Fused causal attention, forward, per generation. FlashAttention-2 (Dao 2023, arXiv
# 2307.08691): "50-73% of the theoretical maximum FLOPs/s on A100" (the low end: causal,
# head size 64-128 at GPT lengths); on H100 it reaches "only 35%" (Shah et al. 2024,
# FlashAttention-3, arXiv 2407.08608): the kernel PyTorch's SDPA and flash-attn 2 run
# there, and no published figure read here puts the fused attention of the replayed
# H100 stacks (cuDNN's through Transformer Engine, 2024) above it. FlashAttention-3 is
# "1.5-2.0x" faster forward, "1.5-1.75x" backward: not modelled (plan.stack has no
# choice for it; a run with it is predicted too slow in its attention). Ada and Volta:
# no published figure used here (0.45, the old constant).
FA2_FWD_EFF = {"ampere": 0.50, "hopper": 0.35, "ada": 0.45, "volta": 0.45,
               "blackwell": 0.35}  # Blackwell: no published figure used here, Hopper's
# Backward over forward FLOP/s of one flash kernel: apache/tvm tl_doc/flash_perf.md
# measures flash_attn's causal head-size-128 forward at 151.19 TFLOP/s and its backward at
# 99.23 (sequence 2k): 0.66. The backward does 2.5 x the forward's FLOPs.
ATTN_BWD_RATIO = 99.23 / 151.19
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
# The software stack (plan.stack): how the kernels between the products are written.
# "fused": hand-fused kernels (llm.c; Megatron-LM and Transformer Engine: LayerNorm with
# the residual, bias with GELU, one fused loss kernel); "compiled": torch.compile (Inductor fuses each chain of element-wise ops into one
# kernel: the same bytes as fused), FlashAttention-2 through SDPA; "eager": PyTorch
# eager, every op its own kernel reading and writing its tensors (elementwise_bytes'
# "eager" count: LayerNorm in fp32 under autocast, the casts to the products' dtype, the
# residual adds in fp32, attention's output made contiguous, the loss's upcast, log-softmax
# and their backwards), FlashAttention-2 through SDPA. This product runs "eager", or
# "compiled" with trainer.compile (plan.stack="" picks by that key).
STACKS = ("fused", "compiled", "eager")
EAGER_FWD_KERNELS, EAGER_BWD_KERNELS = 8, 14


def matmul_eff(machine) -> float:
    """The share of the peak a large product reaches on this GPU (MATMUL_EFF)."""
    return MATMUL_EFF[machine.generation]


def attention_eff(machine, stack="fused"):
    """(forward, backward) share of the peak fused causal attention reaches on this GPU:
    FlashAttention-2's (FA2_FWD_EFF, its backward ATTN_BWD_RATIO of it), whatever the stack
    (every replayed one runs a FlashAttention-2-class kernel)."""
    fwd = FA2_FWD_EFF[machine.generation]
    return fwd, fwd * ATTN_BWD_RATIO
OPTIMIZER_KERNELS = 12  # foreach AdamW, the norm, the clip: a few fused kernels each
# Mixture of experts. The busiest expert's tokens over the mean's: routers balanced by their
# loss still leave the busiest expert 1.1-1.5 x the mean (Switch Transformer's capacity
# factors 1.0-1.25; DeepSeek-V3's and Mixtral's published loads); an ep rank's expert
# compute and its all-to-all take that many times the even split's (assumed, stated in the plan)
MOE_IMBALANCE = 1.25
MOE_FWD_KERNELS, MOE_BWD_KERNELS = 6, 8  # sorting, gathering, weighing and summing the rows


def elementwise_bytes(w: Workload, stack="fused"):
    """(forward, backward) bytes a block's element-wise kernels read and write per token.
    Fused: the two LayerNorms (read the fp32 residual, write the activation), the two
    residual adds with their bias (read both, write fp32), GELU (read and write H = 4C; a
    gated MLP's SiLU and product read 2 H, write H); backward twice that. Eager, op by op
    (a: the products' element size; fp32 the residual stream): forward, each LayerNorm in
    fp32 (read 4C, write 4C), its output cast for the product (4C + aC), attention's
    output made contiguous (2aC), each residual add promoting to fp32 (4C + aC + 4C),
    GELU (2aH; SiLU and product 5aH); backward, each branch's gradient cast (4C + aC),
    GELU's (3aH; gated 8aH), each LayerNorm's (12C) with its cast (aC + 4C), the residual
    gradients summed (12C each), the transpose (2aC), the biases' sums (a per output)."""
    C, a, H = w.n_embd, act_bytes(w), w.ffn
    if stack != "eager":
        fwd = 24 * C + 4 * a * C + a * H * (3 if w.gated else 2)
        return fwd, 2 * fwd
    cast = 4 * C + a * C if w.precision != "fp32" else 0
    fwd = 2 * 8 * C + 2 * cast + 2 * a * C + 2 * (8 * C + a * C) + a * H * (5 if w.gated else 2)
    biases = a * (3 * C + 2 * w.kv_width + w.fc_out) if w.bias else 0
    bwd = 2 * cast + a * H * (8 if w.gated else 3) + 2 * 12 * C + 2 * cast + 2 * 12 * C \
        + 2 * a * C + biases
    return fwd, bwd


def loss_bytes(w: Workload):
    """Bytes a logit costs the loss, forward and backward (shapes.Workload.loss): a fused
    kernel, the logits written by the head and read by it, their gradient written and
    read by the head's backward (4a + 4); eager (autocast's fp32 cross-entropy), the upcast
    to fp32 (a + 4), log-softmax (8), the gradient's zeros and scatter (4), log-softmax's
    backward (12) and the cast back (4 + a)."""
    a = act_bytes(w)
    return 4 * a + F32 if w.loss == "fused" else 32 + 2 * a


def matmul_seconds(m, n, k, w, machine, passes=1):
    """One (m x k) @ (k x n) product, `passes` times: at MATMUL_EFF of the peak plus its
    ramp (UNALIGNED_SLOWDOWN x with a dimension off GEMM_ALIGN_BYTES), or its bytes at HBM
    speed if that is longer; never under one launch."""
    peak = machine.peak[w.precision]
    a = act_bytes(w)
    flops = 2 * m * n * k
    compute = flops / (peak * matmul_eff(machine)) + RAMP_US * 1e-6
    if any(d * a % GEMM_ALIGN_BYTES for d in (m, n, k)):
        compute *= UNALIGNED_SLOWDOWN
    memory = a * (m * k + k * n + m * n) / (machine.hbm_gbps * 1e9 * HBM_EFF)
    return passes * max(compute, memory, LAUNCH_US * 1e-6)


def memory_seconds(nbytes, kernels, machine):
    """`kernels` element-wise kernels moving `nbytes` together."""
    return max(nbytes / (machine.hbm_gbps * 1e9 * HBM_EFF), kernels * LAUNCH_US * 1e-6)


def attention_seconds(w, L, rows, s, fwd, flash, machine, stack="fused"):
    """One pass's attention on one layer of this rank (heads / tp, s query tokens): fused,
    its forward (fwd times: recomputed under full checkpointing) and its backward (2.5 x
    the forward's FLOPs) at attention_eff's shares of the peak."""
    heads, d = w.n_head // L.tp, w.n_embd // w.n_head
    if flash:
        flops = 2 * rows * heads * s * w.block * d   # causal: half of 4 b h s^2 d
        eff_f, eff_b = attention_eff(machine, stack)
        peak = machine.peak[w.precision]
        forward = max(flops / (peak * eff_f), LAUNCH_US * 1e-6)
        backward = max(2.5 * flops / (peak * eff_b), LAUNCH_US * 1e-6)
        return forward * fwd + backward
    scores = rows * heads * s * w.block
    a = act_bytes(w)
    products = matmul_seconds(rows * heads * s, w.block, d, w, machine) \
        + matmul_seconds(rows * heads * s, d, w.block, w, machine)
    forward = products + memory_seconds((4 * a + 1) * scores, 2, machine)
    backward = 2 * products + memory_seconds((8 * a + 2) * scores, 3, machine)
    return forward * (fwd + (0 if L.ckpt else 1)) + backward


def compute_seconds(w: Workload, L: Layout, p: int, machine, params: int,
                    flash: bool = True, stack: str = "fused") -> dict:
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
    attention = layers * attention_seconds(w, L, rows, s, fwd, flash, machine, stack)
    sp_tokens = t // L.tp if L.sp else t              # without SP every TP rank repeats them
    eb_f, eb_b = (b * sp_tokens for b in elementwise_bytes(w, stack))
    k_f, k_b = (EAGER_FWD_KERNELS, EAGER_BWD_KERNELS) if stack == "eager" else \
        (FWD_ELEMENTWISE_KERNELS, BWD_ELEMENTWISE_KERNELS)
    elementwise = layers * (cheap * memory_seconds(eb_f, k_f, machine)
                            + memory_seconds(eb_b, k_b, machine))
    if st.last:  # LM head and loss (the logits written, read by the loss, its gradient)
        V = -(-w.padded_vocab // L.tp)
        matmul += matmul_seconds(t, V, C, w, machine, passes=3)
        elementwise += memory_seconds(loss_bytes(w) * t * V, 6, machine)
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
