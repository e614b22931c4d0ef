"""`torch_ddp`: PyTorch's own DistributedDataParallel, kept as the reference.

Not one of our strategies: it is what `ddp_naive` and `ddp_bucket` are
measured against (parity and speed) in the same run. DDP broadcasts rank 0's
parameters at construction, all-reduces gradient buckets from autograd hooks
during backward, and skips that on accumulation micro-steps under no_sync().
"""

from contextlib import nullcontext

from torch.nn.parallel import DistributedDataParallel as DDP

from parallel.data_parallel.replicated import ReplicatedStrategy


class TorchDDP(ReplicatedStrategy):
    name = "torch_ddp"

    def __init__(self, local, grid, cfg):
        super().__init__(local, grid, cfg)
        device_ids = [self.device] if self.device.type == "cuda" else None
        self.model = DDP(self.module, process_group=grid.grad_group, device_ids=device_ids,
                         bucket_cap_mb=cfg.bucket_cap_mb)

    def backward_scope(self, chunk, last):
        return nullcontext() if last else self.model.no_sync()

