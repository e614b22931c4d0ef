"""Boxes: rectangular regions of an N-dimensional tensor, the unit of sharded state.

A box is a tuple of (start, stop) per dimension; `()` is the whole of a
scalar. Snapshots store canonical tensors as boxes (a row-parallel shard is
a box, not a flat range), and a flat range -- what ZeRO shards -- is a
short list of boxes: `flat_range_boxes` cuts it into the partial row at
each end and the whole rows between, recursively per dimension. Every box
from that cut is one contiguous run of the tensor's row-major order.
"""

import math


def whole(shape):
    return tuple((0, n) for n in shape)


def box_shape(box):
    return tuple(b - a for a, b in box)


def box_numel(box):
    return math.prod(box_shape(box))


def intersect(a, b):
    """The common part of two boxes of one tensor, or None."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def shift(box, origin):
    """`box` in coordinates relative to `origin` (another box's start corner)."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def strides(shape):
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def first_and_end(shape, box):
    """Flat row-major offsets (in `shape`) of the box's first element and one past its last."""
    st = strides(shape)
    first = sum(a * s for (a, _), s in zip(box, st))
    last = sum((b - 1) * s for (_, b), s in zip(box, st))
    return first, last + 1


def is_run(shape, box):
    """True if the box is one contiguous run of `shape`'s row-major order."""
    first, end = first_and_end(shape, box)
    return end - first == box_numel(box)


def flat_range_boxes(shape, start, stop):
    """Cut flat elements [start, stop) of a row-major tensor of `shape` into boxes, in order."""
    if start >= stop:
        return []
    if not shape:
        return [()]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:  # inside one row: recurse into it
        return [((r0, r0 + 1),) + b for b in flat_range_boxes(shape[1:], c0, c1)]
    out = []
    if c0:  # the partial first row
        out += [((r0, r0 + 1),) + b for b in flat_range_boxes(shape[1:], c0, inner)]
        r0 += 1
    if r0 < r1:  # whole rows
        out.append(((r0, r1),) + whole(shape[1:]))
    if c1:  # the partial last row
        out += [((r1, r1 + 1),) + b for b in flat_range_boxes(shape[1:], 0, c1)]
    return out


def as_jsonable(box):
    return [list(d) for d in box]


def from_jsonable(obj):
    return tuple((int(a), int(b)) for a, b in obj)
