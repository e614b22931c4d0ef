"""The `plan:` section of gpt2_train_cfg.yaml (mode=plan)."""

from dataclasses import dataclass


@dataclass
class PlanConfig:
    nodes: int = 1              # machines in the target cluster
    gpus_per_node: int = 8      # GPUs per machine (ranks of one node share its fast links)
    gpu: str = "H100-80GB"      # a preset of planner/machines.py
    gpu_memory_gb: float = 0.0  # each override: 0 = the preset's value
    peak_bf16_tflops: float = 0.0
    peak_fp32_tflops: float = 0.0
    intra_node_gbps: float = 0.0   # GB/s (bytes) one GPU sends to another of its node
    inter_node_gbps: float = 0.0   # GB/s (bytes) one GPU sends to another node
    pcie_gbps: float = 0.0      # GB/s (bytes) one GPU copies to or from its host (parallel.offload)
    host_gbps: float = 0.0      # GB/s of host memory traffic a rank's host-side AdamW gets (parallel.offload)
    mfu: float = 0.4            # assumed fraction of peak the matrix products reach
    vocab_size: int = 0         # 0 = the tokenizer's (gpt2: 50257; char: from data.path)
    top: int = 10               # rows of the printed table
    out: str = ""               # a JSON file with every layout and its predictions
