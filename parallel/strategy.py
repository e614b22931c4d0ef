"""The interface between the trainer and every way of training across processes.

The trainer never asks which strategy it runs. Per optimizer step it calls

    strategy.reseed(seed)                                # random state of this step
    loss = strategy.loss_and_gradients(micro_batches)   # grads ready and synced
    norm = strategy.clip_gradients(max_norm)             # global norm, across shards
    strategy.optimizer_step(lr)                          # update, then zero grads

`loss` and `norm` stay on the device (0-d tensors): the trainer reads them only at the
steps it logs, so a step makes no host sync of its own on a GPU. `forward_backward` and
`clip_grad_norm_` are the same two returning Python floats (tests, benchmarks).

once at start `configure_compute(tcfg)` (precision, compilation, activation checkpointing)
and `configure_optimizer(tcfg)`, and for evaluation and snapshots `eval_loss`,
`shard_pieces` / `load_shards`
(each rank writes and reads only what it holds) and `state_dict`, all in
*canonical* form: the names and full shapes of the single-device model
(`GPT.named_parameters()`, which names the tied embedding / LM-head weight
once). That is what lets a snapshot written under one layout resume under
another.

The strategy, not the trainer, owns forward, backward and gradient sync of a
step, because tensor parallelism rewrites layers and pipeline parallelism
runs its own micro-batch schedule inside the step.

A strategy is the data-parallel dimension: `parallelize()`
(parallel/parallelize.py) applies tensor and pipeline parallelism first and
hands it a `LocalModel`, this rank's TP-local parameters of its pipeline
stage. The strategy averages gradients over `grid.grad_group`, and with
pp > 1 runs the pipeline schedule (`pipeline_forward_backward`) where it
would loop over micro-batches; `backward_scope` is how its gradient hooks
learn which backward is a chunk's last of the step. Each strategy describes
what it holds as Regions of those parameters (parallel/placement.py);
snapshots, state_dict(), the global gradient norm and the sequence-parallel
gradient sums below are written once, against that description.

What each strategy can do is declared in parallel/registry.py, and which layouts it
runs in parallel/rules.py: the checks of a config import no strategy.
"""

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.checkpointing import checkpoint_blocks
from parallel.comm import CommCounter
from parallel.compile import compile_model
from parallel.grid import derive_seed
from parallel.placement import grad_norm_squared, load_regions, snapshot_pieces
from parallel.precision import Precision


@dataclass
class LocalModel:
    """What tensor and pipeline parallelism leave for the data-parallel strategy."""
    module: torch.nn.Module  # this rank's GPT: TP-local layers, only its pipeline chunks
    placements: dict         # canonical name -> Placement, for every parameter it holds
    comm: CommCounter        # every training collective goes through it, so it is counted
    tp: object = None        # the TPContext (parallel/tensor_parallel/apply.py), if tp > 1
    pipeline: object = None  # the Pipeline (parallel/pipeline_parallel/pipeline.py), if pp > 1
    split: object = None     # (x, y) -> what this rank keeps of a micro-batch (cp > 1: its
                             # chunks of every sequence); None: all of it
    init: object = None      # the initial weights, read by canonical box (parallel/initial.py):
                             # the module is on the meta device until the strategy fills it


class Strategy:
    """One instance per rank. Subclasses implement the methods that raise below."""

    name = None  # its registry key; what it can do and refuses: parallel/registry.py, rules.py

    def __init__(self, local: LocalModel, grid, cfg):
        self.grid, self.cfg, self.device = grid, cfg, grid.device
        self.comm = local.comm
        self.placements = local.placements
        self.tp, self.pipeline = local.tp, local.pipeline
        self.split = local.split or (lambda x, y: (x, y))
        self.gpt = local.module  # this rank's (TP-local, stage-cut) GPT, for configure_compute
        # the strategy's model (wrapped or not): on the meta device until the strategy
        # allocates what this rank holds and calls materialize()
        self.module = local.module
        self.init = local.init
        self.model = self.module  # what forward runs through: the GPT, or a wrapper of it
        self.precision = Precision("fp32", self.device)
        self.optimizer = None     # configure_optimizer
        self.last_state_bytes = 0  # set by optimizer_step, see state_figures()
        self.last_host_state_bytes = 0  # of it, what is offloaded to host memory (parallel.offload)

    def configure_compute(self, tcfg):
        """trainer.precision, trainer.compile and trainer.activation_checkpointing, for every
        strategy: autocast around each forward and the fp16 loss scaler
        (parallel/precision.py); each transformer block compiled (parallel/compile.py),
        then recomputed in backward (parallel/checkpointing.py), which wraps the compiled
        forward, so the recompute runs compiled too."""
        self.precision = Precision(tcfg.precision, self.device, tcfg.fp16_init_scale,
                                   tcfg.fp16_growth_interval, self.grid.world_size)
        if self.pipeline is not None:
            self.pipeline.precision = self.precision
        if tcfg.compile:
            compile_model(self.gpt, tcfg.compile_backend, tcfg.compile_scope)
        if tcfg.activation_checkpointing:
            checkpoint_blocks(self.gpt, self.tp.random if self.tp is not None else None)

    def configure_optimizer(self, tcfg):
        raise NotImplementedError

    def forward_backward(self, micro_batches) -> float:
        """loss_and_gradients, the loss read as a Python float."""
        return self.loss_and_gradients(micro_batches).item()

    def loss_and_gradients(self, micro_batches) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches; gradients end up
        as if one process had run the whole global batch. Returns the mean
        loss over the global batch, on every rank, as a 0-d tensor on the device (not
        read: no host sync). Strategies shape it through
        `backward_scope` (around each micro-batch), `sync_gradients` and
        `self.model` (what forward runs through: the GPT, or a wrapper)."""
        micro_batches = [self.split(x, y) for x, y in micro_batches]
        if self.pipeline is not None:
            loss = self.pipeline_forward_backward(micro_batches)
        else:
            total = torch.zeros((), device=self.device)
            for i, (x, y) in enumerate(micro_batches):
                with self.backward_scope(None, i == len(micro_batches) - 1):
                    _, micro_loss = self.forward_loss(self.model, x, y)
                    self.backward(micro_loss, len(micro_batches))
                total += micro_loss.detach()
            loss = total / len(micro_batches)
        self.sync_gradients()
        self.finish_gradients()
        return self.dp_mean(loss)

    def sync_gradients(self):
        """After the step's last backward: data-parallel strategies that average their
        gradients only then (ddp_naive) wait or reduce here."""

    @torch.no_grad()
    def eval_loss(self, x, y):
        """Mean loss over the global eval batch (x, y is this rank's share), through
        `self.module` (the strategy's model) or its pipeline stages."""
        x, y = self.split(x, y)
        self.module.eval()
        try:
            if self.pipeline is not None:
                loss = self.pipeline.eval_loss(x, y)
            else:
                with self.comm.uncounted():  # TP's collectives, fsdp's gathers: not training traffic
                    _, loss = self.forward_loss(self.module, x, y)
        finally:
            self.module.train()
        return self.dp_mean(loss).item()

    def optimizer_step(self, lr):
        raise NotImplementedError

    def regions(self) -> list:
        """The Regions of TP-local parameters this rank holds (see parallel/placement.py)."""
        raise NotImplementedError

    def norm_group(self):
        """The group over which ranks hold different gradient elements (None: every rank
        holds them all). The squared norm is summed over it."""
        raise NotImplementedError

    def grads(self) -> list:
        """The gradient tensors clipping scales (each once)."""
        raise NotImplementedError

    def backward_scope(self, chunk, last):
        """Context around one micro-batch's backward through one pipeline chunk, or
        (chunk None, no pipeline) around its forward and backward through the whole
        model (PyTorch's DDP.no_sync must see the forward too); `last`: no later
        backward of that chunk in this step."""
        return nullcontext()

    # ------------------------------------------------ written once, for every strategy

    def reseed(self, seed):
        """Random state for one step: `seed` depends on (trainer.seed, step) only, so a
        resumed run draws what an uninterrupted one would. dp ranks differ (their
        batches do), and so do pipeline stages (their layers do: the same stream on
        two stages would give layer 0 and layer L/P the same masks); TP ranks share
        the stream where their activations are the same."""
        base = seed + self.grid.data_rank  # the data-parallel rank: dp_replicate x dp
        if self.grid.cp_size > 1:  # cp ranks hold other tokens: other masks
            base = derive_seed(base, "context shard", self.grid.cp_rank)
        if self.grid.pp_size > 1:
            base = derive_seed(base, "pipeline stage", self.grid.pp_rank)
        torch.manual_seed(base)
        if self.tp is not None:
            self.tp.reseed(base)

    def clip_grad_norm_(self, max_norm) -> float:
        """clip_gradients, the norm read as a Python float."""
        return self.clip_gradients(max_norm).item()

    def clip_gradients(self, max_norm) -> torch.Tensor:
        """Scale gradients so their global norm is at most max_norm; return the norm before
        (a 0-d tensor on the device, not read). Sharded elements are summed over the
        ranks holding them, replicated ones counted on one replica (Region.in_norm).
        fp16: gradients are unscaled first, and a step whose gradients overflowed
        anywhere is skipped by every rank (optimizer_step). Norm and scaling run as
        foreach kernels (one launch for all tensors, not one per tensor)."""
        self.precision.unscale_and_check(self.grads())
        sq = grad_norm_squared(self.regions(), self.device)
        group = self.norm_group()
        if group is not None:
            self.comm.all_reduce(sq, group=group)
        norm = sq.sqrt()
        if not self.precision.skip_step:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
            grads = self.grads()
            for device in {g.device for g in grads}:  # offloaded gradients live in host memory
                torch._foreach_mul_([g for g in grads if g.device == device], coef.to(device))
        return norm

    def drop_step(self, lr):
        """End a step without updating anything (fault tolerance: the groups did not
        commit it): the optimizer skips it as after an fp16 overflow, and the gradients are
        dropped as after any step."""
        self.precision.skip_step = True
        self.optimizer_step(lr)

    def step_optimizer(self):
        """optimizer.step(), unless fp16 gradients overflowed on some rank this step
        (then every rank skips it; the gradients are dropped as usual)."""
        if not self.precision.skip_step:
            self.optimizer.step()

    def forward_loss(self, model, x, y):
        """One forward under the configured precision: (logits, loss)."""
        x, y = self.to_device(x, y)
        with self.precision.autocast():
            return model(x, y)

    def backward(self, loss, divide_by):
        """Backward of loss / divide_by, times the fp16 loss scale (if any)."""
        loss = loss / divide_by
        if self.precision.loss_scale != 1.0:
            loss = loss * self.precision.loss_scale
        loss.backward()

    def sharded_group(self, *dims):
        """The group over those of `dims` (names of grid.DIMS) that have more than one rank,
        or None if none has."""
        dims = [d for d in dims if self.grid.sizes[d] > 1]
        return self.grid.group_over(*dims) if dims else None

    def pipeline_forward_backward(self, micro_batches):
        """Each of this rank's micro-batches (trainer.grad_accum of them) becomes one pass
        of the pipeline schedule over parallel.microbatches pieces; every piece's loss is
        divided by their total count. Returns the mean loss, from the last stage."""
        rounds, M = len(micro_batches), self.pipeline.M
        total = torch.zeros((), device=self.device)
        for r, (x, y) in enumerate(micro_batches):
            x, y = self.to_device(x, y)  # once, not once per pipeline action
            final = r == rounds - 1
            scale = 1.0 / (M * rounds)  # and the fp16 loss scale, if any
            if self.precision.loss_scale != 1.0:
                scale *= self.precision.loss_scale
            total += self.pipeline.run(list(zip(x.chunk(M), y.chunk(M))), scale,
                                       lambda c, last: self.backward_scope(c, last and final))
        return self.pipeline.last_stage_value(total / (M * rounds))

    def to_device(self, *tensors):
        """Host tensors to the device. CUDA: through pinned memory, asynchronously, so the
        copy overlaps what the stream is still computing."""
        if self.device.type != "cuda":
            return [t.to(self.device) for t in tensors]
        return [t.pin_memory().to(self.device, non_blocking=True) for t in tensors]

    def finish_gradients(self):
        """After backward and the data-parallel sync: sums over TP (sequence parallelism)
        and over the two stages holding the tied embedding (pipeline)."""
        if self.tp is not None:
            self._sum_grads(lambda p: p.partial_grad, self.tp.group)
        if self.pipeline is not None and self.pipeline.embedding_group is not None:
            self._sum_grads(lambda p: p.tied is not None, self.pipeline.embedding_group)

    def _sum_grads(self, which, group):
        """All-reduce (sum) the gradients of the regions whose placement `which` picks, in
        one flat call."""
        views = [r.values(r.opt_param.grad) for r in self.regions()
                 if which(r.placement) and r.opt_param.grad is not None]
        if not views:
            return
        flat = torch.cat(views).to(self.device)  # offloaded gradients: from the host and back
        self.comm.all_reduce(flat, group=group)
        at = 0
        for v in views:
            v.copy_(flat[at:at + v.numel()])
            at += v.numel()

    def step_stats(self, last=False, measure=True):
        """(figures for this step's metrics record, {file name: JSON-able} the main rank
        writes into the run directory): the pipeline's busy/idle time per stage, and
        on the last step its timeline. Collective when measure (every rank measures the
        same steps); measure=False drops the step's record without reading the device."""
        if self.pipeline is None:
            return {}, {}
        if not measure:
            self.pipeline.drop_step_stats()
            return {}, {}
        stats, timelines = self.pipeline.step_stats(with_timeline=last)
        files = {"pipeline_timeline.json": {"stages": timelines, "schedule": self.pipeline.schedule,
                                            "microbatches": self.pipeline.M,
                                            "virtual_stages": self.pipeline.V}} if last else {}
        return stats, files

    def shard_pieces(self) -> list:
        """What this rank writes into a sharded snapshot: [(canonical key, full shape,
        box, tensor)], keys "model/<name>" and "optim/<name>/<state>". Across ranks
        every element of every key is covered exactly once."""
        return snapshot_pieces(self.regions(), self.optimizer)

    def load_shards(self, reader):
        """Take what this rank holds from a snapshot_reader.SnapshotReader, whatever layout wrote it."""
        load_regions(self.regions(), self.optimizer, reader)

    def materialize(self):
        """Fill the parameters this rank holds (allocated by the strategy) with the initial
        weights (parallel/initial.py), through the snapshot path: each rank reads only
        its regions, one canonical parameter at a time. Then let the initializer go."""
        load_regions(self.regions(), None, self.init)
        self.init = None

    @torch.no_grad()
    def state_dict(self) -> dict:
        """Canonical model parameters (CPU tensors, full shapes) on grid.is_main (empty
        elsewhere), assembled from what each rank writes to snapshots. Collective."""
        mine = [(key[len("model/"):], shape, box, t.cpu().clone())
                for key, shape, box, t in snapshot_pieces(self.regions(), self.optimizer,
                                                          with_optimizer=False)]
        everyone = [mine]
        if self.grid.world_size > 1:  # in host memory (gloo), never staged on the GPU
            everyone = [None] * self.grid.world_size if self.grid.is_main else None
            dist.gather_object(mine, everyone, dst=0, group=self.grid.host_group)
        if not self.grid.is_main:
            return {}
        state = {}  # every rank's pieces: under a pipeline this rank holds only its stage
        for pieces in everyone:
            for name, shape, box, t in pieces:
                full = state.setdefault(name, torch.empty(shape, dtype=t.dtype))
                full[tuple(slice(a, b) for a, b in box)] = t
        return state

    def comm_stats(self) -> dict:
        """Collective calls/bytes since the last call (see parallel/comm.py)."""
        return self.comm.pop()

    def state_figures(self) -> dict:
        """{"state_bytes": bytes of parameters + gradients + optimizer state resident on the
        device of the fullest rank, "host_state_bytes": those of them in host memory
        (parallel.offload; only where some are)}, measured at the end of the last
        optimizer step (before grads are freed). Each the max over every rank: shards,
        pipeline stages and TP ranks hold different amounts, and the trainer logs rank
        0's value, which should be the worst rank's. Collective (the trainer asks at the
        steps it logs); host integers over the host group: nothing read from the device,
        not training traffic."""
        device, host = (int(v) for v in self.grid.max_over_ranks(
            [self.last_state_bytes, self.last_host_state_bytes]))
        return {"state_bytes": device, **({"host_state_bytes": host} if host else {})}

    def state_bytes(self) -> int:
        """state_figures()'s device bytes."""
        return self.state_figures()["state_bytes"]

    def dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a scalar over the ranks that see different data, grid.grad_group
        (losses, for logging; deliberately not counted as training traffic). Stays on
        the device."""
        value = value.detach().clone()
        if self.grid.grad_size > 1:
            with self.comm.uncounted():
                self.comm.all_reduce(value, group=self.grid.grad_group)
            value /= self.grid.grad_size
        return value


# ---------------------------------------------------------------- helpers of the strategies

def resident_bytes(params, optimizer):
    """Parameters + their gradients + optimizer state tensors, in bytes (each tensor once)."""
    seen, total = set(), 0
    tensors = []
    for p in params:
        tensors += [p, p.grad]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def build_adamw(named_params: dict, groups, tcfg, **kwargs):
    """AdamW over `named_params`, grouped by name as GPT.optim_groups says."""
    return torch.optim.AdamW(
        [{**g, "params": [named_params[n] for n in g["params"] if n in named_params]}
         for g in groups],
        lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay, **kwargs)
