"""Test-only worker: the vocabulary-parallel cross-entropy against F.cross_entropy, at
logit scales where exp() overflows without the max shift, on a padded vocabulary.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/tp_loss_worker.py

Every rank builds the same full logits (65 ids: with tp=2 a rank holds 33 rows, the
last rank's 33rd a padding row), keeps its vocabulary slice, and computes the
per-token losses and the gradient of their mean; rank 0 prints `RESULT <json>`
with the largest relative differences to torch's loss and gradient (the worker
never asserts, so a wrong result cannot hang a rank).
"""

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dp_worker import serve  # noqa: E402
from parallel.comm import CommCounter  # noqa: E402
from parallel.tensor_parallel.apply import padded_vocab  # noqa: E402
from parallel.tensor_parallel.ops import vocab_parallel_cross_entropy  # noqa: E402

VOCAB, TOKENS = 65, 48


def check(scale):
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(TOKENS, VOCAB, generator=gen, dtype=torch.float64).float() * scale
    target = torch.randint(VOCAB, (TOKENS,), generator=gen)
    target[:4] = VOCAB - 1  # the last real id: on the last rank, next to the padding row
    ref_logits = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target, reduction="none")
    ref.mean().backward()

    rows = padded_vocab(VOCAB, world)
    start, n_real = rank * rows, max(0, min(rows, VOCAB - rank * rows))
    local = torch.zeros(TOKENS, rows)
    local[:, :n_real] = full[:, start:start + n_real]
    local[:, n_real:] = 1e4  # padding logits: large, so any probability they took would show
    local.requires_grad_()
    tp = SimpleNamespace(group=dist.group.WORLD, comm=CommCounter())
    losses = vocab_parallel_cross_entropy(local, target, tp, start, n_real)
    losses.mean().backward()
    rel = lambda a, b: ((a - b).abs() / b.abs().clamp(min=1e-6)).max().item()  # noqa: E731
    grad_ref = ref_logits.grad[:, start:start + n_real]
    return {"finite": bool(torch.isfinite(losses).all()),
            "loss_rel_diff": rel(losses.detach(), ref.detach()),
            "grad_max_abs_diff": (local.grad[:, :n_real] - grad_ref).abs().max().item(),
            "grad_scale": grad_ref.abs().max().item(),
            "padding_grad_zero": bool((local.grad[:, n_real:] == 0).all())}


def compute():
    result = {str(scale): check(scale) for scale in (1.0, 100.0)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    return everyone


if __name__ == "__main__":
    serve(compute)
