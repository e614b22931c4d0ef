"""mode=plan: predict every layout, refuse what does not fit, rank the rest, print the top.

`plan(cfg)` is all main.py calls: no process group, no training, no GPU.
"""

import dataclasses
import json
import time

from errors import UserError
from planner.figures import metrics_names, rank_figures
from planner.layouts import valid_layouts, with_grad_accum, refusal
from planner.machines import machine
from planner.memory import memory_need
from planner.shapes import Workload
from planner.step_time import bytes_by_link, spans_nodes, step_time

GPT2_VOCAB = 50257  # tiktoken's "gpt2" encoding (data/tokenizer.py): no files needed to plan
PARTS = {"compute": "compute", "bubble": "pipeline bubble", "tp": "TP collectives",
         "cp": "cp ring", "pp": "pipeline sends", "dp": "exposed gradient sync",
         "host": "offloaded optimizer step"}
GB = 1e9


def workload(cfg) -> Workload:
    vocab = cfg.plan.vocab_size
    if not vocab:
        if cfg.data.tokenizer == "gpt2":
            vocab = GPT2_VOCAB
        else:
            from char_dataset import build_tokenizer, load_text
            vocab = build_tokenizer("char", load_text(cfg.data.path)).vocab_size
    m = cfg.model
    return Workload(m.n_layer, m.n_head, m.n_embd, vocab, cfg.data.block_size,
                    cfg.trainer.batch_size, cfg.trainer.precision, m.bias)


def check(cfg, gpu):
    p = cfg.plan
    if p.nodes < 1 or p.gpus_per_node < 1:
        raise UserError(f"plan.nodes={p.nodes} and plan.gpus_per_node={p.gpus_per_node} must be >= 1")
    if not 0 < p.mfu <= 1:
        raise UserError(f"plan.mfu={p.mfu} must be in (0, 1]: the fraction of peak FLOP/s reached")
    if cfg.trainer.precision not in gpu.peak:
        raise UserError(f"plan.gpu={gpu.name} has no {cfg.trainer.precision} peak (it has "
                        f"{', '.join(gpu.peak)}): set trainer.precision or plan.peak_*_tflops")
    if min(p.gpu_memory_gb, p.peak_bf16_tflops, p.peak_fp32_tflops, p.intra_node_gbps,
           p.inter_node_gbps, p.pcie_gbps, p.host_gbps) < 0 or p.top < 1:
        raise UserError("plan.gpu_memory_gb, plan.peak_*_tflops and plan.*_node_gbps must be >= 0 "
                        "(0 = the preset's), plan.top >= 1")


def evaluate(cfg, w, L, gpu, world):
    """The row of layout L: the smallest trainer.grad_accum (1, 2, 4, ...) at which the
    fullest rank fits in memory, or L as given if none does."""
    usable = gpu.memory_gb * GB
    first = None
    ga = 1
    while w.batch % (L.dp * ga * L.M) == 0:
        La = with_grad_accum(L, ga)
        if ga == 1 or not refusal(cfg, La, world):
            figs = rank_figures(w, La)
            fig = figs["fullest"]
            row = {"layout": La, "fig": fig, "need": memory_need(w, La, fig)}
            first = first or row
            if row["need"] <= usable:
                row["time"] = step_time(w, La, fig, gpu, cfg.plan)
                return row
        ga *= 2
    return first


def hybrid_and_offloaded(cfg, w, rows, gpu, world):
    """Rows of two variants of fsdp layouts, each proposed only where it wins:
    - HSDP (parallel.dp_replicate): a layout whose shard group spans nodes, sharded in
      replica groups of one node's ranks instead (R the fewest groups that fit in a node;
      all-gathers and reduce-scatters on the fast links, one all-reduce across nodes),
      kept if its step is faster;
    - offload (parallel.offload): a layout that does not fit, kept if offloaded it fits."""
    G, out = cfg.plan.gpus_per_node, []
    for row in rows:
        L = row["layout"]
        if L.dp_kind != "fsdp":
            continue
        if cfg.plan.nodes > 1 and spans_nodes(L, ("dp", "cp"), G):
            R = next((r for r in range(2, L.dp + 1) if L.dp % r == 0 and world // r <= G), None)
            variant = dataclasses.replace(L, R=R) if R else None
            if variant and not refusal(cfg, variant, world):
                hybrid = evaluate(cfg, w, variant, gpu, world)
                if "time" in hybrid and ("time" not in row or
                                         hybrid["time"]["step_ms"] < row["time"]["step_ms"]):
                    out.append(hybrid)
        if "time" not in row:
            variant = dataclasses.replace(L, offload=True)
            if not refusal(cfg, variant, world):
                offloaded = evaluate(cfg, w, variant, gpu, world)
                if "time" in offloaded:
                    out.append(offloaded)
    return out


def reason(row, best):
    """Why `row` ranks below `best`, in words: the parts of the step that differ most."""
    t, b = row["time"], best["time"]
    delta = t["step_ms"] - b["step_ms"]
    if abs(delta) < 1e-9 * max(1.0, b["step_ms"]):
        # ties go to the layout that moves fewer bytes, then to the one needing less memory
        moved = (sum(row["fig"]["comm"].values()) - sum(best["fig"]["comm"].values())) / GB
        need = (row["need"] - best["need"]) / GB
        return (f"same time, moves {moved:+.3g} GB a step" if moved else "same time") + \
            (f", memory {need:+.3g} GB" if need else "")
    diffs = sorted(((t[k] - b[k], k) for k in PARTS), reverse=True)
    words = ", ".join(f"{PARTS[k]} {d:+.3g}" for d, k in diffs[:2] if d > 0.05 * delta)
    return f"{delta:+.3g} ms ({100 * delta / b['step_ms']:+.0f}%): {words}"


def plan(cfg):
    started = time.perf_counter()
    gpu = machine(cfg.plan)
    check(cfg, gpu)
    world = cfg.plan.nodes * cfg.plan.gpus_per_node
    w = workload(cfg)
    layouts = valid_layouts(cfg, world)
    valid = [L for L, why in layouts if not why]
    if not valid:
        raise UserError(f"no layout runs this model on {world} GPUs: "
                        f"{next(why for _, why in layouts)}")
    rows = [evaluate(cfg, w, L, gpu, world) for L in valid]
    variants = hybrid_and_offloaded(cfg, w, rows, gpu, world)
    rows += variants
    fits = sorted((r for r in rows if "time" in r), key=lambda r: (r["time"]["step_ms"], sum(r["fig"]["comm"].values()), r["need"]))
    if not fits:
        small = min(rows, key=lambda r: r["need"])
        raise UserError(f"no layout fits in {gpu.memory_gb:g} GB per GPU on {world} GPUs: the "
                        f"smallest, {small['layout'].name()}, needs {small['need'] / GB:.1f} GB "
                        "(more GPUs, a smaller model or batch, or plan.gpu_memory_gb)")
    best = fits[0]
    print(f"plan: GPT {w.n_layer} layers x {w.n_embd} wide, {w.n_head} heads, vocab {w.vocab}, "
          f"{w.block} tokens, global batch {w.batch}, {w.precision}; {cfg.plan.nodes} x "
          f"{cfg.plan.gpus_per_node} {gpu.name} ({gpu.memory_gb:g} GB, "
          f"{gpu.peak[w.precision] / 1e12:g} TFLOP/s {w.precision} at mfu {cfg.plan.mfu:g}, "
          f"{gpu.intra_node_gbps:g} GB/s in a node, {gpu.inter_node_gbps:g} across)")
    print(f"{len(layouts)} combinations, {len(valid)} run (parallel/layout.py's rules)"
          + (f" + {len(variants)} hybrid-sharded or offloaded where that wins" if variants else "")
          + f", {len(fits)} fit in memory")
    header = ("rank", "layout", "step ms", "state GB", "activ. GB", "need GB", "comm GB",
              "vs the first")
    table = [header]
    for i, r in enumerate(fits[:cfg.plan.top]):
        fig = r["fig"]
        table.append((str(i + 1), r["layout"].name(), f"{r['time']['step_ms']:.3g}",
                      f"{fig['state_bytes'] / GB:.3g}", f"{fig['activation_bytes'] / GB:.3g}",
                      f"{r['need'] / GB:.3g}", f"{sum(fig['comm'].values()) / GB:.3g}",
                      "fastest" if i == 0 else reason(r, best)))
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(widths[c]) if c in (1, 7) else cell.rjust(widths[c])
                        for c, cell in enumerate(row)).rstrip())
    print("run the first: " + " ".join(f"{k}={_value(v)}" for k, v in best["layout"].keys().items()))
    if cfg.plan.out:
        write_json(cfg.plan.out, rows, fits, gpu, world, cfg.plan.gpus_per_node)
        print(f"all {len(rows)} layouts that run written to {cfg.plan.out}")
    print(f"planned in {time.perf_counter() - started:.1f} s")


def _value(v):
    return str(v).lower() if isinstance(v, bool) else str(v)


def write_json(path, rows, fits, gpu, world, gpu_per_node):
    rank = {id(r): i + 1 for i, r in enumerate(fits)}
    out = []
    for r in rows:
        fig = r["fig"]
        item = {"layout": r["layout"].name(), **r["layout"].keys(), "world_size": world,
                "rank": rank.get(id(r)), "fits": "time" in r, "memory_bytes": r["need"],
                "fullest_rank": {"pp_rank": fig["pp_rank"], "dp_rank": fig["dp_rank"],
                                 "comm_bytes": sum(fig["comm"].values())},  # what ties rank by
                **metrics_names(fig),
                "comm_bytes_by_link": bytes_by_link(r["layout"], fig, gpu_per_node)}
        if "time" in r:
            item["step_ms"] = r["time"]["step_ms"]
            item["step_ms_parts"] = {k: r["time"][k] for k in PARTS}
            item["vs_first"] = reason(r, fits[0]) if rank[id(r)] > 1 else "fastest"
        else:
            item["refused"] = f"needs {r['need'] / GB:.2f} GB > {gpu.memory_gb:g} GB"
        out.append(item)
    out.sort(key=lambda o: (o["rank"] is None, o["rank"] or 0))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
