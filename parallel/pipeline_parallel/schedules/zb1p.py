"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023, sec. 2.1): 1F1B's order,
with each backward split into B (the input's gradient, sent upstream at once) and W
(the weights' gradients, which nobody waits for), and stage s running its W's s
micro-batches late. The W's it owes fill what would be 1F1B's cool-down bubble: with
F, B and W taking equal time, a step takes 3M + P - 1 units against 1F1B's
3M + 3(P - 1), a third of the bubble (for M >= P).

Memory: a micro-batch's activations stay until its W (the graph W needs), so stage
s holds (P - s - 1 warm-up forwards) + (s W's owed) + 1 = P micro-batches at most,
on every stage: 1F1B's stage 0 peak, the bound the paper keeps."""


def zb1p(P, M, rank, V=1):
    warmup = min(P - rank - 1, M)
    actions = [("F", rank, m) for m in range(warmup)]
    weights = 0  # W's run so far, in micro-batch order

    def weight_lagging(backwards):
        """After the B of micro-batch backwards - 1: the W running `rank` behind it."""
        nonlocal weights
        if backwards - 1 - rank >= 0:
            actions.append(("W", rank, weights))
            weights += 1

    for i in range(M - warmup):   # steady: F, B, and the W owed from `rank` B's ago
        actions += [("F", rank, warmup + i), ("B", rank, i)]
        weight_lagging(i + 1)
    for i in range(M - warmup, M):  # cool-down: the remaining B's, each with its late W
        actions.append(("B", rank, i))
        weight_lagging(i + 1)
    return actions + [("W", rank, m) for m in range(weights, M)]
