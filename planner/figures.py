"""One layout's figures for the fullest rank, and under the names metrics.jsonl gives the
measured ones.

`rank_figures` takes the pipeline rank and data-parallel rank that hold the most state
plus activations (memory.py) and their collective bytes (traffic.py): what memory and
time are judged on. `metrics_names` gives the figures a run writes, for the rank whose
they are there (`plan.out`'s JSON): `state_bytes` (and `host_state_bytes`) the most any
rank holds (Strategy.state_figures takes the max over ranks), and the collectives
(`comm_bytes`, `comm_<kind>_bytes`) and `activation_peak_mb` of rank 0, the rank that
logs them. Shards differ: under sequence parallelism rank 0's shard holds fewer
replicated elements than the fullest's, so it sums fewer gradient bytes over TP.

May import: planner.shapes, planner.memory, planner.traffic.
"""


from planner.memory import activation_bytes, fsdp_candidate_ranks, state_split
from planner.shapes import Layout, Workload
from planner.traffic import comm_bytes, comm_by_dim


def rank_figures(w: Workload, L: Layout) -> dict:
    """The fullest rank's figures (most state + activation bytes), named as metrics.jsonl
    names them, plus per-stage detail for the time model."""
    best, most = None, (0, 0)
    for p in range(L.pp):
        acts = activation_bytes(w, L, p)
        for r in fsdp_candidate_ranks(w, L, p):
            state, host = state_split(w, L, p, r)
            most = (max(most[0], state), max(most[1], host))
            if best is None or state + acts > best["state_bytes"] + best["activation_bytes"]:
                best = {"pp_rank": p, "dp_rank": r, "state_bytes": state, "activation_bytes": acts,
                        "host_state_bytes": host}
    best["comm"] = comm_bytes(w, L, best["pp_rank"], best["dp_rank"])
    best["by_dim"] = comm_by_dim(w, L, best["pp_rank"], best["dp_rank"])
    first = (best["pp_rank"], best["dp_rank"]) == (0, 0)
    # what a run logs (metrics_names): the max state over ranks, rank 0's traffic and activations
    best["logged"] = {"state_bytes": most[0], "host_state_bytes": most[1],
                      "comm": best["comm"] if first else comm_bytes(w, L, 0, 0),
                      "activation_bytes": best["activation_bytes"] if first
                      else activation_bytes(w, L, 0)}
    return {"fullest": best}


def metrics_names(fig) -> dict:
    """The figures a run of the layout writes to metrics.jsonl, under its names: the
    fullest rank's state, rank 0's collectives and activation peak."""
    logged = fig["logged"]
    comm = logged["comm"]
    out = {"state_bytes": logged["state_bytes"], "comm_bytes": sum(comm.values()),
           "activation_peak_mb": logged["activation_bytes"] / 2**20}
    if logged["host_state_bytes"]:
        out["host_state_bytes"] = logged["host_state_bytes"]
    out.update({f"comm_{k}_bytes": v for k, v in sorted(comm.items())})
    return out

