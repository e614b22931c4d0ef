"""The `parallel:` section of gpt2_train_cfg.yaml."""

from dataclasses import dataclass, field
from typing import List


@dataclass
class ParallelConfig:
    dp: str = "ddp_bucket"      # how the data-parallel dimension works (parallel/parallelize.py)
    tp: int = 1                 # tensor-parallel degree (adjacent ranks form a TP group)
    tp_impl: str = "own"        # own | torch (PyTorch's DTensor TP, the reference; dp degree 1)
    sequence_parallel: bool = False  # with tp > 1: LayerNorm/dropout regions on sequence shards
    pp: int = 1                 # pipeline-parallel degree; dp degree = world / (tp * cp * pp)
    pp_impl: str = "own"        # own | torch (torch.distributed.pipelining, the reference)
    cp: int = 1                 # context-parallel degree: each sequence split over cp ranks
    cp_impl: str = "ring"       # ring (ours) | allgather (gather all keys/values: the reference)
    zero_stage: int = 3         # 1, 2 or 3, for dp=fsdp
    dp_replicate: int = 1       # fsdp / torch_fsdp: R replica groups of dp/R ranks, sharded inside, gradients all-reduced across (HSDP)
    offload: bool = False       # fsdp / torch_fsdp: fp32 shard, its gradient and AdamW state in host memory, the optimizer step on the host
    prefetch: bool = True       # fsdp stage 3 / torch_fsdp: all-gather the next unit while this one computes
    reshard_after_forward: bool = True  # fsdp stage 3 / torch_fsdp: free a unit after its forward
    pp_schedule: str = "1f1b"   # gpipe | 1f1b | interleaved | zb1p | zbv, for pp > 1
    microbatches: int = 1       # pipeline micro-batches per (accumulation) step, for pp > 1
    pp_virtual_stages: int = 1  # model chunks per pipeline rank, for pp_schedule=interleaved
    pp_layers: List[int] = field(default_factory=list)  # blocks per chunk; [] = balanced
    bucket_cap_mb: float = 25.0  # gradient bucket size for ddp_bucket / torch_ddp
    allreduce: str = "native"   # native (dist.all_reduce) | ring (data_parallel/ring.py), for ddp_naive / ddp_bucket
    reduce_dtype: str = "fp32"  # fp32 | bf16: dtype of the dp gradient collectives of ddp_naive,
                                # ddp_bucket (native or ring) and fsdp (reduce-scatters)
    timeout_s: float = 600.0    # a collective that waits longer than this fails instead of hanging
