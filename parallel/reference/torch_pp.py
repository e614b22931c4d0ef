"""`torch_pp`: PyTorch's `torch.distributed.pipelining` schedules, the reference for `parallel.pp`.

Not one of our strategies: it is what our pipeline is measured against (parity
and speed) in the same benchmark run, on the same model and the same split.
Pure PP only (data- and tensor-parallel degree 1), chosen as
`parallel.pp_impl=torch parallel.pp=P` with the same `pp_schedule`,
`microbatches` and `pp_virtual_stages` keys: ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble (for zb1p) or
ScheduleZBVZeroBubble (for zbv, on our V placement) over PipelineStage objects.

The model is cut by our own Pipeline (so the split, the canonical names, the
snapshots and the tied embedding's gradient sum between first and last stage
are the same as ours); only the micro-batch schedule, the point-to-point
exchange and the loss scaling run through torch's code. Its traffic goes
through torch, so comm_* metrics do not count it.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)

from parallel import model_plan as plan
from parallel.forward_backward import data_mean, finish_gradients
from parallel.data_parallel.replicated import ReplicatedStrategy

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             # torch's zero-bubble schedules (its own split backward): the references for zb1p
             # (ZB-H1's order is its interleaved zero bubble with one chunk per rank) and zbv
             "zb1p": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}
SINGLE_STAGE = ("gpipe", "1f1b")  # schedules that take one stage, not a list


class ChunkModule(nn.Module):
    """One pipeline chunk as the module torch's PipelineStage runs: token ids or an
    activation in, an activation or (last chunk) the logits out."""

    def __init__(self, model, chunk, blocks):
        super().__init__()
        self.chunk = chunk
        self.embed = model.embed if chunk.first else None
        self.head = model.head if chunk.last else None
        self.blocks = nn.ModuleList([blocks[i] for i in chunk.blocks])
        # register the modules outside the blocks, so their parameters are the stage's
        self.ends = nn.ModuleDict(plan.stage_modules(model, chunk.first, chunk.last))

    def forward(self, x):
        if self.chunk.first:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.chunk.last:
            x, _ = self.head(x)  # the logits; the loss is the schedule's loss_fn
        return x


class TorchPP(ReplicatedStrategy):
    name = "torch_pp"
    replaces = ("loss_and_gradients", "step_stats")  # torch's schedules

    def __init__(self, local, grid, cfg):
        super().__init__(local, grid, cfg)  # our Pipeline cut the model (the same split)
        P = grid.pp_size
        chunks = sorted(self.pipeline.chunks.values(), key=lambda c: c.index)
        self.first = any(c.first for c in chunks)
        self.last = any(c.last for c in chunks)
        self.stages = [PipelineStage(ChunkModule(self.module, c, self.pipeline.blocks), c.index,
                                     P * self.pipeline.V,
                                     self.device, group=grid.pp_group) for c in chunks]
        cls = SCHEDULES[cfg.pp_schedule]
        stages = self.stages[0] if cfg.pp_schedule in SINGLE_STAGE else self.stages
        self.scale = 1.0
        # scale_grads=False: torch would divide the stage's gradients by M after every
        # step() call, accumulated ones included; the loss carries 1 / (M x rounds) instead
        self.schedule = cls(stages, n_microbatches=cfg.microbatches, loss_fn=self._loss,
                            scale_grads=False)

    def step_stats(self, last=False, measure=True):
        return {}, {}  # torch's schedules run outside our Pipeline: no busy/idle record

    def _loss(self, logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1)) * self.scale

    def loss_and_gradients(self, micro_batches):
        rounds = len(micro_batches)
        self.scale = 1.0 / (self.pipeline.M * rounds)
        total = torch.zeros((), device=self.device)
        for x, y in micro_batches:
            args = (x.to(self.device),) if self.first else ()
            losses = [] if self.last else None
            self.schedule.step(*args, target=y.to(self.device) if self.last else None, losses=losses)
            if self.last:  # each is one micro-batch's mean loss x scale
                total += torch.stack([loss.detach() for loss in losses]).sum()
        finish_gradients(self)  # the tied embedding's gradient, summed between first and last
        return data_mean(self, self.pipeline.last_stage_value(total))
