"""fsdp's sharding units, in one process.

The flat layout (no collectives needed): shards pad instead of truncating,
optimizer pieces cover every parameter element exactly once and never padding,
each piece lies in one optimizer group, and canonical <-> flat conversion
round-trips. And on a one-rank group: the order in which stage 3 starts its
all-gathers (prefetch one unit ahead, or just in time)."""

import pytest
import torch

from config import load_config
from errors import UserError
from model import GPT, GPTConfig
from parallel.data_parallel.fsdp_units import FlatUnit


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pieces_cover_each_element_once(world):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=10, vocab_size=65, block_size=7))
    named = dict(model.named_parameters())
    assert model.lm_head.weight is named["transformer.wte.weight"]  # tied: one parameter
    groups = model.optim_groups(0.1)
    group_of = {n: g for g, grp in enumerate(groups) for n in grp["params"]}
    original = {n: p.detach().clone() for n, p in named.items()}
    covered = []
    for rank in range(world):
        unit = FlatUnit(list(named.items()), group_of, rank, world, stage=2, dp_group=None,
                        device=torch.device("cpu"))
        assert unit.shard_size * world >= unit.numel > unit.shard_size * (world - 1)
        unit.allocate_grads()
        for g, a, b, piece in unit.pieces:
            start, end = unit.lo + a, unit.lo + b
            covered.append((start, end))
            names = [n for n, o, nxt in zip(unit.names, unit.offsets, unit.offsets[1:])
                     if o < end and nxt > start]
            assert {group_of[n] for n in names} == {g}, "a piece spans two optimizer groups"
            assert piece.grad.shape == piece.shape
        back = unit.unflatten(unit.flatten(original, "cpu"))
        assert all(torch.equal(back[n], original[n]) for n in named)
        # the parameters are views of the unit (the tied one once), the same objects
        assert model.lm_head.weight is named["transformer.wte.weight"]
        assert all(p.untyped_storage().data_ptr() == unit.full.untyped_storage().data_ptr()
                   for p in named.values())
    covered.sort()
    assert covered[0][0] == 0 and covered[-1][1] == unit.numel  # no padding in any piece
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # no gap, no overlap


def test_zero_stage_is_validated():
    with pytest.raises(UserError, match="zero_stage"):
        load_config(["parallel.dp=fsdp", "parallel.zero_stage=4"], 2)


# ---------------------------------------------------------------- stage 3: when each gather starts

def expected_schedule(n_blocks, prefetch):
    """The design (parallel/data_parallel/fsdp.py): with prefetch, block k's all-gather starts one unit
    ahead -- in forward before the previous unit computes, in backward before the next
    block's backward computes (the last block's behind the LM head); without prefetch,
    each gather starts right before its own unit needs it."""
    units = ["root"] + list(range(n_blocks))
    events = []
    if prefetch:
        events.append(("gather", "root"))
        for unit, nxt in zip(units, units[1:] + [None]):
            if nxt is not None:
                events.append(("gather", nxt))
            events.append(("compute", unit))
        events.append(("gather", n_blocks - 1))
        for k in reversed(range(n_blocks)):
            if k > 0:
                events.append(("gather", k - 1))
            events.append(("backward", k))
    else:
        for unit in units:
            events += [("gather", unit), ("compute", unit)]
        for k in reversed(range(n_blocks)):
            events += [("gather", k), ("backward", k)]
    return events


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "noprefetch"])
def test_stage3_prefetch_gathers_the_next_block_while_this_one_computes(
        one_rank_grid, monkeypatch, prefetch, compiled):
    """A spy on FlatUnit.start_gather records when each unit's all-gather really starts,
    against when each unit starts computing (forward pre-hooks and gradient hooks
    registered after fsdp's own, so they run once fsdp has waited for its gather).
    A prefetch of the wrong block, or of none, leaves the numbers unchanged and only
    loses the overlap: this is what sees it. Compiled (trainer.compile, each block's
    forward compiled), the gathers and frees around each block must not move."""
    from parallel.parallelize import parallelize
    from parallel.config import ParallelConfig
    from parallel.data_parallel.fsdp_units import FREED
    from training.config import TrainerConfig

    torch.manual_seed(0)
    n_blocks = 3
    model = GPT(GPTConfig(n_layer=n_blocks, n_head=2, n_embd=16, vocab_size=11, block_size=8))
    strategy = parallelize(model, one_rank_grid,
                              ParallelConfig(dp="fsdp", zero_stage=3, prefetch=prefetch))
    tcfg = TrainerConfig(compile=compiled, compile_backend="aot_eager")
    strategy.configure_compute(tcfg)
    strategy.configure_optimizer(tcfg)
    label = {id(u): k for k, u in enumerate(strategy.blocks)} | {id(strategy.root): "root"}
    events = []

    real_start = FlatUnit.start_gather

    def start_gather(unit, comm):
        if unit.state == FREED:  # otherwise a no-op: gathered or in flight already
            events.append(("gather", label[id(unit)]))
        return real_start(unit, comm)
    monkeypatch.setattr(FlatUnit, "start_gather", start_gather)

    def on_backward(k):
        def hook(grad):
            events.append(("backward", k))
        return hook

    def after_block_forward(k):
        def hook(module, args, out):
            out.register_hook(on_backward(k))  # after fsdp's own: runs once it has waited
        return hook

    def on_compute(unit):
        def hook(module, args):
            events.append(("compute", unit))
        return hook

    model.register_forward_pre_hook(on_compute("root"))
    for k, block in enumerate(model.transformer.h):
        block.register_forward_pre_hook(on_compute(k))
        block.register_forward_hook(after_block_forward(k))

    x = torch.randint(0, 11, (2, 8))
    for step in range(2):  # the second step starts from the state the first one left
        events.clear()
        strategy.forward_backward([(x, x)])
        strategy.clip_grad_norm_(1.0)
        strategy.optimizer_step(1e-3)
        assert events == expected_schedule(n_blocks, prefetch), \
            f"step {step + 1}: gathers started at\n{events}\nexpected\n{expected_schedule(n_blocks, prefetch)}"
