"""`single`: one process, no communication. The reference every layout must reproduce."""

from parallel.replicated import ReplicatedStrategy


class Single(ReplicatedStrategy):
    """The whole global batch on one rank (split into grad_accum micro-batches)."""
