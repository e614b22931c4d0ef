"""GPipe: all forwards, then all backwards. Bubble (P-1)/(M+P-1); a rank holds all M
micro-batches' activations."""


def gpipe(P, M, rank, V=1):
    return [("F", rank, m) for m in range(M)] + [("B", rank, m) for m in range(M)]
