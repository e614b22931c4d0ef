"""`single`: one process, no communication. The reference every layout must reproduce."""

from parallel.data_parallel.replicated import ReplicatedStrategy


class Single(ReplicatedStrategy):
    """The whole global batch on one data-parallel rank (split into grad_accum micro-batches)."""

    name = "single"

    @classmethod
    def refuse(cls, cfg, sizes):
        if sizes["dp"] != 1:
            return no_data_parallel_dimension(cfg.parallel.dp, sizes)
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
