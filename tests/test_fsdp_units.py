"""The flat layout of fsdp's sharding units, in one process (no collectives needed):
shards pad instead of truncating, optimizer pieces cover every parameter element
exactly once and never padding, each piece lies in one optimizer group, and
canonical <-> flat conversion round-trips."""

import pytest
import torch

from config import load_config
from errors import UserError
from model import GPT, GPTConfig
from parallel.fsdp_units import FlatUnit


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
        unit = FlatUnit(list(named.items()), group_of, rank, world, stage=2, dp_group=None)
        assert unit.shard_size * world >= unit.numel > unit.shard_size * (world - 1)
        for g, a, b, piece in unit.pieces:
            start, end = unit.lo + a, unit.lo + b
            covered.append((start, end))
            names = [n for n, o, nxt in zip(unit.names, unit.offsets, unit.offsets[1:])
                     if o < end and nxt > start]
            assert {group_of[n] for n in names} == {g}, "a piece spans two optimizer groups"
            assert piece.grad.shape == piece.shape
        back = unit.unflatten(unit.flatten(original, "cpu"))
        assert all(torch.equal(back[n], original[n]) for n in named)
        assert torch.equal(model.lm_head.weight, original["transformer.wte.weight"])
    covered.sort()
    assert covered[0][0] == 0 and covered[-1][1] == unit.numel  # no padding in any piece
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # no gap, no overlap


def test_zero_stage_is_validated():
    with pytest.raises(UserError, match="zero_stage"):
        load_config(["parallel.dp=fsdp", "parallel.zero_stage=4"], 2)
