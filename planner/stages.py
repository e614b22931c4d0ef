"""What one rank holds under a layout: its pipeline stage's parameters (`stage`) and,
under fsdp, the flat units those parameters form and each rank's shard of them (`units`).

The parameters come from planner/census.py (the real model and TP split on the meta
device) and the chunks from the pipeline's own placement (parallel's schedules and
model plan), so the byte counts built on them (memory.py, traffic.py) hold exactly
the tensors a run allocates. Both are cached by identity: the many counts of one
layout share one Stage and its units.

May import: planner.shapes, planner.census, parallel (model_plan, pipeline schedules).
"""

from dataclasses import dataclass
from functools import lru_cache

from parallel import model_plan as plan
from parallel.pipeline_parallel.schedules import chunk_blocks, chunk_ranks
from planner.census import census
from planner.shapes import Layout, Workload


# ------------------------------------------------------------------ what a pipeline rank holds

@dataclass(frozen=True, eq=False)  # one object per (workload, split, rank): cached by identity
class Stage:
    chunks: tuple        # global chunk indices this pipeline rank runs
    layers: dict         # chunk -> number of blocks
    first: bool          # runs chunk 0 (embeddings)
    last: bool           # runs the last chunk (final LayerNorm, LM head, loss)
    tied_across: bool    # the tied embedding's gradient is summed with another rank
    params: tuple        # census Params this rank holds, in named_parameters() order
    blocks_params: tuple  # per held block: its Params (fsdp units)
    n_chunks: int        # chunks of the whole pipeline (P x V)
    chunk_blocks: dict   # chunk -> its block indices


def stage(w: Workload, L: Layout, p: int) -> Stage:
    """What pipeline rank p holds under L (the same on every TP, cp and dp rank)."""
    return _stage(w, L.tp, L.pp, L.schedule if L.pp > 1 else "1f1b", L.V if L.pp > 1 else 1, p,
                  L.ep)


@lru_cache(maxsize=None)
def _stage(w, tp, pp, schedule, V, p, ep=1):
    params = census(w.shape, tp, ep)
    ranks = chunk_ranks(schedule, pp, V) if pp > 1 else (0,)
    last = len(ranks) - 1
    layout = chunk_blocks(w.n_layer, len(ranks))
    mine = tuple(c for c in range(len(ranks)) if ranks[c] == p)
    prefixes = tuple(pre for c in mine for pre in plan.chunk_prefixes(layout[c], c == 0, c == last))
    held = tuple(q for q in params if q.name.startswith(prefixes))
    blocks = sorted(b for c in mine for b in layout[c])
    per_block = tuple(tuple(q for q in held if q.name.startswith(plan.block_prefix(b))) for b in blocks)
    first, has_last = 0 in mine, last in mine
    return Stage(mine, {c: len(layout[c]) for c in mine}, first, has_last,
                 pp > 1 and ranks[0] != ranks[-1] and (first or has_last), held, per_block,
                 len(ranks), {c: layout[c] for c in mine})


# ------------------------------------------------------------------ fsdp's flat units

@dataclass(frozen=True, eq=False)  # cached by identity with its stage
class Unit:
    params: tuple  # Params laid end to end, decayed first (FlatUnit's order)
    numel: int
    shard: int     # S: ceil(numel / N)
    touching: int  # this rank's pipeline chunks whose backward reaches it (1 without a pipeline)
    block: bool    # a transformer block's unit (not the root or the tied embedding's)
    ranks: int = 0   # the ranks it is sharded over: N, or N / ep for a block's experts
    stride: int = 1  # shard rank r holds shard r // stride of it (experts: ep; grid.expert_shard_rank)
    with_previous: bool = False  # a block's experts: gathered and freed with its other unit

    @property
    def padded(self) -> int:
        """Elements of the whole padded flat unit (ranks x shard)."""
        return self.ranks * self.shard


def units(st: Stage, L: Layout, N: int):
    """FSDP's units on this rank: one per block (and under expert parallelism a second one
    of its experts, sharded over the N / ep ranks holding the same experts), the tied
    embedding alone under a pipeline, then the root (everything else), as
    data_parallel/fsdp.py builds them."""
    return _units(st, L.pp > 1, N, L.ep)


@lru_cache(maxsize=None)
def _units(st, pipeline, N, ep=1):
    in_blocks = {q.name for b in st.blocks_params for q in b}
    root = [q for q in st.params if q.name not in in_blocks]
    own = [[q] for q in root if q.name == plan.TIED] if pipeline else []
    root = [q for q in root if not (own and q.name == plan.TIED)]
    chunk_prefixes = [tuple(plan.chunk_prefixes(range(0), c == 0, c == st.n_chunks - 1))
                      + tuple(plan.block_prefix(b) for b in st.chunk_blocks[c]) for c in st.chunks]
    out = []
    pieces = []  # (params, is a block's, the ranks sharding it, stride)
    for b in st.blocks_params:
        pieces.append(([q for q in b if not q.expert], True, N, 1))
        pieces.append(([q for q in b if q.expert], True, N // ep, ep))
    pieces += [(names, False, N, 1) for names in own + [root]]
    for names, block, ranks, stride in pieces:
        if names:
            ordered = tuple(sorted(names, key=lambda q: q.group))
            n = sum(q.numel for q in ordered)
            touching = sum(any(q.name.startswith(pre) for q in ordered) for pre in chunk_prefixes)
            out.append(Unit(ordered, n, -(-n // ranks), touching if pipeline else 1, block,
                            ranks, stride, stride > 1))
    return tuple(out)


def shard_pieces(u: Unit, r: int):
    """Element counts of shard rank r's shard per optimizer group (padding in none)."""
    r //= u.stride
    lo, hi, at, sizes = r * u.shard, (r + 1) * u.shard, 0, {}
    for q in u.params:
        a, b = max(at, lo), min(at + q.numel, hi)
        if a < b:
            sizes[q.group] = sizes.get(q.group, 0) + b - a
        at += q.numel
    return sizes


def shard_elements(u: Unit, r: int, which):
    """Elements of shard rank r's shard that belong to Params `which` picks."""
    r //= u.stride
    lo, hi, at, n = r * u.shard, (r + 1) * u.shard, 0, 0
    for q in u.params:
        if which(q):
            n += max(0, min(at + q.numel, hi) - max(at, lo))
        at += q.numel
    return n
