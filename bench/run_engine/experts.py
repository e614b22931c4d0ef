"""Expert parallelism in bench.run (`--preset ep --model moe`): the textbook bytes, each
variant's figures for the summary, and the results.md section.

The tokens' exchange is compared on rank 0, from its metrics like every other preset's
traffic: parallel/comm.py counts each rank's own share of it (the all-to-all: the side
holding this rank's own tokens' rows), which does not depend on the routing.
"""

from statistics import median

from bench.report import table
from planner.formulas import textbook

MiB = 2**20
KINDS = {"all_to_all": "all-to-all (rows)", "all_to_all_counts": "all-to-all (counts per expert)",
         "all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}


def expert_keys(variant, ranks):
    """(parallel.ep, parallel.ep_impl) of a variant on `ranks` ranks, or None without parallel.ep."""
    keys = dict(o.split("=", 1) for o in variant.overrides)
    if "parallel.ep" not in keys:
        return None
    return int(keys["parallel.ep"].format(nproc=ranks)), keys.get("parallel.ep_impl", "alltoall")


def parameter_split(model):
    """(dense, expert) parameters of a GPT (meta is enough): expert ones are the stacked
    expert tensors (parallel/model_plan.EXPERT_WEIGHTS), which expert parallelism cuts."""
    from parallel.model_plan import EXPERT_WEIGHTS
    expert = sum(p.numel() for n, p in model.named_parameters() if n.endswith(EXPERT_WEIGHTS))
    return model.num_params() - expert, expert


def moe_blocks(m):
    """How many blocks carry experts (model.ModelConfig.has_experts: every moe_every-th)."""
    return m.n_layer // m.moe_every if m.moe_experts else 0


def ep_textbook(cfg, dense, expert, ep, n, impl="alltoall"):
    """Per optimizer step and rank on n ranks (dp = n, ep of them in each expert-parallel
    group), N = B x T / n of the global batch's tokens on each rank, each to k experts,
    width C, L MoE blocks, M micro-batches:

    - exchange (`exchange_bytes`, as parallel/comm.py counts it on every rank, rank 0's
      included): all-to-all: 4 x N x k x C x 4 bytes x L (this rank's tokens' rows: the
      dispatch sends them and the combine brings them back, forward and backward); the
      counts, E int64 per block and micro-batch. All-gather reference: per block and
      direction ep x N x (1 + k) x C x 4 gathered (the tokens and the choices' outputs;
      counted by the output) and as much reduce-scattered (counted by the input).
      `exchange_wire_bytes`: what a rank sends to others, (ep-1)/ep of that (the
      all-to-all's on average: what it hands back follows the routing).
    - gradients (rank 0): the dense ones all-reduced over the n data-parallel ranks, the
      experts' (E/ep of them) over the n/ep ranks holding the same ones; state 16 bytes per
      parameter held. The rest of the dict as planner.formulas.textbook's."""
    m, t = cfg.model, cfg.trainer
    C, k, E, L, M = m.n_embd, m.moe_top_k, m.moe_experts, moe_blocks(m), t.grad_accum
    tokens = t.batch_size * cfg.data.block_size // n
    if ep == 1:
        exchange = {}
    elif impl == "allgather":
        each = ep * tokens * (1 + k) * C * 4 * L
        exchange = {"all_gather": each, "reduce_scatter": each}
    else:
        exchange = {"all_to_all": 4 * tokens * k * C * 4 * L, "all_to_all_counts": M * L * E * 8}
    held = expert // ep
    dense_book, expert_book = textbook(dense, n, 0), textbook(held, n // ep, 0)
    reduce = dense_book["payload_bytes"] + expert_book["payload_bytes"]
    wire = {kind: (ep - 1) / ep * b for kind, b in exchange.items()}
    return {"grad_bytes": 4 * (dense + expert), "state_bytes": 16 * (dense + held),
            "all_reduce_bytes": reduce,
            "all_reduce_wire_bytes": dense_book["wire_bytes"] + expert_book["wire_bytes"],
            "exchange_bytes": exchange, "exchange_wire_bytes": wire,
            "payload_bytes": reduce + sum(exchange.values()),
            "wire_bytes": dense_book["wire_bytes"] + expert_book["wire_bytes"] + sum(wire.values())}


def figures(variant, ranks, recs, cfg, model, ratio, loss_diff, ok, by_round):
    """(textbook, the summary's `expert_parallel`) of an expert variant, or None: a variant
    without parallel.ep, or a dense model. recs: its kept records (rank 0's); ratio and
    loss_diff: stats' functions. `exchange`: each comm_*_bytes of rank 0 over the kept
    steps (median, min, max)."""
    keys = expert_keys(variant, ranks)
    if keys is None or model is None or not cfg.model.moe_experts:
        return None
    ep, impl = keys
    dense, expert = parameter_split(model)
    kinds = sorted({k for r in recs for k in r if k.startswith("comm_") and k.endswith("_bytes")})
    exchange = {k: {"median": median(r.get(k, 0) for r in recs), "min": min(r.get(k, 0) for r in recs),
                    "max": max(r.get(k, 0) for r in recs)} for k in kinds}
    loads = [r["moe_load_max"] for r in recs if "moe_load_max" in r]
    return ep_textbook(cfg, dense, expert, ep, ranks, impl), {
        "ep": ep, "impl": impl if ep > 1 else "-", "dp": ranks, "experts": cfg.model.moe_experts,
        "dense_params": dense, "expert_params": expert, "exchange": exchange,
        "load_max": median(loads) if loads else None,
        "vs_ep1": ratio(by_round, variant.name, "ep1") if variant.name != "ep1" else None,
        "loss_rel_diff_vs_ep1": loss_diff(ok, variant.name, "ep1") if variant.name != "ep1" else None}


def mib(b):
    return "-" if b is None else f"{b / MiB:.2f}"


def size(b):
    """Bytes as MiB, or as bytes below 0.01 MiB (the counts' exchange)."""
    return "-" if b is None else f"{b / MiB:.2f} MiB" if b >= MiB / 100 else f"{b:.0f} B"


def against(got, book):
    """'1.00x (exact)' when every kept step's count is the textbook's, else the median's ratio."""
    if not book or got is None:
        return "-"
    exact = got["min"] == got["max"] == book
    return "1.00x (exact)" if exact else f"{got['median'] / book:.4f}x"


def section(summary, fmt_ratio):
    """results.md's expert-parallel section ([] without expert variants)."""
    eps = {n: v for n, v in summary.items() if v.get("expert_parallel")}
    if not eps:
        return []
    rows, kind_rows = [], []
    for name, v in eps.items():
        e, c, t = v["expert_parallel"], v["comm"], v["textbook"]
        reduced, diff = c.get("comm_all_reduce_bytes", 0), e["loss_rel_diff_vs_ep1"]
        rows.append([name, e["impl"], f"{e['ep']} x {e['dp'] // e['ep']}",
                     fmt_ratio(e["vs_ep1"]) if name != "ep1" else "baseline",
                     f"{e['experts'] // e['ep']} of {e['experts']}", mib(v["state_bytes"]),
                     mib(t["state_bytes"]), mib(reduced), mib(t["all_reduce_bytes"]),
                     "-" if e["load_max"] is None else f"{e['load_max']:.2f}",
                     "-" if diff is None else f"{diff:.1e}"])
        for kind, book in t["exchange_bytes"].items():
            got = e["exchange"].get(f"comm_{kind}_bytes")
            kind_rows.append([name, KINDS.get(kind, kind), format(c.get(f"comm_{kind}_calls", 0), "g"),
                              size(got and got["median"]), size(book), against(got, book),
                              size(t["exchange_wire_bytes"][kind])])
    return ["", "## Expert parallelism (per optimizer step)", "",
            *table(["variant", "exchange", "ep x expert-gradient ranks", "step time vs ep1",
                    "experts per rank", "state MiB", "textbook state MiB",
                    "gradient all-reduce MiB", "textbook MiB", "busiest expert / mean",
                    "loss rel. diff vs ep1"], rows, "lll" + "r" * 8),
            "", *table(["variant", "tokens' exchange", "calls, rank 0", "rank 0",
                        "textbook per rank", "rank 0 / textbook", "textbook wire per rank"],
                       kind_rows, "ll" + "r" * 5),
            "", "- ep x expert-gradient ranks: each rank holds E/ep experts of every MoE block; "
            "the ranks holding the same ones average their gradients (dp/ep of them), the "
            "dense gradients go over all dp ranks (textbook: a ring all-reduce of each, rank 0; "
            "state: 16 bytes per parameter held). Busiest expert / mean: the worst block's "
            "`moe_load_max`, median over steps (1.00 = every expert equally chosen).",
            "- the tokens' exchange, rank 0's as parallel/comm.py counts it (all-to-all: this "
            "rank's own tokens' rows, what the dispatch sends and the combine brings back; "
            "all-gather: the output; reduce-scatter: the input), median over the kept steps; "
            "exact: every kept step's count is the textbook's. Per rank, N = the global "
            "batch's tokens / dp ranks: all-to-all 4 x N x top-k x width x 4 bytes x MoE "
            "blocks (dispatch and combine, forward and backward), plus E int64 counts per "
            "block and micro-batch; all-gather reference ep x N x (1 + k) rows gathered per "
            "block and direction, as many reduce-scattered. Wire: what a rank sends others, "
            "(ep-1)/ep of that (the all-to-all's on average: what a rank hands back follows "
            "the routing)."]
