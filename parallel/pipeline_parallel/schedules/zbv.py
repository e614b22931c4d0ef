"""ZB-V (Qi et al., 2023, sec. 6): two chunks per rank laid out in a V, with the split
backward (B, then W later: split_backward.py). Chunk c lives on rank c for c < P and
on rank 2P - 1 - c after: rank 0 holds the first chunk and the last (embedding and LM
head on one rank, so the tied weight needs no collective), and the hop at the bottom
of the V (chunk P - 1 to chunk P) stays on rank P - 1.

Every rank runs the paper's phases; "down" is its chunk on the way to the loss
(chunk `rank`), "up" its chunk on the way back (chunk 2P - 1 - rank):

1. warm-up: 2(P - rank) - 1 down forwards; then `rank` pairs (up F, down F); then
   P - rank triples (up F, up B, up W);
2. steady, while forwards remain: (down F, down B, down W, up F, up B, up W);
3. cool-down: `rank` pairs (down B, up B); P - rank pairs (down B, down W); then the
   W's still owed, up chunk first.

With F, B and W of a chunk taking equal time this leaves next to no bubble once
M >= 2P, holding 1F1B's activation memory (2P half-size chunk micro-batches per
rank at most). The phases assume at least 2P - 1 micro-batches; with fewer, the
missing ones' actions are dropped from the same order (as PyTorch's
ScheduleZBVZeroBubble does), which the simulator checks like any schedule."""


def v_rank(c, P):
    """The rank of chunk c in the V."""
    return c if c < P else 2 * P - 1 - c


def zbv(P, M, rank, V=2):
    down, up = rank, 2 * P - 1 - rank
    n = max(M, 2 * P - 1)
    count = {("F", down): 0, ("F", up): 0, ("B", down): 0, ("B", up): 0,
             ("W", down): 0, ("W", up): 0}
    actions = []

    def run(kind, chunk):
        actions.append((kind, chunk, count[kind, chunk]))
        count[kind, chunk] += 1

    for _ in range(2 * (P - rank) - 1):
        run("F", down)
    for _ in range(rank):
        run("F", up)
        run("F", down)
    for _ in range(P - rank):
        run("F", up)
        run("B", up)
        run("W", up)
    while count["F", up] < count["F", down] or count["F", down] < n:
        if count["F", down] < n:
            run("F", down)
        run("B", down)
        run("W", down)
        run("F", up)
        run("B", up)
        run("W", up)
    for _ in range(rank):
        run("B", down)
        run("B", up)
    for _ in range(P - rank):
        run("B", down)
        run("W", down)
    while count["W", up] < count["B", up]:
        run("W", up)
    while count["W", down] < count["B", down]:
        run("W", down)
    return [a for a in actions if a[2] < M]
