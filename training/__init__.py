"""What the loop (trainer.py) is made of beside the concerns with a package of their own:
config.py (TrainerConfig, a leaf), step.py (one step's computation, also mode=dryrun's; the
LR schedule), batches.py (each step's micro-batches, read where a failure strands no rank).
"""
