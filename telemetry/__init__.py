"""What a run reports about itself.

    metrics.py           metrics.jsonl, the console line, wandb; peak memory
    mfu.py               model FLOPs utilisation against a known GPU's peak
    activation_meter.py  bytes of activations saved for backward (trainer.measure_activations)

May import: nothing of the project (torch and the standard library only).
"""
