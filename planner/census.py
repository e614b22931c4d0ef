"""The parameters a rank holds, from the real model and tensor-parallel code on the meta
device (no memory, no process group): what every per-rank byte count starts from.

`census(shape, tp)` builds the GPT with model.py on the meta device and applies
parallel/tensor_parallel/apply.py's split as TP rank 0 would (every TP rank holds the
same sizes: a vocabulary tp does not divide is padded), so the planner counts exactly
the tensors a run allocates, in the order the strategies see them.
"""

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace


@dataclass(frozen=True)
class Param:
    name: str         # canonical name (model_plan's; the tied embedding once)
    numel: int        # elements on one TP rank (its slice, vocabulary padding included)
    group: int        # AdamW group of GPT.optim_groups: 0 decayed (matrices), 1 not
    replicated: bool  # the same on every TP rank (LayerNorms, row biases, wpe)


@lru_cache(maxsize=None)
def census(shape, tp):
    """shape: (n_layer, n_head, n_embd, vocab_size, block_size, bias). Returns the
    tuple of Params in GPT.named_parameters() order under tensor parallelism tp."""
    import torch

    from model import GPT, GPTConfig, shapes_only
    from parallel.comm import CommCounter
    from parallel.tensor_parallel.apply import apply_tensor_parallel
    n_layer, n_head, n_embd, vocab, block, bias = shape
    with shapes_only():
        model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, bias=bias,
                              vocab_size=vocab, block_size=block))
    groups = {n: g for g, grp in enumerate(model.optim_groups(0.0)) for n in grp["params"]}
    placements = None
    if tp > 1:
        grid = SimpleNamespace(tp_group=None, tp_size=tp, tp_rank=0, device=torch.device("meta"))
        placements, _ = apply_tensor_parallel(model, grid, SimpleNamespace(sequence_parallel=False),
                                              CommCounter())
    return tuple(Param(n, p.numel(), groups[n],
                       bool(placements and placements[n].tp_replicated))
                 for n, p in model.named_parameters())
