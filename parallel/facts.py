"""The facts the layout rules of parallel/rules.py read, by name, each computed when a rule
first reads it (and filling its message's {fields})."""

import math

from parallel.grid import DIMS, GRAD_DIMS
from parallel.pipeline_parallel.schedules import SCHEDULES
from parallel.registry import (CP_IMPLEMENTATIONS, DATA_PARALLEL, EP_IMPLEMENTATIONS,
                               IMPLEMENTATIONS, MOVED,
                               STRATEGIES, TORCH_REFERENCES, strategy_name)

MODEL_DIMS = [d for d in reversed(DIMS) if d not in ("dp_replicate", "dp")]  # each its key
DEGREES = MODEL_DIMS + ["ep", "dp_replicate"]  # the degrees the config sets
BACKENDS = ("inductor", "aot_eager", "eager")  # trainer.compile_backend: inductor generates
# kernels; aot_eager: the same dynamo capture and AOT autograd without code generation (tests)


class Facts:
    """What the rules read, by name, each computed when a rule first reads it. sizes: the
    grid's {dimension: degree} (each also a fact: dp, tp, ...); world: the world size."""

    def __init__(self, cfg, sizes=None, world=None):
        self.cfg, self.sizes, self._world = cfg, sizes or {}, world

    def __getitem__(self, name):  # for format_map
        return getattr(self, name)

    def __getattr__(self, name):  # a dimension's degree
        if name in DIMS:
            return self.sizes[name]
        raise AttributeError(name)

    m = property(lambda self: self.cfg.model)
    d = property(lambda self: self.cfg.data)
    t = property(lambda self: self.cfg.trainer)
    p = property(lambda self: self.cfg.parallel)
    f = property(lambda self: self.cfg.ft)

    # the names a message lists
    moved = property(lambda self: MOVED.get(self.p.dp))
    data_parallel = sorted(DATA_PARALLEL)
    implementations = IMPLEMENTATIONS
    cp_implementations = sorted(CP_IMPLEMENTATIONS)
    ep_implementations = sorted(EP_IMPLEMENTATIONS)
    schedules = ", ".join(SCHEDULES)
    backends = ", ".join(BACKENDS)
    dims = " x ".join(DIMS)
    model_keys = " * ".join(f"parallel.{d}" for d in MODEL_DIMS)
    degree_keys = ", ".join(f"parallel.{d}" for d in DEGREES)

    # the grid
    world = property(lambda self: self._world or math.prod(self.sizes.values()))
    model = property(lambda self: math.prod(getattr(self.p, d) for d in MODEL_DIMS))  # tp x cp x pp
    model_values = property(lambda self: " * ".join(str(getattr(self.p, d)) for d in MODEL_DIMS))
    data = property(lambda self: self.world // self.model)  # data-parallel ranks: dp_replicate x dp
    world_per_dp = property(lambda self: self.world // self.dp)
    model_ranks = property(lambda self: " * ".join(f"{d} {n}" for d, n in self.sizes.items()
                                                    if d != "dp"))  # the world but dp
    per_rank = property(lambda self: self.data * self.t.grad_accum * self.p.microbatches)
    per_share = property(lambda self: self.f.replicas * self.data * self.t.grad_accum)  # ft

    # mixture of experts
    moe = property(lambda self: self.m.moe_experts > 0)
    ep = property(lambda self: self.p.ep)
    ep_ranks = property(lambda self: self.dp * self.cp)  # what ep is carved from

    def beside(self, dims):  # "parallel.cp=2, ..." of those of `dims` that are > 1
        return [f"parallel.{d}={self.sizes[d]}" for d in dims if self.sizes[d] > 1]

    grad_dims_beside_dp = property(lambda self: ", ".join(self.beside(
        [d for d in GRAD_DIMS if d != "dp"])))  # other ranks averaging the same parameters
    model_parallel = property(lambda self: " and ".join(self.beside(MODEL_DIMS)))

    # context and pipeline parallelism
    cp_chunks = property(lambda self: 2 * self.cp)
    cp_tokens = property(lambda self: self.d.block_size // self.cp)  # a cp rank's of a sequence
    schedule = property(lambda self: SCHEDULES.get(self.p.pp_schedule))  # None: not one (KEYS)
    fixed = property(lambda self: self.schedule and self.schedule.virtual)  # zbv: always 2 a rank
    chunks_per_rank = property(lambda self: self.fixed or self.p.pp_virtual_stages)
    chunks = property(lambda self: self.pp * self.chunks_per_rank)
    split_backward = property(lambda self: bool(self.schedule and self.schedule.split_backward))

    # the strategy
    strategy = property(lambda self: strategy_name(self.p))
    can = property(lambda self: STRATEGIES[self.strategy][1])  # its registry.CAPABILITIES
    dim = property(lambda self: next((d for d, s in TORCH_REFERENCES.items() if s == self.strategy),
                                     None))  # the dimension a reference measures
    what = property(lambda self: f"parallel.{self.dim}_impl=torch" if self.dim
                    else f"parallel.dp={self.p.dp}")  # the key=value that chose it
    dims_beside_reference = property(lambda self: ", ".join(self.beside(
        [d for d in self.sizes if d not in ("dp", self.dim)])))
