"""Our own ways of training across processes, one folder per dimension, composed on one grid.

    parallelize.py      parallelize(model, grid, cfg): tensor (and experts), context, pipeline,
                        then data parallelism; registry.py: strategies and references
    layout.py           which layouts can run (grid sizes; rules.py, facts.py: the rules)
    grid.py             the process grid: named dimensions, their groups, the gradient group
    model_plan.py       the only file that names the GPT's modules
    strategy.py         the interface the trainer talks to (Strategy, LocalModel)
    placement.py        where each canonical tensor lives on this rank (snapshots, norms)
    initial.py          the initial weights read by canonical box: the model is built on the
                        meta device and each rank materializes only what it holds
    comm.py             counted collectives; precision.py; checkpointing.py; config.py
    data_parallel/      single, ddp_naive, ddp_bucket (+ the ring), fsdp (ZeRO 1-3; hybrid
                        sharding across replica groups, CPU offload)
    tensor_parallel/    Megatron TP and sequence parallelism
    context_parallel/   every sequence split over ranks: zigzag chunks, ring attention
    expert_parallel/    mixture-of-experts blocks wired in: experts split over ep ranks, tokens
                        sent to them by all-to-all
    pipeline_parallel/  the pipeline executor and its schedules
    reference/          PyTorch's implementations, measured against ours

What may import what: the files at this folder's root import nothing from
its subfolders, except parallelize.py and layout.py, which wire them; a
dimension's folder imports the root's shared files and no other dimension
(reference/ wraps data_parallel/replicated.py). Nothing here imports the
trainer, main or config. parallel/README.md lists what a new dimension touches.

This file imports nothing, so importing one shared file (parallel.grid, ...) does
not load every dimension: callers write `from parallel.parallelize import parallelize`.
"""
