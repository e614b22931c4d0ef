"""What the training loop (trainer.py) is made of, beside the concerns that have a package
of their own (telemetry/, checkpoint/, fault_tolerance/, launch/).

    config.py   TrainerConfig, the `trainer:` section: a leaf (imports nothing)
    step.py     one step's computation (compute_step) and the LR schedule: the trainer's
                and mode=dryrun's
    batches.py  this rank's micro-batches of each step, read where a failure strands no rank
"""
