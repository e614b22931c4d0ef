"""Parallel strategies: the YAML key `parallel.dp` picks one from STRATEGIES.

A new strategy is one new file with a `parallel.strategy.Strategy` subclass
plus one line here. `build_strategy` is the only place that looks at the name.
"""

from parallel.ddp_bucket import DDPBucket
from parallel.ddp_naive import DDPNaive
from parallel.fsdp import FSDP
from parallel.single import Single
from parallel.torch_ddp import TorchDDP
from parallel.torch_fsdp import TorchFSDP
from parallel.torch_pp import TorchPP
from parallel.torch_tp import TorchTP

STRATEGIES = {
    "single": Single,        # one process; the parity reference
    "torch_ddp": TorchDDP,   # PyTorch DDP; the speed reference for ddp_*
    "ddp_naive": DDPNaive,   # own DP: one all-reduce per parameter after backward
    "ddp_bucket": DDPBucket,  # own DP: bucketed all-reduces overlapping backward
    "fsdp": FSDP,            # ZeRO stage 1/2/3 (parallel.zero_stage) on flat sharding units
    "torch_fsdp": TorchFSDP,  # PyTorch FSDP2 fully_shard; the reference for fsdp
    "torch_tp": TorchTP,     # PyTorch DTensor tensor parallelism (dp degree 1); the reference for tp
    "torch_pp": TorchPP,     # torch.distributed.pipelining schedules (dp, tp 1); the reference for pp
}


def build_strategy(model, grid, cfg):
    return STRATEGIES[cfg.dp](model, grid, cfg)
