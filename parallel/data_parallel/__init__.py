"""The data-parallel dimension (`parallel.dp`): strategies that hold this rank's share of
the model (after tensor, context and pipeline parallelism) and average gradients over
grid.grad_group, each implementing the eight methods of contract.py.

    contract.py    DataParallel: the contract, in the order a step calls it; build_optimizer
    replicated.py  its replicas' half: one Region per parameter, AdamW over them
    single.py      one data-parallel rank: the parity reference
    naive.py       ddp_naive: one all-reduce per parameter after backward
    bucket.py      ddp_bucket: flat buckets, all-reduced from gradient hooks during backward
    ring.py        our ring all-reduce over point-to-point sends (parallel.allreduce=ring)
    fsdp.py        ZeRO stages 1-3 (parallel.zero_stage) over flat units
    fsdp_units.py  the flat, padded, sharded buffers fsdp gathers, frees and reduce-scatters
    hybrid.py      HSDP (parallel.dp_replicate): the gradient shards' mean across replica groups
    offload.py     parallel.offload: a unit's shard of master weights and gradient in host memory
    grad_hooks.py  gradient hooks that hold their strategy weakly (else it is never freed)

May import: parallel/'s root files (strategy, placement, comm, grid, model_plan, initial) and
errors.
"""
