"""The `plan:` section of gpt2_train_cfg.yaml (mode=plan)."""

from dataclasses import dataclass


@dataclass
class PlanConfig:
    nodes: int = 1              # machines in the target cluster
    gpus_per_node: int = 8      # GPUs per machine (ranks of one node share its fast links)
    gpu: str = "H100-80GB"      # a preset of planner/machines.py, e.g. A100-80GB (an unknown name lists them)
    gpu_memory_gb: float = 0.0  # memory per GPU in GB; 0 = the preset's
    peak_bf16_tflops: float = 0.0  # peak dense bf16 TFLOP/s; 0 = the preset's
    peak_fp32_tflops: float = 0.0  # peak dense fp32 TFLOP/s; 0 = the preset's
    intra_node_gbps: float = 0.0   # GB/s one GPU sends another of its node, each way; 0 = the preset's
    inter_node_gbps: float = 0.0   # GB/s of one network card to other nodes, each way; 0 = the preset's
    nics_per_node: int = 0      # network cards a node (NCCL drives one ring each; DGX A100 and H100: 8); 0 = the preset's
    pcie_gbps: float = 0.0      # GB/s one GPU copies to or from its host, each way (offload); 0 = the preset's
    host_gbps: float = 0.0      # GB/s of host memory a rank's host-side AdamW gets (offload); 0 = the preset's
    intra_latency_us: float = 0.0  # one hop of a collective inside a node, in us; 0 = the preset's
    inter_latency_us: float = 0.0  # one hop of a collective across nodes, in us; 0 = the preset's
    hbm_gbps: float = 0.0       # GB/s of the GPU's memory (element-wise work, optimizer); 0 = the preset's
    mfu: float = 0.0            # 0 = the efficiency model's compute time (MFU is an output); > 0 = assume this MFU
    flash_attention: bool = True  # fused attention; false = scores materialized (Megatron-LM before FlashAttention)
    tp_comm_overlap: bool = False  # TP's gathers / scatters pipelined with their GEMMs (Megatron-Core's --tp-comm-overlap); ours are not
    param_gather_overlap: bool = False  # ZeRO-1/2's parameter all-gather behind the next forward (Megatron's --overlap-param-gather; ours: after the step)
    param_gather_bytes: int = 4  # the model's parameters as compute reads them: 4 = ours (fp32 under autocast), 2 = a bf16 model (Megatron's distributed optimizer, FSDP's bf16 param_dtype): its all-gathers (ZeRO-1/2's after the step, ZeRO-3's), residual stream and gathered units in bf16
    grad_reduce_bytes: int = 4  # bytes per element of the data-parallel gradient reductions: 4 = ours (parallel.reduce_dtype=fp32), 2 = bf16 (FSDP's reduce_dtype=bf16)
    stack: str = ""             # how the kernels between the products are written: fused (llm.c, Megatron, TE) | compiled (torch.compile) | eager (PyTorch eager); "" = this product's (eager, compiled with trainer.compile)
    loss_kernel: str = ""       # the loss: fused (one kernel, logits and their gradient in their dtype: flash-attn's, Megatron's, llm.c's) | eager (autocast's fp32 cross-entropy); "" = eager under plan.stack=eager, else fused
    kernel_slowdown: float = 1.0  # kernels take this many times the efficiency model's time (1: fused, llm.c and Megatron; a PyTorch GPT-2 step, nanoGPT: 1.46)
    kv_heads: int = 0           # replaying another system's model: K/V heads of grouped-query attention; 0 = model.n_head
    ffn_hidden: int = 0         # replaying: the MLP's hidden width; 0 = 4 x model.n_embd
    gated_ffn: bool = False     # replaying: a gated MLP (SwiGLU: gate, up and down matrices)
    untied_head: bool = False   # replaying: an LM head of its own, not the token embedding
    search: bool = True         # false: evaluate only the layout of the parallel.* / trainer.* keys given
    vocab_size: int = 0         # vocabulary planned for; 0 = the tokenizer's (gpt2: 50257; char: data.path's)
    top: int = 10               # rows of the printed table
    out: str = ""               # a JSON file: mode=plan, every layout that runs (keys, predictions); mode=dryrun, each rank tried
