"""Megatron's interleaved 1F1B over V chunks per rank (chunk c on rank c % P), which
divides the bubble by V. Micro-batches go through in groups of P, so M must be a
multiple of P (Megatron's rule; parallel/rules.py says so)."""


def interleaved(P, M, rank, V):
    """Virtual step k of this rank forwards micro-batch (k // (P*V)) * P + k % P on its
    chunk number (k // P) % V, and backwards the same micro-batches through its chunks
    in reverse."""
    total = M * V

    def forward(k):
        local = (k // P) % V
        return ("F", local * P + rank, (k // (P * V)) * P + k % P)

    def backward(k):
        local = V - 1 - (k // P) % V
        return ("B", local * P + rank, (k // (P * V)) * P + k % P)

    warmup = min((P - rank - 1) * 2 + (V - 1) * P, total)
    actions = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        actions += [forward(warmup + i), backward(i)]
    return actions + [backward(k) for k in range(total - warmup, total)]
