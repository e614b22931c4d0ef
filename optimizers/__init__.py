"""The optimizers `trainer.optimizer` chooses (registry.py): each one file that builds it
from the parameter groups a data-parallel strategy hands over (parallel/data_parallel/
contract.py build_optimizer)."""
