"""1F1B (PipeDream-flush, Megatron's default): rank s runs P-s-1 warm-up forwards, then
alternates one forward and one backward, then drains the backwards. GPipe's bubble
(P-1)/(M+P-1), but a rank holds at most P - s micro-batches' activations."""


def one_f_one_b(P, M, rank, V=1):
    warmup = min(P - rank - 1, M)
    actions = [("F", rank, m) for m in range(warmup)]
    for i in range(M - warmup):
        actions += [("F", rank, warmup + i), ("B", rank, i)]
    return actions + [("B", rank, m) for m in range(M - warmup, M)]
