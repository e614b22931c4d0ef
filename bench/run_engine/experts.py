"""Expert parallelism in bench.run (`--preset ep --model moe`): the textbook bytes, each
variant's figures for the summary, and the results.md section.

The tokens' exchange is compared summed over every rank (the jobs' `all_ranks`, written by
every_rank.py): under the all-to-all each rank hands over its own tokens' k rows and, in
the combine, as many rows as the routing sent it, so rank 0's share moves with the routing
while the sum over ranks does not.
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
    """Per optimizer step on n ranks (dp = n, ep of them in each expert-parallel group),
    global batch B x T tokens, each to k experts, width C, L MoE blocks, M micro-batches:

    - exchange (`exchange_bytes`, summed over all ranks, as parallel/comm.py counts it):
      all-to-all: 4 x B x T x k x C x 4 bytes x L (each choice's row out and back, forward
      and backward; a rank's rows for itself included); the counts, E int64 per rank, block
      and micro-batch. All-gather reference: per block and direction ep x (this rank's
      tokens) x (1 + k) x C x 4 gathered and as much reduce-scattered on each rank (the
      tokens and the choices' outputs), summed: ep x B x T x (1 + k) x C x 4 x L each.
      `exchange_wire_bytes`: what a rank sends to others, on average: (ep-1)/ep of its share.
    - gradients (rank 0): the dense ones all-reduced over the n data-parallel ranks, the
      experts' (E/ep of them) over the n/ep ranks holding the same ones; state 16 bytes per
      parameter held. The rest of the dict as planner.formulas.textbook's."""
    m, t = cfg.model, cfg.trainer
    C, k, E, L, M = m.n_embd, m.moe_top_k, m.moe_experts, moe_blocks(m), t.grad_accum
    tokens = t.batch_size * cfg.data.block_size
    if ep == 1:
        exchange = {}
    elif impl == "allgather":
        each = ep * tokens * (1 + k) * C * 4 * L
        exchange = {"all_gather": each, "reduce_scatter": each}
    else:
        exchange = {"all_to_all": 4 * tokens * k * C * 4 * L, "all_to_all_counts": n * M * L * E * 8}
    held = expert // ep
    dense_book, expert_book = textbook(dense, n, 0), textbook(held, n // ep, 0)
    reduce = dense_book["payload_bytes"] + expert_book["payload_bytes"]
    wire = {kind: (ep - 1) / ep * b / n for kind, b in exchange.items()}
    return {"grad_bytes": 4 * (dense + expert), "state_bytes": 16 * (dense + held),
            "all_reduce_bytes": reduce,
            "all_reduce_wire_bytes": dense_book["wire_bytes"] + expert_book["wire_bytes"],
            "exchange_bytes": exchange, "exchange_wire_bytes": wire,
            "payload_bytes": reduce + sum(exchange.values()) / n,
            "wire_bytes": dense_book["wire_bytes"] + expert_book["wire_bytes"] + sum(wire.values())}


def figures(variant, ranks, mine, recs, warmup, cfg, model, ratio, loss_diff, ok, by_round):
    """(textbook, the summary's `expert_parallel`) of an expert variant, or None: a variant
    without parallel.ep, or a dense model. mine: its good jobs; recs: their kept records;
    ratio and loss_diff: stats' functions."""
    keys = expert_keys(variant, ranks)
    if keys is None or model is None or not cfg.model.moe_experts:
        return None
    ep, impl = keys
    dense, expert = parameter_split(model)
    summed = [step for j in mine if j.get("all_ranks") for step in j["all_ranks"][warmup:]]
    kinds = sorted({k for s in summed for k in s if k.startswith("comm_")})
    all_ranks = {k: {"median": median(s.get(k, 0) for s in summed),
                     "min": min(s.get(k, 0) for s in summed),
                     "max": max(s.get(k, 0) for s in summed)} for k in kinds} if summed else None
    loads = [r["moe_load_max"] for r in recs if "moe_load_max" in r]
    return ep_textbook(cfg, dense, expert, ep, ranks, impl), {
        "ep": ep, "impl": impl if ep > 1 else "-", "dp": ranks, "experts": cfg.model.moe_experts,
        "dense_params": dense, "expert_params": expert, "all_ranks": all_ranks,
        "load_max": median(loads) if loads else None,
        "vs_ep1": ratio(by_round, variant.name, "ep1") if variant.name != "ep1" else None,
        "loss_rel_diff_vs_ep1": loss_diff(ok, variant.name, "ep1") if variant.name != "ep1" else None}


def mib(b):
    return "-" if b is None else f"{b / MiB:.2f}"


def against(got, book):
    """'1.00x (exact)' when every step's sum is the textbook's, else the ratio of the median."""
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
        every = e["all_ranks"] or {}
        for kind, book in t["exchange_bytes"].items():
            got = every.get(f"comm_{kind}_bytes")
            kind_rows.append([name, KINDS.get(kind, kind), format(c.get(f"comm_{kind}_calls", 0), "g"),
                              mib(c.get(f"comm_{kind}_bytes", 0)), mib(got and got["median"]),
                              mib(book), against(got, book), mib(t["exchange_wire_bytes"][kind])])
    return ["", "## Expert parallelism (per optimizer step)", "",
            *table(["variant", "exchange", "ep x expert-gradient ranks", "step time vs ep1",
                    "experts per rank", "state MiB", "textbook state MiB",
                    "gradient all-reduce MiB", "textbook MiB", "busiest expert / mean",
                    "loss rel. diff vs ep1"], rows, "lll" + "r" * 8),
            "", *table(["variant", "tokens' exchange", "calls, rank 0", "rank 0 MiB",
                        "all ranks MiB", "textbook, all ranks MiB", "all ranks / textbook",
                        "textbook wire per rank MiB"], kind_rows, "ll" + "r" * 6),
            "", "- ep x expert-gradient ranks: each rank holds E/ep experts of every MoE block; "
            "the ranks holding the same ones average their gradients (dp/ep of them), the "
            "dense gradients go over all dp ranks (textbook: a ring all-reduce of each, rank 0; "
            "state: 16 bytes per parameter held). Busiest expert / mean: the worst block's "
            "`moe_load_max`, median over steps (1.00 = every expert equally chosen).",
            "- the tokens' exchange, as parallel/comm.py counts it (all-to-all: the rows a rank "
            "hands over, its own share included; all-gather: the output; reduce-scatter: the "
            "input), rank 0's and summed over every rank (every_rank.py), medians over the kept "
            "steps; exact: every kept step's sum is the textbook's. All-to-all textbook: 4 x "
            "tokens of the global batch x top-k x width x 4 bytes x MoE blocks (dispatch and "
            "combine, forward and backward), plus E int64 counts per rank, block and "
            "micro-batch. One rank's share is not fixed: it hands over its own tokens' k rows "
            "(dispatch forward, combine backward) and as many rows as the routing sent its "
            "experts (combine forward, dispatch backward). All-gather reference: ep x "
            "a rank's tokens x (1 + k) rows gathered per block and direction, as many "
            "reduce-scattered. Wire: what a rank sends others on average, (ep-1)/ep of its "
            "share."]
