"""The `parallel:` section of gpt2_train_cfg.yaml."""

from dataclasses import dataclass, field
from typing import List


@dataclass
class ParallelConfig:
    dp: str = "ddp_bucket"      # data-parallel strategy: ddp_bucket | ddp_naive | fsdp | single
                                # | torch_ddp | torch_fsdp (PyTorch's, the references)
    tp: int = 1                 # tensor-parallel degree: adjacent ranks split every layer (Megatron)
    tp_impl: str = "own"        # own | torch (PyTorch's DTensor TP, the reference: dp 1, fp32)
    sequence_parallel: bool = False  # with tp > 1: LayerNorm/dropout regions on sequence shards
    pp: int = 1                 # pipeline-parallel degree: the blocks cut into pp stages
    pp_impl: str = "own"        # own | torch (torch.distributed.pipelining, the reference: dp, tp 1)
    cp: int = 1                 # context-parallel degree: each sequence split over cp ranks (ring
                                # attention); dp degree = world / (tp * cp * pp)
    ep: int = 1                 # expert-parallel degree: each MoE block's experts split over ep
                                # ranks carved out of the dp x cp ranks (tokens all-to-all)
    ep_impl: str = "alltoall"   # alltoall (ours: tokens to their experts' ranks) | allgather
                                # (every rank gathers all tokens: the reference)
    cp_impl: str = "ring"       # ring (ours) | allgather (gather all keys/values: the reference)
    zero_stage: int = 3         # for dp=fsdp: 1 (optimizer state sharded) | 2 (+ gradients) | 3 (+ parameters)
    dp_replicate: int = 1       # for dp=fsdp / torch_fsdp: the dp ranks in this many replica groups
                                # (HSDP): sharded inside a group, gradients all-reduced across
    offload: bool = False       # for dp=fsdp / torch_fsdp: this rank's fp32 shard, its gradient and
                                # AdamW state in host memory, the optimizer step on the host
    prefetch: bool = True       # fsdp stage 3 / torch_fsdp: all-gather the next unit while this one computes
    reshard_after_forward: bool = True  # fsdp stage 3 / torch_fsdp: free a unit after its forward
    pp_schedule: str = "1f1b"   # for pp > 1: gpipe | 1f1b | interleaved | zb1p | zbv
    microbatches: int = 1       # pipeline micro-batches per (accumulation) step; more = smaller bubble
    pp_virtual_stages: int = 1  # model chunks per pipeline rank, for pp_schedule=interleaved
    pp_layers: List[int] = field(default_factory=list)  # blocks per chunk, e.g. [3, 2]; [] = balanced
    bucket_cap_mb: float = 25.0  # gradient bucket size (MB) for ddp_bucket / torch_ddp
    allreduce: str = "native"   # gradient all-reduce of ddp_naive / ddp_bucket: native | ring (ours)
    reduce_dtype: str = "fp32"  # fp32 | bf16: dtype of the data-parallel gradient collectives of
                                # ddp_naive, ddp_bucket and fsdp; bf16 halves their bytes
    timeout_s: float = 600.0    # a collective that waits longer than this fails instead of hanging
