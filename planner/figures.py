"""One layout's figures for the fullest rank, named as metrics.jsonl names the measured ones.

`rank_figures` takes the pipeline rank and data-parallel rank that hold the most state
plus activations (memory.py) and their collective bytes (traffic.py); `metrics_names`
gives them the names a run writes (`state_bytes`, `comm_bytes`, `comm_<kind>_bytes`,
`activation_peak_mb`), which `plan.out`'s JSON uses.

May import: planner.shapes, planner.memory, planner.traffic.
"""


from planner.memory import activation_bytes, fsdp_candidate_ranks, state_split
from planner.shapes import Layout, Workload
from planner.traffic import comm_bytes, comm_by_dim


def rank_figures(w: Workload, L: Layout) -> dict:
    """The fullest rank's figures (most state + activation bytes), named as metrics.jsonl
    names them, plus per-stage detail for the time model."""
    best = None
    for p in range(L.pp):
        acts = activation_bytes(w, L, p)
        for r in fsdp_candidate_ranks(w, L, p):
            state, host = state_split(w, L, p, r)
            if best is None or state + acts > best["state_bytes"] + best["activation_bytes"]:
                best = {"pp_rank": p, "dp_rank": r, "state_bytes": state, "activation_bytes": acts,
                        "host_state_bytes": host}
    best["comm"] = comm_bytes(w, L, best["pp_rank"], best["dp_rank"])
    best["by_dim"] = comm_by_dim(w, L, best["pp_rank"], best["dp_rank"])
    return {"fullest": best}


def metrics_names(fig) -> dict:
    """A rank's figures as metrics.jsonl names them."""
    comm = fig["comm"]
    out = {"state_bytes": fig["state_bytes"], "comm_bytes": sum(comm.values()),
           "activation_peak_mb": fig["activation_bytes"] / 2**20}
    if fig["host_state_bytes"]:
        out["host_state_bytes"] = fig["host_state_bytes"]
    out.update({f"comm_{k}_bytes": v for k, v in sorted(comm.items())})
    return out

