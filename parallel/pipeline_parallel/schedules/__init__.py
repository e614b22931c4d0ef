"""Pipeline schedules: for each pipeline rank, the order of its forward and backward steps.

The model is cut into P*V chunks (V = `parallel.pp_virtual_stages`: 1, or more for
interleaved; zbv always 2). An action is (kind, chunk, micro-batch), kind "F"
(forward), "B" (backward) or "W". Schedules without W run each chunk's whole backward
as B; the zero-bubble ones split it (split_backward.py): B is the input's gradient
only and W, later, the weights'. Every schedule runs each chunk's actions exactly once
per micro-batch; they differ in order, and so in how long ranks idle (the bubble) and
how many micro-batches' activations a rank holds at once. One file per schedule:

- gpipe.py        all forwards, then all backwards: bubble (P-1)/(M+P-1), holds M;
- one_f_one_b.py  1F1B: the same bubble, holds at most P - s (stage s);
- interleaved.py  Megatron's interleaved 1F1B, V chunks per rank: bubble / V;
- zb1p.py         ZB-H1: 1F1B with W deferred into the bubble: a third of it, holds P;
- zbv.py          ZB-V: two chunks per rank in a V, split backward: next to no bubble
                  for M >= 2P, holds P.

Chunks are placed on ranks in a loop (chunk c on rank c % P) or, for zbv, in a V
(`chunk_ranks`). `messages` says what each action receives and sends (a message to
the same rank is handed over in memory); p2p_plan.py batches those sends and
receives, and simulator.py runs every rank's plan against the others under gloo's
and NCCL's rules, so tests can show a schedule never hangs and that each pair of
ranks sends and receives messages in the same order.

May import: the standard library and its own files only (pure functions of P, M, V and
the rank: no torch, no process group). pipeline.py, p2p_plan.py, simulator.py,
parallel/layout.py and bench import it.
"""

from dataclasses import dataclass
from typing import Callable

from parallel.pipeline_parallel.schedules.gpipe import gpipe
from parallel.pipeline_parallel.schedules.interleaved import interleaved
from parallel.pipeline_parallel.schedules.one_f_one_b import one_f_one_b
from parallel.pipeline_parallel.schedules.zb1p import zb1p
from parallel.pipeline_parallel.schedules.zbv import v_rank, zbv


@dataclass(frozen=True)
class Schedule:
    actions: Callable             # (P, M, rank, V) -> this rank's [(kind, chunk, micro-batch)]
    v_shape: bool = False         # chunks placed in a V (zbv.v_rank), else in a loop
    split_backward: bool = False  # B is the input's gradient only, W the weights'
    virtual: int = None           # the V it always has (zbv: 2); None: pp_virtual_stages


SCHEDULES = {  # parallel.pp_schedule -> Schedule
    "gpipe": Schedule(gpipe),
    "1f1b": Schedule(one_f_one_b),
    "interleaved": Schedule(interleaved),
    "zb1p": Schedule(zb1p, split_backward=True),
    "zbv": Schedule(zbv, v_shape=True, split_backward=True, virtual=2),
}


def build(schedule, P, M, V, rank):
    return SCHEDULES[schedule].actions(P, M, rank, V)


def virtual_stages(schedule, configured):
    """Chunks per rank: the schedule's own (zbv: 2), else parallel.pp_virtual_stages."""
    return SCHEDULES[schedule].virtual or configured


def chunk_ranks(schedule, P, V):
    """The pipeline rank of every chunk, in model order."""
    if SCHEDULES[schedule].v_shape:
        return tuple(v_rank(c, P) for c in range(P * V))
    return tuple(c % P for c in range(P * V))


def chunk_blocks(n_layer, chunks, pp_layers=()):
    """Which transformer blocks each chunk holds: pp_layers if given, else balanced
    (the first n_layer % chunks chunks get one block more)."""
    sizes = list(pp_layers) if pp_layers else [
        n_layer // chunks + (1 if c < n_layer % chunks else 0) for c in range(chunks)]
    out, at = [], 0
    for n in sizes:
        out.append(list(range(at, at + n)))
        at += n
    return out


def messages(action, ranks):
    """(receives, sends) of an action: lists of (peer rank, (kind, chunk, micro-batch))
    naming what travels: "act" into chunk c, or "grad" into chunk c. ranks: chunk_ranks.
    A peer may be the action's own rank (zbv's bottom of the V): handed over in memory.
    W has neither: it needs only its own B."""
    kind, c, m = action
    last = len(ranks) - 1
    if kind == "F":
        recv = [(ranks[c - 1], ("act", c, m))] if c > 0 else []
        send = [(ranks[c + 1], ("act", c + 1, m))] if c < last else []
    elif kind == "B":
        recv = [(ranks[c + 1], ("grad", c, m))] if c < last else []
        send = [(ranks[c - 1], ("grad", c - 1, m))] if c > 0 else []
    else:
        recv, send = [], []
    return recv, send
