"""The interface between the trainer and every way of training across processes.

The trainer never asks which strategy it runs. Per optimizer step it calls

    strategy.reseed(seed)                             # random state of this step
    loss = strategy.forward_backward(micro_batches)  # grads ready and synced
    norm = strategy.clip_grad_norm_(max_norm)         # global norm, across shards
    strategy.optimizer_step(lr)                       # update, then zero grads

once at start `configure_compute(tcfg)` (precision, activation checkpointing)
and `configure_optimizer(tcfg)`, and for evaluation and snapshots `eval_loss`,
`shard_pieces` / `load_shards`
(each rank writes and reads only what it holds) and `state_dict`, all in
*canonical* form: the names and full shapes of the single-device model
(`GPT.named_parameters()`, which names the tied embedding/LM-head weight once
as `transformer.wte.weight`). That is what lets a snapshot written under one
layout resume under another.

The strategy, not the trainer, owns forward, backward and gradient sync of a
step, because tensor parallelism rewrites layers and pipeline parallelism
runs its own micro-batch schedule inside the step.

Tensor and pipeline parallelism are applied here, for every data-parallel
strategy, before the strategy sees the model (parallel/tensor_parallel.py,
parallel/pipeline.py): the strategy then works on this rank's TP-local
parameters of its pipeline stage, over the dp group, and with pp > 1 runs
the pipeline schedule (`pipeline_forward_backward`) where it would loop over
micro-batches; `backward_scope` is how its gradient hooks learn which
backward is a chunk's last of the step. Each strategy describes what
it holds as Regions of those parameters (parallel/placement.py); snapshots,
state_dict(), the global gradient norm and the sequence-parallel gradient
sums below are written once, against that description.

`ReplicatedStrategy` (parallel/replicated.py) is the shared base for the
strategies where every dp rank holds the whole (TP-local) model.
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist

from errors import UserError
from parallel.comm import CommCounter
from parallel.grid import derive_seed
from parallel.pipeline import Pipeline
from parallel.placement import Placement, grad_norm_squared, load_regions, snapshot_pieces
from parallel.checkpointing import checkpoint_blocks
from parallel.precision import Precision
from parallel.tensor_parallel import apply_tensor_parallel


class Strategy:
    """One instance per rank. Subclasses implement the methods that raise below."""

    own_tensor_parallel = True  # False: a reference that parallelizes the model itself

    def __init__(self, model, grid, cfg):
        self.grid, self.cfg, self.device = grid, cfg, grid.device
        self.comm = CommCounter()  # training traffic goes through it, so it is counted
        self.last_state_bytes = 0  # set by optimizer_step, see state_bytes()
        if grid.tp_size > 1 and self.own_tensor_parallel:
            self.placements, self.tp = apply_tensor_parallel(model, grid, cfg, self.comm)
        else:
            self.placements = {n: Placement.whole(n, p.shape) for n, p in model.named_parameters()}
            self.tp = None
        self.pipeline = None
        if grid.pp_size > 1:
            self.pipeline = Pipeline(model, grid, cfg, self.comm, self.placements)
            self.placements = self.pipeline.placements
        self.gpt = model  # this rank's (TP-local, stage-cut) GPT, for configure_compute
        self.precision = Precision("fp32", self.device)

    def configure_compute(self, tcfg):
        """trainer.precision and trainer.activation_checkpointing, for every strategy:
        autocast around each forward and the fp16 loss scaler (parallel/precision.py);
        each transformer block recomputed in backward (parallel/checkpointing.py)."""
        self.precision = Precision(tcfg.precision, self.device, tcfg.fp16_init_scale,
                                   tcfg.fp16_growth_interval, self.grid.world_size)
        if self.pipeline is not None:
            self.pipeline.precision = self.precision
        if tcfg.activation_checkpointing:
            checkpoint_blocks(self.gpt, self.tp.random if self.tp is not None else None)

    def configure_optimizer(self, tcfg):
        raise NotImplementedError

    def forward_backward(self, micro_batches) -> float:
        """Forward and backward over this rank's micro-batches; gradients end up
        as if one process had run the whole global batch. Returns the mean
        loss over the global batch, on every rank. Strategies shape it through
        `backward_scope` (around each micro-batch), `sync_gradients` and
        `self.model` (what forward runs through: the GPT, or a wrapper)."""
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
        self.module.eval()
        try:
            if self.pipeline is not None:
                loss = self.pipeline.eval_loss(x, y)
            else:
                with self.comm.uncounted():  # TP's collectives, fsdp's gathers: not training traffic
                    _, loss = self.forward_loss(self.module, x, y)
        finally:
            self.module.train()
        return self.dp_mean(loss)

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
        base = seed + self.grid.dp_rank
        if self.grid.pp_size > 1:
            base = derive_seed(base, "pipeline stage", self.grid.pp_rank)
        torch.manual_seed(base)
        if self.tp is not None:
            self.tp.reseed(base)

    def clip_grad_norm_(self, max_norm) -> float:
        """Scale gradients so their global norm is at most max_norm; return the norm before.
        Sharded elements are summed over the ranks holding them, replicated ones counted
        on one replica (Region.in_norm). fp16: gradients are unscaled first, and a step
        whose gradients overflowed anywhere is skipped by every rank (optimizer_step)."""
        self.precision.unscale_and_check(self.grads())
        sq = grad_norm_squared(self.regions(), self.device)
        group = self.norm_group()
        if group is not None:
            self.comm.all_reduce(sq, group=group)
        norm = sq.sqrt()
        if not self.precision.skip_step:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
            for g in self.grads():
                g.mul_(coef)
        return norm.item()

    def step_optimizer(self):
        """optimizer.step(), unless fp16 gradients overflowed on some rank this step
        (then every rank skips it; the gradients are dropped as usual)."""
        if not self.precision.skip_step:
            self.optimizer.step()

    def forward_loss(self, model, x, y):
        """One forward under the configured precision: (logits, loss)."""
        with self.precision.autocast():
            return model(x.to(self.device), y.to(self.device))

    def backward(self, loss, divide_by):
        """Backward of loss / divide_by, times the fp16 loss scale (if any)."""
        loss = loss / divide_by
        if self.precision.loss_scale != 1.0:
            loss = loss * self.precision.loss_scale
        loss.backward()

    def sharded_group(self, *dims):
        """The group over those of `dims` (dp, pp, tp) that have more than one rank,
        or None if none has."""
        sizes = {"dp": self.grid.dp_size, "pp": self.grid.pp_size, "tp": self.grid.tp_size}
        dims = [d for d in dims if sizes[d] > 1]
        return self.grid.group_over(*dims) if dims else None

    def pipeline_forward_backward(self, micro_batches):
        """Each of this rank's micro-batches (trainer.grad_accum of them) becomes one pass
        of the pipeline schedule over parallel.microbatches pieces; every piece's loss is
        divided by their total count. Returns the mean loss, from the last stage."""
        rounds, M = len(micro_batches), self.pipeline.M
        total = torch.zeros((), device=self.device)
        for r, (x, y) in enumerate(micro_batches):
            final = r == rounds - 1
            scale = 1.0 / (M * rounds)  # and the fp16 loss scale, if any
            if self.precision.loss_scale != 1.0:
                scale *= self.precision.loss_scale
            total += self.pipeline.run(list(zip(x.chunk(M), y.chunk(M))), scale,
                                       lambda c, last: self.backward_scope(c, last and final))
        return self.pipeline.last_stage_value(total / (M * rounds))

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
        flat = torch.cat(views)
        self.comm.all_reduce(flat, group=group)
        at = 0
        for v in views:
            v.copy_(flat[at:at + v.numel()])
            at += v.numel()

    def step_stats(self, last=False):
        """(figures for this step's metrics record, {file name: JSON-able} the main rank
        writes into the run directory): the pipeline's busy/idle time per stage, and
        on the last step its timeline. Collective."""
        if self.pipeline is None:
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
        """Take what this rank holds from a snapshot.SnapshotReader, whatever layout wrote it."""
        load_regions(self.regions(), self.optimizer, reader)

    @torch.no_grad()
    def state_dict(self) -> dict:
        """Canonical model parameters (CPU tensors, full shapes) on grid.is_main (empty
        elsewhere), assembled from what each rank writes to snapshots. Collective."""
        mine = [(key[len("model/"):], shape, box, t.cpu().clone())
                for key, shape, box, t in snapshot_pieces(self.regions(), self.optimizer,
                                                          with_optimizer=False)]
        everyone = [mine]
        if self.grid.world_size > 1:
            everyone = [None] * self.grid.world_size if self.grid.is_main else None
            dist.gather_object(mine, everyone, dst=0)
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

    def state_bytes(self) -> int:
        """Bytes of parameters + gradients + optimizer state resident on this rank,
        measured at the end of the last optimizer step (before grads are freed)."""
        return self.last_state_bytes

    def dp_mean(self, value: torch.Tensor) -> float:
        """Average a scalar over the data-parallel group (losses, for logging;
        deliberately not counted as training traffic)."""
        value = value.detach().clone()
        if self.grid.dp_size > 1:
            dist.all_reduce(value, group=self.grid.dp_group)
            value /= self.grid.dp_size
        return value.item()


# ---------------------------------------------------------------- canonical helpers

def check_state_names(expected: dict, state: dict, what: str):
    """Raise a UserError listing missing / unexpected / mis-shaped entries."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{n}: {tuple(state[n].shape)} vs {tuple(expected[n].shape)}"
              for n in sorted(set(expected) & set(state))
              if tuple(state[n].shape) != tuple(expected[n].shape)]
    if missing or unexpected or shapes:
        parts = [f"missing {missing[:4]}" if missing else "",
                 f"unexpected {unexpected[:4]}" if unexpected else "",
                 f"shape mismatch {shapes[:4]}" if shapes else ""]
        raise UserError(f"{what} does not fit this model: " + "; ".join(p for p in parts if p))


@torch.no_grad()
def load_named_parameters(module, state, what="snapshot model state"):
    """Copy a canonical state dict into a full (unsharded) GPT."""
    params = dict(module.named_parameters())
    check_state_names(params, state, what)
    for name, p in params.items():
        p.copy_(state[name])


def optimizer_state_from(reader):
    """{name: {field: tensor}} from a snapshot's "optim/<name>/<field>" keys (full tensors)."""
    state = {}
    for key in reader.keys():
        if key.startswith("optim/"):
            name, field = key[len("optim/"):].rsplit("/", 1)
            state.setdefault(name, {})[field] = reader.read_full(key)
    return state


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
