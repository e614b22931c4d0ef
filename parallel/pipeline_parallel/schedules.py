"""Pipeline schedules: for each pipeline rank, the order of its forward and backward steps.

The model is cut into P*V chunks (V = `parallel.pp_virtual_stages`, 1 unless
interleaved); chunk c lives on pipeline rank c % P. An action is
(kind, chunk, micro-batch), kind "F" or "B". Every schedule runs each
chunk's forward and backward exactly once per micro-batch; they differ in
order, and so in how long ranks idle (the bubble) and how many micro-batches'
activations a rank holds at once:

- gpipe: all forwards, then all backwards. Bubble (P-1)/(M+P-1); a rank holds
  all M micro-batches' activations.
- 1f1b: rank s runs P-s-1 warm-up forwards, then alternates one forward and
  one backward, then drains the backwards. Same bubble, but a rank holds at
  most P - s micro-batches (PipeDream-flush / Megatron's 1F1B).
- interleaved: Megatron's interleaved 1F1B over V chunks per rank, which
  divides the bubble by V. Micro-batches go through in groups of P, so M must
  be a multiple of P (Megatron's rule; config.py refuses the rest).

`messages` says what each action receives and sends; p2p_plan.py batches
those sends and receives, and simulator.py runs every rank's plan against the
others under gloo's and NCCL's rules, so tests can show a schedule never hangs
and that each pair of ranks sends and receives messages in the same order.
"""


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


def gpipe(P, M, rank):
    return [("F", rank, m) for m in range(M)] + [("B", rank, m) for m in range(M)]


def one_f_one_b(P, M, rank):
    warmup = min(P - rank - 1, M)
    actions = [("F", rank, m) for m in range(warmup)]
    for i in range(M - warmup):
        actions += [("F", rank, warmup + i), ("B", rank, i)]
    return actions + [("B", rank, m) for m in range(M - warmup, M)]


def interleaved(P, M, rank, V):
    """Megatron's interleaved 1F1B (M a multiple of P). Virtual step k of this rank
    forwards micro-batch (k // (P*V)) * P + k % P on its chunk number (k // P) % V,
    and backwards the same micro-batches through its chunks in reverse."""
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


SCHEDULES = {  # parallel.pp_schedule -> (P, M, rank, V) -> this rank's actions
    "gpipe": lambda P, M, rank, V: gpipe(P, M, rank),
    "1f1b": lambda P, M, rank, V: one_f_one_b(P, M, rank),
    "interleaved": interleaved,
}


def build(schedule, P, M, V, rank):
    return SCHEDULES[schedule](P, M, rank, V)


def refuse(cfg, sizes):
    """Why the pipeline cannot run this layout, or "" (parallel/layout.py)."""
    m, p = cfg.model, cfg.parallel
    P = sizes["pp"]
    chunks = P * p.pp_virtual_stages
    checks = [
        (P > 1 or (p.microbatches == 1 and p.pp_virtual_stages == 1 and not p.pp_layers),
         "parallel.microbatches, pp_virtual_stages and pp_layers are for pipeline parallelism "
         "(parallel.pp > 1); without it, use trainer.grad_accum for micro-batches"),
        (p.pp_virtual_stages == 1 or p.pp_schedule == "interleaved",
         f"parallel.pp_virtual_stages={p.pp_virtual_stages} needs parallel.pp_schedule=interleaved"),
        (p.pp_schedule != "interleaved" or p.microbatches % P == 0,
         f"parallel.pp_schedule=interleaved runs micro-batches in groups of parallel.pp={P}: "
         f"parallel.microbatches={p.microbatches} must be a multiple of it (Megatron's rule)"),
        (m.n_layer >= chunks,
         f"model.n_layer={m.n_layer} cannot fill parallel.pp={P} x pp_virtual_stages="
         f"{p.pp_virtual_stages} = {chunks} pipeline chunks (more stages than layers)"),
        (not p.pp_layers or (len(p.pp_layers) == chunks and sum(p.pp_layers) == m.n_layer
                             and min(p.pp_layers) >= 1),
         f"parallel.pp_layers={list(p.pp_layers)} must give each of the {chunks} pipeline chunks "
         f"at least one block, {m.n_layer} (model.n_layer) in all"),
    ]
    return next((message for ok, message in checks if not ok), "")


def messages(action, P, V):
    """(receives, sends) of an action: lists of (peer rank, (kind, chunk, micro-batch))
    naming what travels: "act" into chunk c, or "grad" into chunk c."""
    kind, c, m = action
    last = P * V - 1
    if kind == "F":
        recv = [((c - 1) % P, ("act", c, m))] if c > 0 else []
        send = [((c + 1) % P, ("act", c + 1, m))] if c < last else []
    else:
        recv = [((c + 1) % P, ("grad", c, m))] if c < last else []
        send = [((c - 1) % P, ("grad", c - 1, m))] if c > 0 else []
    return recv, send
