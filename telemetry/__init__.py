"""What a run reports about itself.

    metrics.py           metrics.jsonl, the console line, wandb; peak memory
    step_record.py       a step's record, from its sources; when a step writes one
    loss_watch.py        an inf or NaN loss, skipped steps, watched on the device, read with the record
    stragglers.py        which rank the others wait for, at logged steps
    compile_time.py      trainer.compile's fields in the record
    mfu.py               model FLOPs utilisation against a known GPU's peak
    expert_load.py       mixture of experts: balance and z-losses, tokens per expert
    activation_meter.py  bytes of activations saved for backward (trainer.measure_activations)
    profiling.py         torch.profiler and CUDA memory snapshots over chosen steps
    ranks.py             every rank's memory and replica digests, once at the end

May import: errors (nothing else of the project: the strategy and the other sources are
given).
"""
