"""`single`: one process, no communication. The reference every layout must reproduce."""

from parallel.data_parallel.replicated import ReplicatedStrategy


class Single(ReplicatedStrategy):
    """The whole global batch on one data-parallel rank (split into grad_accum micro-batches)."""

    name = "single"
