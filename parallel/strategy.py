"""`Strategy`: what parallelize() returns and the trainer talks to, the same for every layout.

The trainer never asks which strategy it runs. Per optimizer step it calls

    strategy.reseed(seed)                                # random state of this step
    loss = strategy.loss_and_gradients(micro_batches)   # grads ready and synced
    norm = strategy.clip_gradients(max_norm)             # global norm, across shards
    strategy.optimizer_step(lr)                          # update, then drop the grads

`loss` and `norm` stay on the device (0-d tensors): the trainer reads them only at the
steps it logs, so a step makes no host sync of its own on a GPU (`forward_backward` and
`clip_grad_norm_` return them as Python floats: tests, benchmarks). For evaluation and
snapshots: `eval_loss`, `shard_pieces` / `load_shards` (each rank writes and reads only
what it holds) and `state_dict`, all in *canonical* form, the names and full shapes of the
single-device model: a snapshot written under one layout resumes under another.

A Strategy is no base class: it holds the data-parallel strategy (`dp`, eight methods:
parallel/data_parallel/contract.py) and does for it, once, what every one needs: the
step's forward and backward (forward_backward.py), the gradient norm and the clip
(clipping.py), the optimizer's step, snapshots through its Regions (placement.py), statistics.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel import model_plan as plan
from parallel.clipping import clip_gradients
from parallel.comm import CommCounter
from parallel.finite import not_finite, step_unless
from parallel.forward_backward import ForwardBackward, reseed
from parallel.placement import load_regions, snapshot_pieces
from parallel.precision import Precision


@dataclass
class LocalModel:
    """What tensor, context and pipeline parallelism leave for the data-parallel strategy."""
    module: torch.nn.Module  # this rank's GPT: TP-local layers, only its pipeline chunks
    placements: dict         # canonical name -> Placement, for every parameter it holds
    comm: CommCounter        # every training collective goes through it, so it is counted
    tp: object = None        # the TPContext (parallel/tensor_parallel/apply.py), if tp > 1
    pipeline: object = None  # the Pipeline (parallel/pipeline_parallel/pipeline.py), if pp > 1
    split: object = None     # (x, y) -> what this rank keeps of a micro-batch (cp > 1: its
                             # chunks of every sequence); None: all of it
    init: object = None      # the initial weights, read by canonical box (parallel/initial.py):
                             # the module is on the meta device until the strategy fills it
    precision: Precision = None  # trainer.precision, shared by everything that runs a forward


def hold(strategy, local, grid, cfg):
    """The parts of `local` a data-parallel strategy reads, as its attributes."""
    strategy.grid, strategy.cfg, strategy.device = grid, cfg, grid.device
    strategy.comm, strategy.placements = local.comm, local.placements
    strategy.precision, strategy.tp, strategy.pipeline = local.precision, local.tp, local.pipeline
    strategy.module = strategy.model = local.module  # on the meta device until allocated


class Strategy:
    """One per rank: the data-parallel strategy `dp` and what every strategy is given. It
    keeps no copy of the strategy's parts (grid, device, module, comm, precision, tp,
    pipeline, optimizer, ...): reading or setting one reaches `dp`'s."""

    def __init__(self, local: LocalModel, grid, cfg, dp=None):
        """cfg: the `parallel:` section; dp: the data-parallel strategy holding `local`."""
        self.dp, self.applied = dp, None  # applied: the trainer config parallelize() applied
        if dp is None:  # Strategy.__init__ standing in for a strategy's (tests/test_gpu_paths.py)
            hold(self, local, grid, cfg)
        self.steps = ForwardBackward(dp, local.split, local.precision)
        self.last_state_bytes = self.last_host_state_bytes = 0  # at the last optimizer step
        self.balancer = None  # model.moe_bias_rate > 0: expert_parallel/balance.py
        self.not_finite = None  # clip_gradients: this step's gradients hold an inf or NaN
        self.skips_not_finite = True  # mode=dryrun: its fake reductions' norm means nothing
        for call in getattr(dp, "replaces", ()):  # a reference's own, PyTorch's way
            setattr(self, call, getattr(dp, call))

    def __getattr__(self, name):
        if "dp" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["dp"], name)

    def __setattr__(self, name, value):
        dp = self.__dict__.get("dp")
        if dp is not None and not hasattr(type(self), name) and name not in self.__dict__ \
                and hasattr(dp, name):
            setattr(dp, name, value)  # e.g. a test's spy on ddp_bucket's start_all_reduce
        else:
            object.__setattr__(self, name, value)

    # ------------------------------------------------ once, before training

    def configure_compute(self, tcfg):
        """parallelize()'s steps 4-6 (compilation, recompute, precision) for a strategy it
        built from the `parallel:` section alone (tests, the dry run); none when it
        applied them itself."""
        if tcfg != self.applied:
            from parallel.parallelize import prepare_compute  # parallelize imports this module
            prepare_compute(self.module, self.tp, self.precision, tcfg)

    def configure_optimizer(self, tcfg):
        """The optimizer, unless parallelize() built it from this trainer config."""
        if tcfg != self.applied or self.optimizer is None:
            self.dp.build_optimizer(tcfg)

    # ------------------------------------------------ one step

    def reseed(self, seed):
        reseed(self.grid, self.tp, seed)

    def loss_and_gradients(self, micro_batches) -> torch.Tensor:
        return self.steps.loss_and_gradients(micro_batches)

    def forward_backward(self, micro_batches) -> float:
        """loss_and_gradients, the loss read as a Python float."""
        return self.loss_and_gradients(micro_batches).item()

    def grads(self) -> list:
        """The gradients of everything the optimizer updates, each once."""
        return [p.grad for g in self.optimizer.param_groups for p in g["params"]
                if p.grad is not None]

    def clip_gradients(self, max_norm) -> torch.Tensor:
        """The global pre-clip norm; the step's gradients clipped to max_norm. fp32 and
        bf16: a norm that is not finite marks the step to be skipped (finite.py)."""
        self.comm.at(phase="gradient norm")
        norm = clip_gradients(self.dp, self.precision, self.grads(), max_norm)
        self.not_finite = None if self.precision.scaler or not self.skips_not_finite \
            else not_finite(norm)
        return norm

    def clip_grad_norm_(self, max_norm) -> float:
        """clip_gradients, the norm read as a Python float."""
        return self.clip_gradients(max_norm).item()

    def optimizer_step(self, lr):
        """The optimizer's step at learning rate lr (skipped after an fp16 overflow anywhere), then
        the gradients dropped."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.comm.at(phase="optimizer step")
        self.dp.update(self.step_optimizer)
        self.last_state_bytes, self.last_host_state_bytes = self.dp.drop_gradients()

    def step_optimizer(self):
        """optimizer.step(), unless fp16 gradients overflowed on some rank this step (then
        every rank skips it; the gradients are dropped as usual)."""
        found, self.not_finite = self.not_finite, None
        if self.precision.skip_step:  # fp16: an overflow somewhere (host-decided)
            return
        if found is None:  # no norm computed this step (tests that do not clip)
            self.optimizer.step()
        else:
            step_unless(self.optimizer, found)  # skipped if the gradients are not finite
        if self.balancer is not None:  # the experts' choice biases, after a real step
            self.balancer.step(found)

    def drop_step(self, lr):
        """End a step without updating anything (fault tolerance: the groups did not
        commit it): the optimizer skips it as after an fp16 overflow, and the gradients are
        dropped as after any step."""
        self.precision.skip_step = True
        self.optimizer_step(lr)

    # ------------------------------------------------ evaluation and snapshots

    def eval_loss(self, x, y) -> float:
        return self.steps.eval_loss(x, y)

    def shard_pieces(self) -> list:
        """What this rank writes into a sharded snapshot: [(canonical key, full shape,
        box, tensor)], keys "model/<name>" and "optim/<name>/<state>". Across ranks
        every element of every key is covered exactly once."""
        return snapshot_pieces(self.dp.regions(), self.optimizer)

    def load_shards(self, reader):
        """Take what this rank holds from a snapshot_reader.SnapshotReader, whatever layout
        wrote it (what the strategy does after, e.g. fsdp's gathers: not training traffic)."""
        with self.comm.uncounted():
            self.dp.update(lambda: load_regions(self.dp.regions(), self.optimizer, reader))

    @torch.no_grad()
    def state_dict(self) -> dict:
        """Canonical model parameters (CPU tensors, full shapes) on grid.is_main (empty
        elsewhere), assembled from what each rank writes to snapshots. Collective."""
        mine = [(key[len("model/"):], shape, box, t.cpu().clone())
                for key, shape, box, t in snapshot_pieces(self.dp.regions(), self.optimizer,
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

    # ------------------------------------------------ statistics

    def comm_stats(self) -> dict:
        """Collective calls/bytes since the last call (see parallel/comm.py)."""
        return self.comm.pop()

    def step_stats(self, last=False, measure=True):
        """(figures for this step's metrics record, {file name: JSON-able} the main rank
        writes into the run directory): the pipeline's (Pipeline.stats). Collective when
        measure; measure=False drops the step's record without reading the device."""
        return self.pipeline.stats(last, measure) if self.pipeline is not None else ({}, {})

    def expert_layers(self) -> list:
        """[(canonical block index, MoE layer)] of the mixture-of-experts blocks this rank
        holds (their statistics: telemetry/expert_load.py)."""
        return plan.moe_layers(self.module)

    def state_figures(self) -> dict:
        """{"state_bytes": bytes of parameters + gradients + optimizer state on the device,
        "host_state_bytes": of them in host memory (parallel.offload; only where some are)}
        at the end of the last optimizer step (before its gradients are dropped), each the
        max over every rank (the trainer logs rank 0's: it should be the fullest rank's).
        Collective: host integers over the host group, nothing read from the device."""
        device, host = (int(v) for v in self.grid.max_over_ranks(
            [self.last_state_bytes, self.last_host_state_bytes]))
        return {"state_bytes": device, **({"host_state_bytes": host} if host else {})}
