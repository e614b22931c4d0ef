"""Test-only: a NaN in one rank's gradient at one step, inside tests/layout_worker.py's
2-rank launch (`compute()` there calls `compute()` here).

For each layout (ddp_bucket, fsdp ZeRO-3, tp 2, pp 2 with 1F1B), two runs of STEPS steps
from the same weights on the same batches:
- `injected`: at step BAD, rank 1 multiplies one of its parameters' gradient by NaN during
  backward (before any gradient sync), then the step goes on as the trainer's does
  (clip_gradients, optimizer_step);
- `by_hand`: at step BAD the update is skipped by hand (Strategy.drop_step), as a user
  would skip a batch.
Reported: whether every rank saw the step's norm as not finite, and whether the final
canonical state (weights and AdamW's moments and step counts) of the two runs is equal
bitwise on every rank.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from layout_worker import global_batch, gpt_config  # noqa: E402
from model import GPT  # noqa: E402
from parallel.config import ParallelConfig  # noqa: E402
from parallel.grid import ProcessGrid  # noqa: E402
from parallel.parallelize import parallelize  # noqa: E402
from training.config import TrainerConfig  # noqa: E402

STEPS, BAD, VOCAB = 4, 2, 64
TRAINER = TrainerConfig(lr=3e-3, weight_decay=0.1)
LAYOUTS = {  # name: (grid sizes, parallel keys)
    "ddp_bucket": ({"dp": 2}, {"dp": "ddp_bucket"}),
    "fsdp3": ({"dp": 2}, {"dp": "fsdp", "zero_stage": 3}),
    "tp2": ({"tp": 2}, {"dp": "single", "tp": 2}),
    "pp2-1f1b": ({"pp": 2}, {"dp": "single", "pp": 2, "microbatches": 2}),
}


def run(name, inject):
    sizes, keys = LAYOUTS[name]
    grid = ProcessGrid(sizes, torch.device("cpu"))
    torch.manual_seed(1234)
    strategy = parallelize(GPT(gpt_config(VOCAB)), grid, ParallelConfig(**keys))
    strategy.configure_optimizer(TRAINER)
    per_rank = 16 // grid.data_size
    mine = slice(grid.data_rank * per_rank, (grid.data_rank + 1) * per_rank)
    first = next(iter(strategy.module.parameters()))
    not_finite_at = []
    for step in range(STEPS):
        x, y = global_batch(step, VOCAB)
        hook = None
        if inject and step == BAD and grid.rank == 1:
            hook = first.register_hook(lambda g: g * float("nan"))
        strategy.reseed(step * 1009)
        strategy.loss_and_gradients([(x[mine], y[mine])])
        if hook is not None:
            hook.remove()
        norm = strategy.clip_gradients(1.0)
        not_finite_at.append(not bool(torch.isfinite(norm)))
        if not inject and step == BAD:
            strategy.drop_step(TRAINER.lr)
        else:
            strategy.optimizer_step(TRAINER.lr)
    state = [(key, box, t.detach().clone()) for key, _, box, t in strategy.shard_pieces()]
    return not_finite_at, state


def compute():
    out = {}
    for name in LAYOUTS:
        flags, injected = run(name, inject=True)
        _, by_hand = run(name, inject=False)
        same = len(injected) == len(by_hand) and all(
            (k1, b1) == (k2, b2) and torch.equal(t1, t2)
            for (k1, b1, t1), (k2, b2, t2) in zip(injected, by_hand))
        finite = all(bool(torch.isfinite(t).all()) for _, _, t in injected)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"flags": flags, "same": same, "finite": finite})
        out[name] = everyone
    return out


if __name__ == "__main__":  # by hand: torchrun --nproc_per_node=2 tests/nonfinite_worker.py
    from dp_worker import serve
    serve(compute)
