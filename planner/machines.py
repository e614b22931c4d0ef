"""GPU presets for mode=plan: memory, peak FLOP/s, memory bandwidth and the two links a
group can cross.

Peak FLOP/s are telemetry/mfu.py's table (dense tensor-core figures from the vendors'
data sheets), so the planner assumes the peaks the runs report MFU against. Memory
and links, per GPU:

- A100 SXM 40/80 GB: NVIDIA A100 Tensor Core GPU data sheet (2021): NVLink 3 at
  600 GB/s per GPU, both directions together, so 300 GB/s each way; DGX A100 user
  guide: 8 x 200 Gb/s HDR InfiniBand network cards a node, 25 GB/s each.
- H100 SXM 80 GB: NVIDIA H100 Tensor Core GPU data sheet (2023): NVLink 4 at 900 GB/s
  both ways (450 each way); DGX H100 user guide: 8 x 400 Gb/s NDR ConnectX-7 a node,
  50 GB/s each.
- H200 SXM 141 GB: NVIDIA H200 Tensor Core GPU data sheet (2024): 141 GB HBM3e at 4.8
  TB/s, the H100 SXM's dense peaks (989 TFLOP/s bf16), NVLink 4 at 900 GB/s both ways
  (450 each way); DGX H200 user guide: 8 x 400 Gb/s ConnectX-7 a node, 50 GB/s each;
  its host as DGX H100's.
- B200 180 GB (preset B200-180GB): NVIDIA DGX B200 data sheet (2024): 1,440 GB of HBM3e and 64 TB/s over 8
  GPUs, so 180 GB at 8 TB/s each (the chip carries 192 GB; the 8-GPU systems expose
  180: plan.gpu_memory_gb=192 for another SKU), NVLink 5 at 1.8 TB/s both ways (900
  each way), 8 x 400 Gb/s ConnectX-7 a node, 50 GB/s each; HGX B200 specifications
  (2024): per GPU 4.5 PFLOP/s bf16 with sparsity, so 2.25 dense, fp32 75 TFLOP/s. PCIe
  Gen5 to the host; the host's memory (two Xeon 8570 sockets of DDR5) taken as DGX
  H100's (75). Its kernels' shares of the peak are Hopper's, assumed
  (planner/efficiency.py).
- L4 24 GB: NVIDIA L4 data sheet (2023): no NVLink, PCIe Gen4 x16 at 64 GB/s both
  ways (32 each way); Google Cloud g2-standard-96 (8 L4): 100 Gb/s of network per
  machine, one 12.5 GB/s card.
- V100 SXM2 32 GB: NVIDIA V100 data sheet (2020): NVLink 2 at 300 GB/s both ways
  (150 each way); DGX-1 user guide: 4 x 100 Gb/s EDR InfiniBand a node, 12.5 GB/s
  each. No bf16 units (fp16 only).

Across nodes NCCL runs one ring (channel) per network card a node has, so a group
with g ranks on each node drives g cards (the node's cards shared by the node's
groups of that dimension), not one: `nics_per_node` (`plan.nics_per_node`) and one
card's GB/s (`inter_node_gbps`, `plan.inter_node_gbps`); planner/step_time.py's
`_link` prices it.

For parallel.offload, each GPU's link to its host (PCIe, each way, what a copy reaches:
Gen3 x16 12, Gen4 25, Gen5 50 GB/s) and the host memory traffic its rank's AdamW gets
(the node's memory bandwidth over its GPUs: DGX A100's two 8-channel DDR4-3200 sockets,
~400 GB/s, / 8 = 50; DGX H100's DDR5, ~600 / 8 = 75; DGX-1's DDR4-2400, ~150 / 8 = 19;
a g2 L4 host 40). Assumed figures: the fused CPU AdamW is taken as bound by memory.

Memory bandwidth (HBM, what element-wise kernels and the optimizer stream at), from the
same data sheets: A100 40GB SXM 1,555 GB/s, A100 80GB SXM 2,039 GB/s, H100 SXM 3,350
GB/s, H200 4,800 GB/s, B200 8,000 GB/s, L4 300 GB/s, V100 SXM2 900 GB/s. Per-hop latency of a collective (assumed, the
order NCCL's own small-message tests show): 3 us over NVLink / NVSwitch, 6 us over
PCIe, 10 us across nodes (InfiniBand or Ethernet).

Every figure can be overridden by its own key (`plan.gpu_memory_gb`, ...): a cluster
with another network is one override away.
"""

from dataclasses import dataclass

from errors import UserError
from telemetry.mfu import peak_flops


@dataclass(frozen=True)
class Machine:
    name: str
    memory_gb: float            # per GPU, GB (1e9 bytes)
    peak: dict                  # precision -> FLOP/s (a precision missing: no units for it)
    intra_node_gbps: float      # GB/s each way, GPU to GPU in one node
    inter_node_gbps: float      # GB/s each way of one network card (to other nodes)
    pcie_gbps: float            # GB/s each way, GPU to its host (parallel.offload's copies)
    host_gbps: float            # GB/s of host memory traffic one GPU's rank gets for the host's AdamW
    hbm_gbps: float             # GB/s of the GPU's own memory (element-wise kernels, the optimizer)
    intra_latency_us: float     # one hop of a collective inside a node
    inter_latency_us: float     # one hop across nodes
    nics_per_node: int = 8      # network cards a node (NCCL: one ring each)
    generation: str = "ampere"  # the GPU's architecture (planner/efficiency.py's tables)


def _peaks(model_name):
    return {p: peak_flops(model_name, p) for p in ("bf16", "fp16", "fp32")
            if peak_flops(model_name, p)}


PRESETS = {m.name: m for m in [
    Machine("A100-40GB", 40, _peaks("A100"), 300, 25, 25, 50, 1555, 3, 10, 8, "ampere"),
    Machine("A100-80GB", 80, _peaks("A100"), 300, 25, 25, 50, 2039, 3, 10, 8, "ampere"),
    Machine("H100-80GB", 80, _peaks("H100"), 450, 50, 50, 75, 3350, 3, 10, 8, "hopper"),
    Machine("H200-141GB", 141, _peaks("H200"), 450, 50, 50, 75, 4800, 3, 10, 8, "hopper"),
    Machine("B200-180GB", 180, _peaks("B200"), 900, 50, 50, 75, 8000, 3, 10, 8, "blackwell"),
    Machine("L4", 24, _peaks("L4"), 32, 12.5, 25, 40, 300, 6, 10, 1, "ada"),
    Machine("V100-32GB", 32, _peaks("V100"), 150, 12.5, 12, 19, 900, 3, 10, 4, "volta"),
]}


def machine(pcfg) -> Machine:
    """The preset `plan.gpu` names, with each `plan.*` override that is set (non-zero)."""
    if pcfg.gpu not in PRESETS:
        raise UserError(f"plan.gpu={pcfg.gpu!r} is not a preset: one of {', '.join(PRESETS)} "
                        "(or the nearest one with plan.gpu_memory_gb, plan.peak_bf16_tflops, "
                        "plan.peak_fp32_tflops, plan.intra_node_gbps, plan.inter_node_gbps, plan.hbm_gbps)")
    m = PRESETS[pcfg.gpu]
    peak = dict(m.peak)
    if pcfg.peak_bf16_tflops:
        peak["bf16"] = pcfg.peak_bf16_tflops * 1e12
    if pcfg.peak_fp32_tflops:
        peak["fp32"] = pcfg.peak_fp32_tflops * 1e12
    return Machine(m.name, pcfg.gpu_memory_gb or m.memory_gb, peak,
                   pcfg.intra_node_gbps or m.intra_node_gbps,
                   pcfg.inter_node_gbps or m.inter_node_gbps,
                   pcfg.pcie_gbps or m.pcie_gbps, pcfg.host_gbps or m.host_gbps,
                   pcfg.hbm_gbps or m.hbm_gbps, pcfg.intra_latency_us or m.intra_latency_us,
                   pcfg.inter_latency_us or m.inter_latency_us, pcfg.nics_per_node or m.nics_per_node,
                   m.generation)
