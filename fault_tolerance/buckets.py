"""The gradients' elements cut into buckets for the sum across replica groups
(replica_group.ReplicaGroup.sum_across): at most one bucket is held beyond them."""


def buckets(grads, cap, device):
    """The gradients' elements in order, as buckets (lists of pieces (gradient, start, end)
    of its flattened elements) of at most `cap` elements: a contiguous gradient on the
    device of `cap` elements or more alone (it is reduced in place), the others packed,
    split across buckets where they do not fit (a non-contiguous one goes whole). A bucket
    holds one dtype: a gradient of another starts a new one (a bucket crosses in its
    dtype, and bf16 would round an fp32 gradient)."""
    bucket, room = [], cap
    for g in grads:
        n = g.numel()
        if n == 0:
            continue
        if in_place((g, 0, n), cap, device):
            if bucket:
                yield bucket
                bucket, room = [], cap
            yield [(g, 0, n)]
            continue
        if bucket and bucket[-1][0].dtype != g.dtype:
            yield bucket
            bucket, room = [], cap
        if not g.is_contiguous():
            if n > room and bucket:
                yield bucket
                bucket, room = [], cap
            bucket.append((g, 0, n))
            room -= n
        else:
            at = 0
            while at < n:
                take = min(room, n - at)
                bucket.append((g, at, at + take))
                at, room = at + take, room - take
                if room == 0:
                    yield bucket
                    bucket, room = [], cap
        if room <= 0:
            yield bucket
            bucket, room = [], cap
    if bucket:
        yield bucket


def in_place(piece, cap, device):
    """Whether a bucket's one piece is reduced where it lies: a whole contiguous gradient of
    at least `cap` elements on the device (an offloaded one is in host memory)."""
    g, start, end = piece
    return start == 0 and end == g.numel() >= cap and g.is_contiguous() and g.device == device


def part(piece):
    """A piece's elements as a tensor that views the gradient."""
    g, start, end = piece
    return g.view(-1)[start:end] if g.is_contiguous() else g
