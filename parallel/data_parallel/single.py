"""`single`: one process, no communication. The reference every layout must reproduce."""

from parallel.data_parallel.replicated import ReplicatedStrategy
from parallel.grid import GRAD_DIMS


class Single(ReplicatedStrategy):
    """The whole global batch on one data-parallel rank (split into grad_accum micro-batches)."""

    name = "single"
    compiles_whole_model = True  # no communication, no hooks: the GPT's forward is all it runs

    @classmethod
    def refuse(cls, cfg, sizes):
        if sizes["dp"] != 1:
            return no_data_parallel_dimension(cfg.parallel.dp, sizes)
        others = [f"parallel.{d}={sizes[d]}" for d in GRAD_DIMS if d != "dp" and sizes[d] > 1]
        if others:
            return (f"parallel.dp={cfg.parallel.dp} averages no gradients, but with "
                    f"{', '.join(others)} ranks see other tokens of the same parameters: use a "
                    "data-parallel strategy (ddp_bucket, ddp_naive, fsdp)")
        return ""


def no_data_parallel_dimension(what, sizes):
    """The one message of every strategy that runs on one data-parallel rank only."""
    world = 1
    for n in sizes.values():
        world *= n
    others = " * ".join(f"{d} {n}" for d, n in sizes.items() if d != "dp")
    return (f"{what} has no data-parallel dimension, but world size {world} / ({others}) = "
            f"{sizes['dp']}: use torchrun --nproc_per_node={world // sizes['dp']} or a "
            "data-parallel strategy")
