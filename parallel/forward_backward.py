"""A step's forward and backward, and its random state, for every data-parallel strategy:
this rank's micro-batches through the strategy's model (pp > 1: the pipeline's schedule)
under the step's precision, inside the strategy's `backward_scope`; its `sync_gradients`;
then the sums tensor and pipeline parallelism leave to do (`finish_gradients`)."""

import torch

from parallel import model_plan as plan
from parallel.grid import derive_seed


def reseed(grid, tp, seed):
    """Random state for one step: `seed` depends on (trainer.seed, step) only, so a
    resumed run draws what an uninterrupted one would. dp ranks differ (their batches
    do), and so do pipeline stages (their layers do: the same stream on two stages would
    give layer 0 and layer L/P the same masks); TP ranks share the stream where their
    activations are the same."""
    base = seed + grid.data_rank  # the data-parallel rank: dp_replicate x dp
    if grid.cp_size > 1:  # cp ranks hold other tokens: other masks
        base = derive_seed(base, "context shard", grid.cp_rank)
    if grid.pp_size > 1:
        base = derive_seed(base, "pipeline stage", grid.pp_rank)
    torch.manual_seed(base)
    if tp is not None:
        tp.reseed(base)


class ForwardBackward:
    def __init__(self, dp, split, precision):
        """dp: the data-parallel strategy; split: (x, y) -> what this rank keeps of a
        micro-batch (cp > 1: its chunks of every sequence), or None; precision: the
        step's (parallel/precision.py)."""
        self.dp, self.precision = dp, precision
        self.split = split or (lambda x, y: (x, y))

    def loss_and_gradients(self, micro_batches) -> torch.Tensor:
        """Gradients as if one process had run the whole global batch; returns its mean
        loss, on every rank, a 0-d tensor on the device (not read: no host sync)."""
        dp = self.dp
        micro_batches = [self.split(x, y) for x, y in micro_batches]
        pieces = len(micro_batches) * (dp.pipeline.M if dp.pipeline is not None else 1)
        for _, moe in plan.moe_layers(dp.module):  # their losses' gradient: the main loss's
            moe.begin_step(self.precision.loss_scale / pieces)
        if dp.pipeline is not None:
            dp.comm.at(phase="pipeline schedule (forward and backward)")
            loss = self.pipeline_rounds(micro_batches)
        else:
            total = torch.zeros((), device=dp.device)
            for i, (x, y) in enumerate(micro_batches):
                with dp.backward_scope(None, i == len(micro_batches) - 1):
                    dp.comm.at(phase="forward")
                    _, micro_loss = self.forward_loss(dp.model, x, y)
                    dp.comm.at(phase="backward")
                    self.backward(micro_loss, len(micro_batches))
                total += micro_loss.detach()
            loss = total / len(micro_batches)
        dp.comm.at(phase="gradient sync")
        dp.sync_gradients()
        finish_gradients(dp)
        return data_mean(dp, loss)

    @torch.no_grad()
    def eval_loss(self, x, y) -> float:
        """Mean loss over the global eval batch (x, y is this rank's share), through the
        strategy's module or its pipeline stages."""
        dp = self.dp
        dp.comm.at(phase="evaluation")
        x, y = self.split(x, y)
        dp.module.eval()
        try:
            if dp.pipeline is not None:
                loss = dp.pipeline.eval_loss(x, y)
            else:
                with dp.comm.uncounted():  # TP's collectives, fsdp's gathers: not training traffic
                    _, loss = self.forward_loss(dp.module, x, y)
        finally:
            dp.module.train()
        return data_mean(dp, loss).item()

    def forward_loss(self, model, x, y):
        """One forward under the step's precision: (logits, loss)."""
        x, y = to_device(self.dp.device, x, y)
        with self.precision.autocast():
            return model(x, y)

    def backward(self, loss, divide_by):
        """Backward of loss / divide_by, times the fp16 loss scale (if any)."""
        loss = loss / divide_by
        if self.precision.loss_scale != 1.0:
            loss = loss * self.precision.loss_scale
        loss.backward()

    def pipeline_rounds(self, micro_batches):
        """Each of this rank's micro-batches (trainer.grad_accum of them) becomes one pass
        of the pipeline schedule over parallel.microbatches pieces; every piece's loss is
        divided by their total count. Returns the mean loss, from the last stage."""
        dp = self.dp
        rounds, M = len(micro_batches), dp.pipeline.M
        total = torch.zeros((), device=dp.device)
        for r, (x, y) in enumerate(micro_batches):
            x, y = to_device(dp.device, x, y)  # once, not once per pipeline action
            final = r == rounds - 1
            scale = 1.0 / (M * rounds)  # and the fp16 loss scale, if any
            if self.precision.loss_scale != 1.0:
                scale *= self.precision.loss_scale
            total += dp.pipeline.run(list(zip(x.chunk(M), y.chunk(M))), scale,
                                     lambda c, last: dp.backward_scope(c, last and final))
        return dp.pipeline.last_stage_value(total / (M * rounds))


def to_device(device, *tensors):
    """Host tensors to the device. CUDA: through pinned memory, asynchronously, so the
    copy overlaps what the stream is still computing."""
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    return [t.pin_memory().to(device, non_blocking=True) for t in tensors]


def finish_gradients(dp):
    """After backward and the data-parallel sync: sums over TP (sequence parallelism) and
    over the two stages holding the tied embedding (pipeline)."""
    if dp.tp is not None:
        _sum_grads(dp, lambda p: p.partial_grad, dp.tp.group)
    if dp.pipeline is not None and dp.pipeline.embedding_group is not None:
        _sum_grads(dp, lambda p: p.tied is not None, dp.pipeline.embedding_group)


def _sum_grads(dp, which, group):
    """All-reduce (sum) the gradients of the regions whose placement `which` picks, in one
    flat call."""
    views = [r.values(r.opt_param.grad) for r in dp.regions()
             if which(r.placement) and r.opt_param.grad is not None]
    if not views:
        return
    flat = torch.cat(views).to(dp.device)  # offloaded gradients: from the host and back
    dp.comm.all_reduce(flat, group=group)
    at = 0
    for v in views:
        v.copy_(flat[at:at + v.numel()])
        at += v.numel()


def data_mean(dp, value: torch.Tensor) -> torch.Tensor:
    """Average a scalar over the ranks that see different data, grid.grad_group (losses,
    for logging; deliberately not counted as training traffic). Stays on the device."""
    value = value.detach().clone()
    if dp.grid.grad_size > 1:
        with dp.comm.uncounted():
            dp.comm.all_reduce(value, group=dp.grid.grad_group)
        value /= dp.grid.grad_size
    return value
