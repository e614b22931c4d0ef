"""A strategy, its model and its gradient buffers are freed once their owner drops them.

A process may run more than one job: a notebook, tests/job_server.py (hundreds). A
gradient hook that holds its strategy from a parameter's C++ autograd metadata closes a
cycle Python's gc cannot see (parallel/data_parallel/grad_hooks.py): everything the
strategy holds would outlive the job, its process groups included, and each gloo
group's thread wakes every 10 ms for the rest of the process. In process, one rank.
"""

import gc
import weakref

import pytest
import torch

from model import GPT, GPTConfig
from parallel.config import ParallelConfig
from parallel.parallelize import parallelize
from training.config import TrainerConfig

STRATEGIES = {
    "single": {"dp": "single"},
    "ddp_naive": {"dp": "ddp_naive"},
    "ddp_bucket": {"dp": "ddp_bucket"},
    "fsdp1": {"dp": "fsdp", "zero_stage": 1},
    "fsdp2": {"dp": "fsdp", "zero_stage": 2},
    "fsdp3": {"dp": "fsdp", "zero_stage": 3},
    "fsdp3-offload": {"dp": "fsdp", "zero_stage": 3, "offload": True},
}


def trained_then_dropped(grid, parallel):
    """Weak references to a strategy, its model and a parameter after one training step
    (every hook has fired: gradients, buckets or units, the optimizer's state), with no
    strong reference left."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=11, block_size=8))
    strategy = parallelize(model, grid, ParallelConfig(**parallel))
    strategy.configure_optimizer(TrainerConfig())
    x = torch.randint(11, (4, 8))
    strategy.forward_backward([(x, x.roll(1, dims=1))])
    strategy.clip_grad_norm_(1.0)
    strategy.optimizer_step(1e-3)
    return [weakref.ref(o) for o in (strategy, model, next(model.parameters()))]


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_trained_strategy_is_freed_with_its_model(one_rank_grid, name):
    refs = trained_then_dropped(one_rank_grid, STRATEGIES[name])
    gc.collect()
    alive = [type(r()).__name__ for r in refs if r() is not None]
    assert not alive, f"{name}: still alive after gc: {alive} (a hook holding its strategy?)"
