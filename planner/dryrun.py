"""mode=dryrun: one training step of a planned layout, tried at full size in this process.

    python main.py mode=dryrun plan.nodes=N plan.gpus_per_node=G <the layout's keys> plan.out=FILE

A layout that crashes at step 1 should not be found on the cluster. For a world of
N x G ranks, a few of them (the first and the last rank, and the first rank of each
pipeline stage) run one after the other in this process, each under PyTorch's fake
process-group backend (collectives return at once and move no data), on the code a
real rank runs: main.py's wiring (the grid, the GPT on the meta device, parallelize
with the initial weights), then the trainer's step (training/step.compute_step: forward
and backward under the activation meter, the clip, AdamW) on windows of random tokens of
the real shape. Each rank's tensors are real (on the CPU) where the planner says they
fit in half of this machine's memory; otherwise they stay on the meta device (shapes,
no memory, no arithmetic), where the same code runs and the meter counts them by size
(fp32 without offload: the meta device has no autocast and no host copies).

Per rank it writes the measured state bytes (parameters, gradients, AdamW state:
Strategy.state_figures) and activation peak (telemetry/activation_meter.py) beside the
planner's predictions for that rank (planner/memory.py). A rank whose step fails stops
the run: a UserError naming the rank and the error (main.py: one line, exit status 2).

The values computed are meaningless (what a collective should have brought never
arrives); the shapes, the memory and the code path are the real ones.
"""

import dataclasses
import json
import math
import os
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from errors import UserError
from parallel.grid import DIMS, SHARD_DIMS
from parallel.layout import check_layout, grid_sizes
from planner.memory import activation_bytes, memory_need, state_split
from planner.report import workload
from planner.shapes import Layout

GB, MB = 1e9, 1e6


def layout_of(cfg, world) -> Layout:
    """The planner's Layout for the config's parallel keys on `world` ranks."""
    p, sizes = cfg.parallel, grid_sizes(cfg.parallel, world)
    dp = sizes["dp"] * sizes["dp_replicate"]
    kind = p.dp if dp * sizes["cp"] > 1 else "single"
    pipelined = sizes["pp"] > 1
    V = {"zbv": 2, "interleaved": p.pp_virtual_stages}.get(p.pp_schedule, 1)
    return Layout(dp_kind=kind, zero_stage=p.zero_stage if kind == "fsdp" else 0, dp=dp,
                  pp=sizes["pp"], cp=sizes["cp"], tp=sizes["tp"], sp=p.sequence_parallel,
                  schedule=p.pp_schedule if pipelined else "1f1b", V=V if pipelined else 1,
                  M=p.microbatches if pipelined else 1, grad_accum=cfg.trainer.grad_accum,
                  ckpt=cfg.trainer.activation_checkpointing, R=sizes["dp_replicate"],
                  ckpt_mode=cfg.trainer.activation_checkpointing_mode,
                  ckpt_every=cfg.trainer.activation_checkpointing_every,
                  offload=p.offload, ep=p.ep)


def ranks_to_try(sizes) -> list:
    """The first rank, the first rank of each pipeline stage, and the last rank."""
    grid = torch.arange(math.prod(sizes.values())).view(*(sizes[d] for d in DIMS))
    first_of_stage = grid.select(0, 0).select(0, 0)  # dp_replicate 0, dp 0: (pp, cp, tp)
    stages = (int(first_of_stage[s, 0, 0]) for s in range(sizes["pp"]))
    return sorted({0, grid.numel() - 1, *stages})


def coords_of(sizes, rank) -> dict:
    out = {}
    for d in reversed(DIMS):
        rank, out[d] = divmod(rank, sizes[d])
    return out


class RandomWindows:
    """A dataset of token windows of the real shape, drawn at random (no corpus is read):
    what the sampler (data/sampling.py) asks of a train split."""

    def __init__(self, vocab, block_size, n=1 << 24):
        self.vocab, self.block_size, self.n = vocab, block_size, n

    def __len__(self):
        return self.n

    def batch(self, starts):
        gen = torch.Generator().manual_seed(int(starts[0]))
        windows = torch.randint(self.vocab, (len(starts), self.block_size + 1), generator=gen)
        return windows[:, :-1], windows[:, 1:]


class ShapesOnly:
    """Initial weights on the meta device (parallel/initial.py's reader interface): a rank
    whose tensors do not fit loads shapes, not values."""

    def __init__(self, model):
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}

    def read_full(self, key):
        return torch.empty(self.shapes[key[len("model/"):]], device="meta")

    def read_box(self, key, box):
        return self.read_full(key)[tuple(slice(a, b) for a, b in box)]


# What the CPU's autocast casts (aten/src/ATen/autocast_mode.cpp, its lists for the CPU),
# of the functions this product's forward calls: products to the low precision, the loss
# to fp32. Everything else runs in its inputs' dtype (the residual adds promote to fp32).
LOW_PRECISION = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
                 torch.Tensor.matmul, torch.Tensor.__matmul__}
FP32 = {F.cross_entropy, F.nll_loss}


class MetaAutocast(torch.overrides.TorchFunctionMode):
    """torch.autocast for meta tensors, which have no autocast dispatch key: while the CPU's
    autocast is on (the meta device's is mapped to it: meta_kernels), a product's floating
    inputs are cast to its dtype and the loss's to fp32 before the call, as autocast
    does, so autograd saves the same copies (the weights' too) a CPU rank saves."""

    def __init__(self, enabled, dtype_of):
        super().__init__()
        # torch.is_autocast_enabled and get_autocast_dtype, as they were before meta_kernels
        self.enabled, self.dtype_of = enabled, dtype_of

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in LOW_PRECISION or func in FP32) and self.enabled("cpu"):
            dtype = self.dtype_of("cpu") if func in LOW_PRECISION else torch.float32
            args, kwargs = cast_floats((args, kwargs), dtype)
        return func(*args, **kwargs)


def cast_floats(tree, dtype):
    """tree with its floating-point tensors in dtype (lists, tuples and dicts walked)."""
    if torch.is_tensor(tree):
        return tree.to(dtype) if tree.is_floating_point() and tree.dtype != dtype else tree
    if isinstance(tree, (list, tuple)):
        return type(tree)(cast_floats(t, dtype) for t in tree)
    if isinstance(tree, dict):
        return {k: cast_floats(v, dtype) for k, v in tree.items()}
    return tree


@contextmanager
def meta_kernels():
    """What the meta device lacks, for a shapes-only rank: attention saves what the CPU's
    flash kernel saves (q, k, v, out and the log-sum-exp: meta would take the math
    path, which keeps the score matrices), and an `autocast` of the meta device (the
    ring attention switches it off around its blocks), and whether it is on, the CPU's,
    which MetaAutocast reads to cast as the CPU's autocast would."""
    sdpa, autocast = F.scaled_dot_product_attention, torch.autocast
    enabled = torch.is_autocast_enabled

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        if q.device.type == "meta" and attn_mask is None and not kw:
            if enabled("cpu"):  # a product: autocast's low precision (SDPA is on its list)
                q, k, v = cast_floats((q, k, v), dtype_of("cpu"))
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal)[0]
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    def meta_autocast(device_type, *args, **kw):
        return autocast("cpu" if device_type == "meta" else device_type, *args, **kw)

    def on_cpu(function):  # the CPU's autocast state asked for the meta device
        def asked(*args):
            device = args[0] if args else None
            return function(*(("cpu",) if device == "meta" or getattr(device, "type", "") == "meta"
                              else args))
        return asked

    dtype_of = torch.get_autocast_dtype
    F.scaled_dot_product_attention, torch.autocast = attention, meta_autocast
    torch.is_autocast_enabled, torch.get_autocast_dtype = on_cpu(enabled), on_cpu(dtype_of)
    try:
        with MetaAutocast(enabled, dtype_of):
            yield
    finally:
        F.scaled_dot_product_attention, torch.autocast = sdpa, autocast
        torch.is_autocast_enabled, torch.get_autocast_dtype = enabled, dtype_of


@contextmanager
def even_split(strategy):
    """Expert parallelism's all-to-all first trades the choices per expert, from which each
    rank sizes what it receives (parallel/expert_parallel/dispatch.py); the fake backend
    brings none (uninitialized memory). In their place: the even split of this rank's
    N x k choices over its ep group's experts, so that it receives N x k rows, what the
    planner counts (planner/memory.py, traffic.py)."""
    comm, real = strategy.comm, strategy.comm.all_to_all

    def all_to_all(output, input, *args, **kw):
        done = real(output, input, *args, **kw)
        if kw.get("kind") == "all_to_all_counts":
            total, n = int(input.sum()), output.numel()
            output.copy_(torch.tensor([total // n + (i < total % n) for i in range(n)],
                                      device=output.device))
        return done
    comm.all_to_all = all_to_all
    try:
        yield
    finally:
        del comm.all_to_all


@contextmanager
def step_taken(precision, device):
    """fp16: the loss scaler would skip the step, the fake reductions' gradients holding
    infs (and a meta rank's flag cannot be read), and AdamW would hold no state: the dry
    run takes its first step as a run without an overflow does. A CPU rank still unscales."""
    real = precision.unscale_and_check

    def unscale_and_check(grads):
        if device.type != "meta":
            real(grads)
        precision.skip_step = False
    precision.unscale_and_check = unscale_and_check
    try:
        yield
    finally:
        del precision.unscale_and_check


def host_memory_bytes():
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def dryrun(cfg, device=None):
    """mode=dryrun: try the layout of cfg.parallel on plan.nodes x plan.gpus_per_node ranks.
    device: "cpu" or "meta" for every rank tried; None: per rank, real tensors (CPU)
    where the planner's need for it fits in half of this machine's memory."""
    world = cfg.plan.nodes * cfg.plan.gpus_per_node
    if cfg.plan.nodes < 1 or cfg.plan.gpus_per_node < 1:
        raise UserError(f"plan.nodes={cfg.plan.nodes} and plan.gpus_per_node="
                        f"{cfg.plan.gpus_per_node} must be >= 1")
    p = cfg.plan
    if p.kv_heads or p.ffn_hidden or p.gated_ffn or p.untied_head:
        raise UserError("dryrun: plan.kv_heads, ffn_hidden, gated_ffn and untied_head describe "
                        "another system's block, which model.py does not build: mode=plan only")
    sizes = check_layout(cfg, world)  # the rules a run on that world checks, and its grid
    if cfg.parallel.ep > 1 and cfg.parallel.ep_impl != "alltoall":
        raise UserError(f"dryrun: parallel.ep_impl={cfg.parallel.ep_impl} routes by choices the "
                        "fake backend does not bring: try parallel.ep_impl=alltoall")
    w, L = workload(cfg), layout_of(cfg, world)
    print(f"dryrun: {L.name()} on {cfg.plan.nodes} x {cfg.plan.gpus_per_node} ranks; GPT "
          f"{w.n_layer} layers x {w.n_embd} wide, vocab {w.vocab}, {w.block} tokens, global "
          f"batch {w.batch}, {w.precision}", flush=True)
    print(f"{'rank':>5}  {'pp':>3}  {'device':>6}  {'state MB':>9}  {'planned':>9}  "
          f"{'activ. MB':>9}  {'planned':>9}  {'s':>6}", flush=True)
    results = []
    try:
        for rank in ranks_to_try(sizes):
            results.append(try_rank(cfg, w, L, sizes, rank, device))
            r = results[-1]
            print(f"{rank:>5}  {r['pp_rank']:>3}  {r['device']:>6}  {r['state_bytes'] / MB:>9.4g}  "
                  f"{r['plan_state_bytes'] / MB:>9.4g}  {r['activation_bytes'] / MB:>9.4g}  "
                  f"{r['plan_activation_bytes'] / MB:>9.4g}  {r['seconds']:>6.1f}", flush=True)
    finally:
        if cfg.plan.out:
            with open(cfg.plan.out, "w") as f:
                json.dump(results, f, indent=1)
    if cfg.plan.out:
        print(f"{len(results)} ranks written to {cfg.plan.out}", flush=True)
    return results


def try_rank(cfg, w, L, sizes, rank, device=None) -> dict:
    """One rank's first step under the fake backend: its measured and planned bytes."""
    at = coords_of(sizes, rank)
    p = at["pp"]
    r = 0  # its place in the shard group, as grid.shard_rank counts it
    for d in SHARD_DIMS:
        r = r * sizes[d] + at[d]
    plan_state = state_split(w, L, p, r)[0]
    plan_act = activation_bytes(w, L, p)
    if device is None:
        need = memory_need(w, L, {"state_bytes": plan_state, "activation_bytes": plan_act,
                                  "pp_rank": p})
        device = "cpu" if need <= host_memory_bytes() / 2 else "meta"
    if device == "meta" and (L.offload or w.experts):
        why = "no host copies of it (parallel.offload)" if L.offload else \
            "no values to route tokens by (model.moe_experts)"
        raise UserError(f"dryrun: rank {rank} does not fit in half of this machine's "
                        f"{host_memory_bytes() / GB:.3g} GB, and the meta device it would run on "
                        f"has {why}: such a layout is tried only where its ranks fit")
    started, world = time.perf_counter(), math.prod(sizes.values())
    try:
        state, act = one_step(cfg, rank, world, w.vocab, torch.device(device))
    except UserError as e:
        raise UserError(f"dryrun: rank {rank} (pp {p}) of {world}: {e}") from e
    except Exception as e:  # the step crashed: what the cluster would have shown at step 1
        raise UserError(f"dryrun: rank {rank} (pp {p}) of {world} failed at step 1: "
                        f"{type(e).__name__}: {e}") from e
    return {"rank": rank, "pp_rank": p, "shard_rank": r, "device": device,
            "state_bytes": state, "plan_state_bytes": plan_state,
            "activation_bytes": act, "plan_activation_bytes": plan_act,
            "seconds": time.perf_counter() - started}


def one_step(cfg, rank, world, vocab, device):
    """(state bytes, activation peak) of `rank` after one trainer step, as main.train
    builds it, under the fake backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    from char_dataset import GlobalBatches
    from fault_tolerance.one_group import OneGroup
    from model import GPT, GPTConfig, shapes_only
    from parallel.grid import ProcessGrid
    from parallel.initial import InitialWeights
    from parallel.parallelize import parallelize
    from telemetry.activation_meter import ActivationMeter
    from training import step

    capable = dist.Backend.backend_capability["fake"]
    if device.type not in capable:  # meta tensors' sends and receives: the fake group too
        dist.Backend.backend_capability["fake"] = capable + [device.type]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        t = dataclasses.replace(cfg.trainer, measure_activations=True, compile=False,
                                snapshot_async=False, profile_from=0, memory_snapshot=False,
                                max_steps=1)
        grid = ProcessGrid(grid_sizes(cfg.parallel, world), device, cfg.parallel.timeout_s,
                           cfg.parallel.ep)
        gpt_config = GPTConfig(**{k: v for k, v in dataclasses.asdict(cfg.model).items()
                                  if k != "init_from"},
                               vocab_size=vocab, block_size=cfg.data.block_size)
        with shapes_only():  # as main.train: each rank materializes its share
            model = GPT(gpt_config)
        init = ShapesOnly(model) if device.type == "meta" else InitialWeights(model, t.seed)
        strategy = parallelize(model, grid, cfg.parallel, init)
        strategy.configure_compute(t)  # as the trainer prepares it
        strategy.configure_optimizer(t)
        data = RandomWindows(vocab, cfg.data.block_size)
        micro = GlobalBatches(len(data), t.batch_size, t.seed, cfg.data.sampler) \
            .local_micro_batches(data, 0, grid.data_rank, grid.data_size, t.grad_accum)
        meter = ActivationMeter(meta=device.type == "meta")
        # the fake backend's reductions bring uninitialized memory: the gradients' norm may be
        # an inf or a NaN (on the meta device, unreadable); the dry run takes the step anyway
        strategy.skips_not_finite = False
        with meta_kernels() if device.type == "meta" else nullcontext(), even_split(strategy), \
                step_taken(strategy.precision, device):
            step.compute_step(strategy, micro, 0, t, OneGroup(), meter)
        return strategy.state_figures()["state_bytes"], meter.peak_bytes
    finally:
        dist.destroy_process_group()
        dist.Backend.backend_capability["fake"] = capable
