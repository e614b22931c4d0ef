"""Which layouts can run: the grid's sizes from the world size, and every rule of the
parallel section, checked on every rank before any process group exists (so a
bad layout stops every rank with the same one line, and none waits in a collective).

The rules live with their code: each dimension's folder says what it needs
(`refuse` in tensor_parallel/apply.py, context_parallel/apply.py and
pipeline_parallel/schedules/),
and each strategy what it composes with (`Strategy.refuse`); this file only
asks them, in the order parallelize() applies the dimensions.
"""

import math

from errors import UserError
from parallel.compile import refuse as refuse_compile
from parallel.context_parallel.apply import IMPLEMENTATIONS as CP_IMPLEMENTATIONS
from parallel.context_parallel.apply import refuse as refuse_context
from parallel.data_parallel.hybrid import refuse as refuse_hybrid
from parallel.data_parallel.offload import refuse as refuse_offload
from parallel.grid import DATA_DIMS, DIMS
from parallel.parallelize import DATA_PARALLEL, IMPLEMENTATIONS, MOVED, strategy_class
from parallel.pipeline_parallel.schedules import SCHEDULES
from parallel.pipeline_parallel.schedules import refuse as refuse_pipeline
from parallel.tensor_parallel.apply import refuse as refuse_tensor

MODEL_DIMS = [d for d in reversed(DIMS) if d not in DATA_DIMS]  # each has its degree in parallel.<dim>


def grid_sizes(p, world_size) -> dict:
    """{dimension: degree} of the grid: the model-parallel degrees from the config, and
    the data-parallel degree from what is left of the world (computed here only), cut
    into parallel.dp_replicate replica groups of dp ranks each."""
    model = math.prod(getattr(p, d) for d in MODEL_DIMS)
    if world_size % model:
        names = " * ".join(f"parallel.{d}" for d in MODEL_DIMS)
        values = " * ".join(str(getattr(p, d)) for d in MODEL_DIMS)
        raise UserError(f"world size {world_size} is not divisible by {names} = {values}: the "
                        f"grid is {' x '.join(DIMS)}")
    data, replicas = world_size // model, p.dp_replicate
    if data % replicas:
        raise UserError(f"parallel.dp_replicate={replicas} does not divide the data-parallel degree "
                        f"{data} (world size {world_size} / (parallel.tp * parallel.cp * parallel.pp "
                        f"= {model})): hybrid sharding makes parallel.dp_replicate groups of equal "
                        "size")
    return {d: data // replicas if d == "dp" else replicas if d == "dp_replicate" else getattr(p, d)
            for d in DIMS}


def check_keys(p):
    """The parallel section's values on their own (every mode)."""
    if p.dp in MOVED:
        raise UserError(f"parallel.dp={p.dp} is now {MOVED[p.dp]}: PyTorch's reference "
                        "implementations are chosen per dimension")
    checks = [
        (p.dp in DATA_PARALLEL, f"parallel.dp={p.dp!r} is not one of {sorted(DATA_PARALLEL)}"),
        (p.tp_impl in IMPLEMENTATIONS and p.pp_impl in IMPLEMENTATIONS,
         f"parallel.tp_impl and parallel.pp_impl must be one of {IMPLEMENTATIONS}"),
        (p.cp_impl in CP_IMPLEMENTATIONS,
         f"parallel.cp_impl must be one of {sorted(CP_IMPLEMENTATIONS)}, got {p.cp_impl!r}"),
        (all(getattr(p, d) >= 1 for d in MODEL_DIMS + ["dp_replicate"]),
         "parallel." + ", parallel.".join(MODEL_DIMS + ["dp_replicate"]) + " must be >= 1"),
        (p.reduce_dtype in ("fp32", "bf16"),
         f"parallel.reduce_dtype must be fp32 or bf16, got {p.reduce_dtype!r}"),
        (0 < p.timeout_s < 10**7, "parallel.timeout_s must be > 0 and finite"),
        (p.pp_schedule in SCHEDULES,
         f"parallel.pp_schedule must be {', '.join(SCHEDULES)}, got {p.pp_schedule!r}"),
        (p.microbatches >= 1, f"parallel.microbatches must be >= 1, got {p.microbatches}"),
        (p.pp_virtual_stages >= 1, f"parallel.pp_virtual_stages must be >= 1, got {p.pp_virtual_stages}"),
        (p.allreduce in ("native", "ring"),
         f"parallel.allreduce must be native or ring, got {p.allreduce!r}"),
        (p.bucket_cap_mb > 0, f"parallel.bucket_cap_mb must be > 0, got {p.bucket_cap_mb}"),
        (p.zero_stage in (1, 2, 3), f"parallel.zero_stage must be 1, 2 or 3, got {p.zero_stage}"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def check_layout(cfg, world_size) -> dict:
    """Every rule for training on `world_size` ranks; returns the grid's sizes."""
    sizes = grid_sizes(cfg.parallel, world_size)
    strategy = strategy_class(cfg.parallel)
    for refuse in (refuse_tensor, refuse_context, refuse_pipeline,
                   lambda cfg, sizes: refuse_hybrid(cfg, sizes, strategy),
                   lambda cfg, sizes: refuse_offload(cfg, sizes, strategy), strategy.refuse,
                   lambda cfg, sizes: refuse_compile(cfg, sizes, strategy)):
        message = refuse(cfg, sizes)
        if message:
            raise UserError(message)
    t, p = cfg.trainer, cfg.parallel
    data = math.prod(sizes[d] for d in DATA_DIMS)
    per_rank = data * t.grad_accum * p.microbatches
    if t.batch_size % per_rank:
        raise UserError(
            f"trainer.batch_size={t.batch_size} (the global batch) must be divisible by "
            f"dp degree {data} x trainer.grad_accum {t.grad_accum} x parallel.microbatches "
            f"{p.microbatches} = {per_rank}")
    return sizes
