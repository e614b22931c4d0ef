"""Initial weights of a GPT built on the meta device, in process (no job launched).

main.py builds every layout's GPT on the meta device, and each rank fills only what it
holds from parallel/initial.py's InitialWeights: each parameter drawn whole from a
stream keyed by (trainer.seed, its canonical name) (GPT.initial_value), of which the
rank copies its boxes. Parity with one process (every layout test) shows the values are
the same everywhere, but not that they are the documented ones, nor that a parameter's
stream is its own: a seed without the name gives every parameter of a shape the same
values, and only test_precision's bf16 tolerance saw it, indirectly. Here:

- no two parameters start alike (nor does one under another seed), and a parameter's
  values do not depend on which others the model has or in which order they are read;
- each parameter's statistics are the documented init's (model.py, GPT-2's): N(0, 0.02)
  for linear and embedding weights, residual projections (`c_proj`) with std
  0.02 / sqrt(2 n_layer), biases 0, LayerNorm weights 1;
- every rank of a layout main.py builds (each rank in turn in this process, under
  PyTorch's fake process-group backend, as mode=dryrun does; single, ddp, fsdp 1/3 on 3
  ranks, tp with sequence parallelism and a padded vocabulary, 1f1b, interleaved and zbv
  pipelines, cp x tp, HSDP with offload, dp x tp x pp) holds the slice of the
  one-process GPT(seed) its placements name, zeros in the padding no canonical box
  covers: in each region (what snapshots and the norm read; across the world every
  element held, and written by exactly one rank), and in what its module computes with
  (fsdp: its unit gathered from the shard group's shards), read without the regions.
"""

import functools
import math
from contextlib import contextmanager
from itertools import combinations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from model import GPT, GPTConfig, shapes_only
from parallel.initial import InitialWeights

SEED = 1234
# four layers: a residual scale of 1/sqrt(n_layer) (0.5) is told from 1/sqrt(2 n_layer)
# (0.354); 64 wide and 32 positions: the smallest drawn tensor has 2048 values
STATS = GPTConfig(n_layer=4, n_head=2, n_embd=64, vocab_size=65, block_size=32)


def meta_gpt(config):
    with shapes_only():  # as main.train builds it
        return GPT(config)


def drawn(config, seed, order=None):
    """{name: the whole initial tensor} as InitialWeights reads it, in `order`."""
    model = meta_gpt(config)
    init = InitialWeights(model, seed)
    names = order or [n for n, _ in model.named_parameters()]
    return {n: init.read_full(f"model/{n}").clone() for n in names}


def documented(model, name):
    """The init model.py documents, worked out here from the module, not from
    GPT.init_rule: ("normal", std) or ("fill", value)."""
    path, _, kind = name.rpartition(".")
    module = model.get_submodule(path)
    if isinstance(module, nn.LayerNorm):
        return ("fill", 1.0 if kind == "weight" else 0.0)
    if kind == "bias":
        return ("fill", 0.0)
    assert isinstance(module, (nn.Linear, nn.Embedding)), name
    residual = path.endswith(".c_proj")  # attn.c_proj and mlp.c_proj write the residual stream
    return ("normal", 0.02 / math.sqrt(2 * model.config.n_layer) if residual else 0.02)


def correlation(a, b):
    """Of the first min(numel) values of two tensors, as unit vectors."""
    n = min(a.numel(), b.numel())
    a, b = a.reshape(-1)[:n].double(), b.reshape(-1)[:n].double()
    return float(a @ b / (a.norm() * b.norm()))


def test_every_parameter_draws_from_a_stream_of_its_own():
    """Drawn from (seed, name): any two parameters are uncorrelated (a stream keyed by the
    seed alone, or by the shape, gives correlation 1), and so is each parameter with
    itself under another seed; read in reverse order, or from a GPT with other layers,
    a parameter has the same values."""
    model = meta_gpt(STATS)
    values = drawn(STATS, SEED)
    normal = [n for n in values if documented(model, n)[0] == "normal"]
    assert len(normal) == 2 + 4 * STATS.n_layer  # wte, wpe; c_attn, c_proj, c_fc, c_proj a block
    pairs = {(a, b): correlation(values[a], values[b]) for a, b in combinations(normal, 2)}
    worst = max(pairs, key=lambda k: abs(pairs[k]))
    print(f"{len(pairs)} pairs; largest |correlation| {abs(pairs[worst]):.3f} ({worst})")
    assert abs(pairs[worst]) < 0.2, (worst, pairs[worst])
    other = drawn(STATS, SEED + 1)
    across = {n: correlation(values[n], other[n]) for n in normal}
    print(f"seed {SEED} against {SEED + 1}: largest |correlation| {max(map(abs, across.values())):.3f}")
    assert all(abs(c) < 0.2 for c in across.values()), across
    backwards = drawn(STATS, SEED, order=list(reversed(values)))
    assert all(torch.equal(backwards[n], values[n]) for n in values)
    fewer = drawn(GPTConfig(**{**vars(STATS), "n_layer": 2}), SEED)  # c_proj's std depends on it
    same = [n for n in fewer if not n.endswith("c_proj.weight")]
    assert len(same) > 20 and all(torch.equal(fewer[n], values[n]) for n in same)


def test_each_parameter_starts_as_documented():
    """Fills exactly; each drawn tensor's mean, standard deviation and share within one
    standard deviation (0.683 for a normal) within 6 standard errors of the documented
    N(0, std) (a std 25% off, the residual scale 1/sqrt(n_layer), a uniform draw: far
    outside)."""
    model = meta_gpt(STATS)
    values = drawn(STATS, SEED)
    inside = math.erf(1 / math.sqrt(2))
    worst = {}
    for name, t in values.items():
        kind, value = documented(model, name)
        if kind == "fill":
            assert torch.equal(t, torch.full_like(t, value)), name
            continue
        n, t = t.numel(), t.double()
        errors = {"mean": float(t.mean()) / (value / math.sqrt(n)),
                  "std": (float(t.std()) / value - 1) / math.sqrt(1 / (2 * n)),
                  "within": (float((t.abs() < value).double().mean()) - inside)
                  / math.sqrt(inside * (1 - inside) / n)}
        for what, sigmas in errors.items():
            if abs(sigmas) > abs(worst.get(what, (0, ""))[0]):
                worst[what] = (sigmas, name)
        assert all(abs(s) <= 6 for s in errors.values()), (name, value, float(t.std()), errors)
    print("largest deviations, in standard errors: " + ", ".join(
        f"{what} {s:+.2f} ({name})" for what, (s, name) in worst.items()))


# ---------------------------------------------------------------- each rank's share

SMALL = ["model.n_layer=4", "model.n_head=2", "model.n_embd=32", "data.block_size=16",
         "trainer.batch_size=12", f"trainer.seed={SEED}"]
FSDP = ["parallel.dp=fsdp"]
PP2 = ["parallel.pp=2", "parallel.microbatches=2"]
# name: (world, overrides), layouts main.py builds on the meta device. PyTorch's references
# (torch_ddp, torch_fsdp, tp_impl/pp_impl=torch) materialize the whole replica as `single`
# and ddp_* do (ReplicatedStrategy), then wrap it
LAYOUTS = {
    "single": (1, ["parallel.dp=single"]),
    "dp2-ddp_bucket": (2, ["parallel.dp=ddp_bucket"]),
    # 3 ranks: flat units that do not divide evenly; stages 1-2 gather, stage 3 does not
    "dp3-fsdp1": (3, FSDP + ["parallel.zero_stage=1"]),
    "dp3-fsdp3": (3, FSDP + ["parallel.zero_stage=3"]),
    # 65 characters over 2 ranks: a padding row in the embedding and head
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    # the tied embedding on the first and the last stage
    "pp2-1f1b": (2, PP2),
    "pp2-interleaved": (2, PP2 + ["parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2"]),
    "pp2-zbv": (2, PP2 + ["parallel.pp_schedule=zbv"]),
    "cp2tp2": (4, ["parallel.cp=2", "parallel.tp=2"]),
    "hsdp2x2-fsdp3-offload": (4, FSDP + ["parallel.zero_stage=3", "parallel.dp_replicate=2",
                                         "parallel.offload=true"]),
    "dp2tp2pp2-fsdp2": (8, FSDP + ["parallel.zero_stage=2", "parallel.tp=2"] + PP2),
}


@contextmanager
def fake_rank(rank, world):
    """torch.distributed as rank `rank` of `world` sees it: collectives return at once
    and move nothing (what a rank reads of the initial weights is its own)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_rank(world, rank, overrides):
    """Rank `rank` of `world` as main.train builds it (the GPT on the meta device,
    InitialWeights, parallelize), under the fake backend: its GPT config, grid coordinates,
    placements, regions [(name, [(canonical box, index)], values, writes)], and what its
    module computes with: the TP-local parameters (`params`) or, fsdp, each unit's flat
    layout and this rank's shard of it (`units`)."""
    from config import load_config
    from parallel.grid import ProcessGrid
    from parallel.layout import grid_sizes
    from parallel.parallelize import parallelize
    cfg = load_config(SMALL + overrides, world)  # the layout rules a run checks
    with fake_rank(rank, world):
        grid = ProcessGrid(grid_sizes(cfg.parallel, world), torch.device("cpu"), cfg.parallel.timeout_s)
        config = GPTConfig(**{k: v for k, v in vars(cfg.model).items() if k != "init_from"},
                           vocab_size=65, block_size=cfg.data.block_size)
        model = meta_gpt(config)
        strategy = parallelize(model, grid, cfg.parallel, InitialWeights(model, cfg.trainer.seed))
        out = dict(config=config, coords=dict(grid.coords), shard_rank=grid.shard_rank,
                   placements=dict(strategy.placements),
                   regions=[(r.placement.name, r.canonical_parts(), r.values().detach().clone(),
                             r.writes) for r in strategy.regions()])
        if hasattr(strategy, "units"):  # fsdp: the parameters view a unit gathered from its shards
            out["units"] = [(u.names, u.offsets, u.shapes, u.master.detach().clone())
                            for u in strategy.units]
        else:
            out["params"] = {n: p.detach().clone() for n, p in strategy.module.named_parameters()}
    return out


@functools.lru_cache(maxsize=None)
def world_of(layout):
    """(GPT(seed)'s parameters: the one-process model, every rank of the layout)."""
    world, overrides = LAYOUTS[layout]
    ranks = [build_rank(world, rank, overrides) for rank in range(world)]
    want = {n: p.detach() for n, p in GPT(ranks[0]["config"], seed=SEED).named_parameters()}
    return want, ranks


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_ranks_regions_hold_their_slice_of_the_one_process_model(layout):
    """What snapshots, the gradient norm and materialization read: each region's values
    are the canonical boxes its placement names, of GPT(seed); its padding is zeros;
    every element is held by some rank and written by exactly one."""
    want, ranks = world_of(layout)
    held = {n: torch.zeros(p.shape, dtype=torch.int) for n, p in want.items()}
    writers = {n: torch.zeros(p.shape, dtype=torch.int) for n, p in want.items()}
    checked = padding = 0
    for rank, built in enumerate(ranks):
        assert built["regions"], f"rank {rank} holds nothing"
        for name, parts, values, writes in built["regions"]:
            unused = torch.ones(values.numel(), dtype=torch.bool)
            for box, idx in parts:
                where = tuple(slice(a, b) for a, b in box)
                expected = want[name][where].reshape(-1)
                same = torch.equal(values[idx], expected)
                assert same, (f"rank {rank}: {name}{list(box)} is not the one-process model's: "
                              f"largest difference {float((values[idx] - expected).abs().max()):.3g}")
                unused[idx] = False
                held[name][where] += 1
                writers[name][where] += int(writes)
                checked += expected.numel()
            # padding: rows of a padded vocabulary
            assert not values[unused].any(), f"rank {rank}: {name}'s padding is not zeros"
            padding += int(unused.sum())
    for name in want:
        assert held[name].min() >= 1, f"{name}: {int((held[name] == 0).sum())} elements held by no rank"
        assert torch.equal(writers[name], torch.ones_like(writers[name])), (
            f"{name}: written by {writers[name].min()}..{writers[name].max()} ranks")
    print(f"{layout}: {len(ranks)} ranks, {checked} elements equal to GPT(seed={SEED})'s, "
          f"{padding} of padding zeros; each element held by {int(min(h.min() for h in held.values()))}"
          f"..{int(max(h.max() for h in held.values()))} ranks, written by one")


def module_tensors(ranks):
    """Per rank, {name: the TP-local tensor its module computes with}: a replica's
    parameters; under fsdp each unit as its all-gather leaves it, the shards of its
    shard group (the ranks at the same dp_replicate, pp and tp coordinates) end to end
    in shard-rank order, viewed at the unit's offsets."""
    from parallel.grid import DIMS, SHARD_DIMS
    group = lambda built: tuple(built["coords"][d] for d in DIMS if d not in SHARD_DIMS)
    out = []
    for built in ranks:
        if "params" in built:
            out.append(built["params"])
            continue
        peers = sorted((b for b in ranks if group(b) == group(built)), key=lambda b: b["shard_rank"])
        assert [b["shard_rank"] for b in peers] == list(range(len(peers)))
        tensors = {}
        for i, (names, offsets, shapes, _) in enumerate(built["units"]):
            flat = torch.cat([b["units"][i][3] for b in peers])
            tensors.update({n: flat[off:off + s.numel()].view(s)
                            for n, off, s in zip(names, offsets, shapes)})
        out.append(tensors)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_ranks_module_computes_with_its_slice_of_the_one_process_model(layout):
    """What forward runs on, read without the regions: each rank's TP-local parameters
    (fsdp: gathered from the shards), cut into canonical boxes by their placements,
    equal GPT(seed)'s; the rest (padding rows) is zeros; every parameter the rank's
    placements name is there."""
    want, ranks = world_of(layout)
    checked = 0
    for rank, (built, tensors) in enumerate(zip(ranks, module_tensors(ranks))):
        assert sorted(tensors) == sorted(built["placements"]), rank
        for name, local in tensors.items():
            placement = built["placements"][name]
            assert tuple(local.shape) == tuple(placement.local_shape), (rank, name)
            covered = torch.zeros(local.shape, dtype=torch.bool)
            for canon, sub in placement.canonical_boxes(tuple((0, n) for n in local.shape)):
                got = local[tuple(slice(a, b) for a, b in sub)]
                expected = want[name][tuple(slice(a, b) for a, b in canon)]
                same = torch.equal(got, expected)
                assert same, (f"rank {rank}: {name} local {list(sub)} is not the one-process "
                              f"model's {list(canon)}: largest difference "
                              f"{float((got - expected).abs().max()):.3g}")
                covered[tuple(slice(a, b) for a, b in sub)] = True
                checked += got.numel()
            assert not local[~covered].any(), f"rank {rank}: {name}'s padding is not zeros"
    print(f"{layout}: {len(ranks)} ranks' modules, {checked} elements equal to GPT(seed={SEED})'s")
