"""Every layout the product can run on a world size, as planner Layouts.

A layout is a factorisation world = dp x pp x cp x tp (parallel/grid.py's dimensions)
times the data-parallel strategy (`single` when nothing averages gradients, else
`ddp_bucket` or `fsdp` stage 1, 2 or 3), sequence parallelism, the pipeline schedule
(gpipe, 1f1b, interleaved with 2, 3 or 4 chunks per rank, zb1p, zbv) and micro-batches (P, 2P,
4P, 8P), and for a model with experts the expert-parallel
degree (parallel.ep: each divisor of model.moe_experts that divides dp x cp). Whether one can run is not decided here: each
candidate goes through parallel/layout.check_layout, the rules every training run
checks (heads divisible by tp, stages no more than layers, ZeRO-3 refused with
pipelines, ...), so the planner offers exactly what `torchrun main.py` would accept.
"""

import dataclasses

from errors import UserError
from parallel.layout import check_layout
from planner.shapes import Layout

# the schedules and their chunks a rank (parallel.pp_virtual_stages): interleaved's virtual
# stages are a choice (2, 3 or 4: fewer bubbles, more sends), as Megatron's runs chose them
SCHEDULE_CHOICES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3),
                    ("interleaved", 4), ("zb1p", 1), ("zbv", 2))
# trainer.activation_checkpointing_mode and _every of the recompute variants the search tries
# (planner/report.py's with_recompute: where a layout needs them)
RECOMPUTE_CHOICES = (("full", 1), ("selective", 1), ("full", 2), ("selective", 2))


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def run_config(cfg, L: Layout):
    """The run config `cfg` with layout L's keys (the rest of the parallel section at its
    defaults that the predictions assume: fp32 reduction, the native all-reduce)."""
    p = dataclasses.replace(
        cfg.parallel, dp=L.dp_kind, tp=L.tp, pp=L.pp, cp=L.cp, sequence_parallel=L.sp,
        dp_replicate=L.R, offload=L.offload, ep=L.ep, ep_impl="alltoall",
        zero_stage=L.zero_stage or 3, pp_schedule=L.schedule if L.pp > 1 else "1f1b",
        microbatches=L.M, pp_virtual_stages=L.V if L.schedule == "interleaved" else 1,
        pp_layers=[], tp_impl="own", pp_impl="own", cp_impl="ring", allreduce="native",
        reduce_dtype="fp32", reshard_after_forward=True, prefetch=True)
    t = dataclasses.replace(cfg.trainer, grad_accum=L.grad_accum, activation_checkpointing=L.ckpt,
                            activation_checkpointing_mode=L.ckpt_mode,
                            activation_checkpointing_every=L.ckpt_every, compile=False)
    return dataclasses.replace(cfg, parallel=p, trainer=t)


def refusal(cfg, L: Layout, world: int) -> str:
    """parallel/layout.py's one-line reason L cannot run on `world` ranks, or ""."""
    try:
        check_layout(run_config(cfg, L), world)
    except UserError as e:
        return str(e)
    return ""


def candidates(world, n_layer, experts=0):
    """Every combination of the dimensions' choices (before the rules). With experts
    (model.moe_experts = E > 0) also expert parallelism: each ep > 1 dividing both E and
    the dp x cp ranks it is carved from, under ddp_bucket or fsdp."""
    for tp in divisors(world):
        for cp in divisors(world // tp):
            for pp in divisors(world // (tp * cp)):
                if pp > n_layer:
                    continue
                dp = world // (tp * cp * pp)
                strategies = [("single", 0)] if dp * cp == 1 else \
                    [("ddp_bucket", 0), ("fsdp", 1), ("fsdp", 2), ("fsdp", 3)]
                eps = [e for e in divisors(dp * cp) if experts % e == 0] if experts else [1]
                pipes = [(s, v, m * pp) for s, v in SCHEDULE_CHOICES for m in (1, 2, 4, 8)] \
                    if pp > 1 else [("1f1b", 1, 1)]
                for sp in ((False, True) if tp > 1 else (False,)):
                    for kind, stage in strategies:
                        for ep in eps:
                            for schedule, V, M in pipes:
                                yield Layout(kind, stage, dp, pp, cp, tp, sp, schedule, V, M, 1,
                                             False, ep=ep)


def valid_layouts(cfg, world):
    """[(Layout, refusal or "")] for every candidate; the rules' reasons kept for the count."""
    return [(L, refusal(cfg, L, world))
            for L in candidates(world, cfg.model.n_layer, cfg.model.moe_experts)]


def with_grad_accum(L: Layout, ga: int) -> Layout:
    return dataclasses.replace(L, grad_accum=ga)
