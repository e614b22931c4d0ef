"""The textbook byte formulas, in one place: the benchmark's "vs textbook" columns
(bench/run_engine/stats.py) and the planner (step_time.py) both use them, and
tests/test_bench.py and tests/test_planner.py check them against hand counts and
against what real runs count (parallel/comm.py's convention: an all-reduce counts its
tensor, an all-gather its output, a reduce-scatter its input, a send what it sends).
"""

# Bytes a bandwidth-optimal (ring) algorithm makes each of n ranks send, per byte
# of the payload our counter records (parallel/comm.py: the all_reduce tensor,
# the all_gather output, the reduce_scatter input, what a send sends).
WIRE_PER_PAYLOAD = {
    "all_reduce": lambda n: 2 * (n - 1) / n,   # reduce-scatter + all-gather
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,        # pipelined ring: on average per rank
    "send": lambda n: 1.0,
    # an all-to-all's payload (the rows handed over) includes the rank's own share, which
    # stays: with even splits (n-1)/n of it travels
    "all_to_all": lambda n: (n - 1) / n,
    "all_to_all_counts": lambda n: (n - 1) / n,
}


def tp_textbook(cfg, n):
    """Megatron's traffic for pure TP on n ranks, per rank and optimizer step: per layer
    and micro-batch four all-reduces of one activation (two forward, two backward),
    plus one each for the embedding and the LM head input and the loss's two
    scalar-per-token all-reduces; a ring sends 2(n-1)/n of each."""
    L, C, T = cfg.model.n_layer, cfg.model.n_embd, cfg.data.block_size
    M = cfg.trainer.grad_accum
    rows = cfg.trainer.batch_size // M
    per_micro = (4 * L + 2) * rows * T * C * 4 + 3 * rows * T * 4
    payload = M * per_micro + 4  # + the gradient norm
    return {"payload_bytes": payload, "wire_bytes": 2 * (n - 1) / n * payload}


def cp_textbook(cfg, params, cp, n):
    """Context parallelism of degree cp with data parallelism over the rest of n ranks
    (dp = n / cp; tp = pp = 1), replicated gradients, per rank and optimizer step.
    Per layer and micro-batch (rows = batch / (dp x grad_accum) sequences of T / cp
    tokens on this rank; kv = its keys and values, 2 x rows x T/cp x width x 4 bytes):
    forward, cp-1 sends of kv around the ring; backward, cp-1 sends of keys, values and
    their gradients (2 kv) and one more of the gradients to their owner (kv). Point to
    point, so wire = payload; plus a ring all-reduce of one gradient over dp x cp."""
    L, M, kv = cfg.model.n_layer, cfg.trainer.grad_accum, cp_kv_bytes(cfg, cp, n)
    sends = L * M * ((cp - 1) * kv + (cp - 1) * 2 * kv + kv)
    return cp_with_gradients(params, n, {"send": sends}, {"send": sends})


def cp_allgather_textbook(cfg, params, cp, n):
    """The all-gather reference (parallel.cp_impl=allgather) on the same layout as
    cp_textbook, per rank and optimizer step. Per layer and micro-batch: forward, one
    all-gather of every rank's keys and values, whose output (what parallel/comm.py
    counts) is cp x kv; backward, one reduce-scatter of their gradients, whose input
    (counted) is the same cp x kv. A ring all-gather or reduce-scatter makes a rank send
    (cp-1)/cp of that; plus the gradient all-reduce over dp x cp, as for the ring."""
    L, M, kv = cfg.model.n_layer, cfg.trainer.grad_accum, cp_kv_bytes(cfg, cp, n)
    each = L * M * cp * kv
    payload = {"all_gather": each, "reduce_scatter": each}
    return cp_with_gradients(params, n, payload, {k: (cp - 1) / cp * b for k, b in payload.items()})


def cp_kv_bytes(cfg, cp, n):
    """One rank's keys and values of one micro-batch in one layer: 2 x rows x T/cp x
    width x 4 bytes, rows = batch / (dp x grad_accum), dp: the grid's for cp on n ranks."""
    from parallel.config import ParallelConfig
    from parallel.layout import grid_sizes
    dp = grid_sizes(ParallelConfig(cp=cp), n)["dp"]
    rows = cfg.trainer.batch_size // (dp * cfg.trainer.grad_accum)
    return 2 * rows * (cfg.data.block_size // cp) * cfg.model.n_embd * 4


def cp_with_gradients(params, n, kv_payload, kv_wire):
    """A context-parallel textbook: the K/V collectives by kind (`kv_bytes`, payload as
    counted; `kv_wire_bytes`, what a rank sends) on top of one gradient all-reduced
    over all n ranks; `<kind>_bytes` for each kind too."""
    grads = textbook(params, n, 0)
    return {**grads, **{f"{k}_bytes": b for k, b in kv_payload.items()},
            "kv_bytes": kv_payload, "kv_wire_bytes": kv_wire,
            "all_reduce_bytes": grads["payload_bytes"],
            "payload_bytes": grads["payload_bytes"] + sum(kv_payload.values()),
            "wire_bytes": grads["wire_bytes"] + sum(kv_wire.values())}


def textbook(params, n, zero_stage):
    """Per rank per step for fp32 + Adam on n ranks (the ZeRO paper's formulas).
    payload: what our counter would record; wire: what a ring makes a rank send;
    state: parameters + gradients + Adam's two moments, 16 bytes/param, /n where sharded."""
    if not params:
        return None
    g, f = 4 * params, (n - 1) / n
    if n == 1:
        return {"grad_bytes": g, "payload_bytes": 0, "wire_bytes": 0, "state_bytes": 16 * params}
    return {"grad_bytes": g,
            # DDP: all-reduce the gradient; ZeRO-1/2: reduce-scatter it + all-gather the
            # parameters; ZeRO-3: all-gather twice (forward, backward) + reduce-scatter
            "payload_bytes": g * (1, 2, 2, 3)[zero_stage],
            "wire_bytes": 2 * f * g * (1.5 if zero_stage == 3 else 1.0),
            "state_bytes": (16 * params, 8 * params + 8 * params / n,
                            4 * params + 12 * params / n, 16 * params / n)[zero_stage]}
