"""mode=plan: predict every layout, refuse what does not fit, rank the rest, print the top.

`plan(cfg)` is all main.py calls: no process group, no training, no GPU.
"""

import dataclasses
import json
import time

from errors import UserError
from planner.command import dryrun_command, run_command
from planner.figures import metrics_names, rank_figures
from planner.layouts import RECOMPUTE_CHOICES, refusal, valid_layouts, with_grad_accum
from planner.efficiency import MOE_IMBALANCE, STACKS
from planner.residuals import BANDS
from planner.machines import machine
from planner.memory import memory_need
from planner.shapes import Layout, Workload
from planner.step_time import bytes_by_link, spans_nodes, step_time

GPT2_VOCAB = 50257  # tiktoken's "gpt2" encoding (data/tokenizer.py): no files needed to plan
PARTS = {"compute": "compute", "bubble": "pipeline bubble", "tp": "TP collectives",
         "cp": "cp ring", "pp": "pipeline sends", "dp": "exposed gradient sync",
         "host": "offloaded optimizer step", "ep": "expert all-to-all"}
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
    p = cfg.plan
    stack = p.stack or ("compiled" if cfg.trainer.compile else "eager")
    return Workload(m.n_layer, m.n_head, m.n_embd, vocab, cfg.data.block_size,
                    cfg.trainer.batch_size, cfg.trainer.precision, m.bias, m.moe_experts,
                    m.moe_top_k, m.moe_every, m.moe_hidden, m.vocab_pad_to, p.kv_heads,
                    p.ffn_hidden, p.gated_ffn, p.untied_head, p.param_gather_bytes,
                    p.loss_kernel or ("eager" if stack == "eager" else "fused"))


def check(cfg, gpu):
    p = cfg.plan
    if p.nodes < 1 or p.gpus_per_node < 1:
        raise UserError(f"plan.nodes={p.nodes} and plan.gpus_per_node={p.gpus_per_node} must be >= 1")
    if not 0 <= p.mfu <= 1:
        raise UserError(f"plan.mfu={p.mfu} must be in [0, 1]: 0 = the efficiency model's compute "
                        "time, else the fraction of peak FLOP/s assumed")
    if cfg.trainer.precision not in gpu.peak:
        raise UserError(f"plan.gpu={gpu.name} has no {cfg.trainer.precision} peak (it has "
                        f"{', '.join(gpu.peak)}): set trainer.precision or plan.peak_*_tflops")
    if p.kernel_slowdown <= 0:
        raise UserError(f"plan.kernel_slowdown={p.kernel_slowdown} must be > 0: how many times the "
                        "efficiency model's kernel time this stack's kernels take (1 = fused kernels)")
    if p.param_gather_bytes not in (2, 4):
        raise UserError(f"plan.param_gather_bytes={p.param_gather_bytes} must be 4 (fp32 parameters "
                        "gathered, as this product does) or 2 (a bf16 copy, as Megatron's distributed "
                        "optimizer does)")
    if p.stack not in ("",) + STACKS:
        raise UserError(f"plan.stack={p.stack!r} must be one of {', '.join(STACKS)} (or empty: this "
                        "product's own, eager or compiled by trainer.compile)")
    if p.loss_kernel not in ("", "fused", "eager"):
        raise UserError(f"plan.loss_kernel={p.loss_kernel!r} must be fused or eager (or empty: "
                        "eager under plan.stack=eager, else fused)")
    if p.grad_reduce_bytes not in (2, 4):
        raise UserError(f"plan.grad_reduce_bytes={p.grad_reduce_bytes} must be 4 (fp32 gradients "
                        "reduced, this product's default) or 2 (bf16)")
    foreign = p.kv_heads or p.ffn_hidden or p.gated_ffn or p.untied_head
    if foreign and cfg.model.moe_experts:
        raise UserError("plan.kv_heads, ffn_hidden, gated_ffn and untied_head replay dense blocks "
                        "only: not with model.moe_experts")
    if p.kv_heads and (p.kv_heads < 0 or cfg.model.n_head % p.kv_heads
                       or p.kv_heads % cfg.parallel.tp):
        raise UserError(f"plan.kv_heads={p.kv_heads} must divide model.n_head={cfg.model.n_head} "
                        f"and be divisible by parallel.tp={cfg.parallel.tp}")
    if p.ffn_hidden < 0 or p.ffn_hidden % cfg.parallel.tp:
        raise UserError(f"plan.ffn_hidden={p.ffn_hidden} must be >= 0 and divisible by parallel.tp")
    if p.untied_head and (cfg.parallel.pp > 1 or p.search):
        raise UserError("plan.untied_head is not modelled under a pipeline: replay it with "
                        "plan.search=false and parallel.pp=1")
    if min(p.gpu_memory_gb, p.peak_bf16_tflops, p.peak_fp32_tflops, p.intra_node_gbps,
           p.inter_node_gbps, p.pcie_gbps, p.host_gbps, p.hbm_gbps, p.intra_latency_us,
           p.inter_latency_us, p.nics_per_node) < 0 or p.top < 1:
        raise UserError("plan.gpu_memory_gb, plan.peak_*_tflops, plan.*_gbps and plan.*_latency_us "
                        "must be >= 0 "
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


def with_recompute(cfg, w, rows, gpu, world):
    """Rows of each layout's recompute variants (layouts.RECOMPUTE_CHOICES: full,
    selective, full on every 2nd block, selective on every 2nd), tried only where the
    layout without recompute needs gradient accumulation or does not fit: where it fits
    in one pass, recomputing only adds compute (each variant would be slower at the same
    grad_accum), so it cannot win."""
    out = []
    for row in rows:
        L = row["layout"]
        if L.ckpt or ("time" in row and row["layout"].grad_accum == 1):
            continue
        for mode, every in RECOMPUTE_CHOICES:
            variant = dataclasses.replace(L, grad_accum=1, ckpt=True, ckpt_mode=mode, ckpt_every=every)
            if not refusal(cfg, variant, world):
                out.append(evaluate(cfg, w, variant, gpu, world))
    return out


def hybrid_and_offloaded(cfg, w, rows, gpu, world):
    """Rows of two variants of fsdp layouts, each proposed only where it wins:
    - HSDP (parallel.dp_replicate): a layout whose shard group spans nodes, sharded in
      replica groups of one node's ranks instead (R the fewest groups that fit in a node;
      all-gathers and reduce-scatters on the fast links, one all-reduce across nodes),
      kept if its step is faster;
    - offload (parallel.offload): a layout that does not fit, kept if offloaded it fits.
    Hook for issue 33's fault-tolerant replica groups (torchft): a third variant here,
    HSDP's replica groups with their cross-group all-reduce priced as "dpr" is."""
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


GENERATIONS = {"ampere": "A100", "hopper": "H100", "ada": "L4", "volta": "V100",
               "blackwell": "B200"}


def band(gpu, stack):
    """(lowest, highest predicted / published step of the published runs of this kind, runs,
    the kind in words) from planner/residuals.py: the GPU's generation and the stack; a
    kind with fewer than 3 runs widens to the generation's; None where no run is of it."""
    rows = BANDS.get((gpu.generation, stack))
    words = f"{GENERATIONS.get(gpu.generation, gpu.generation)}s, {stack} kernels"
    if not rows or rows[2] < 3:
        same = [b for (g, _), b in BANDS.items() if g == gpu.generation]
        if not same:
            return None
        rows = (min(b[0] for b in same), max(b[1] for b in same), sum(b[2] for b in same))
        words = f"{GENERATIONS.get(gpu.generation, gpu.generation)}s, every stack"
    return rows + (words,)


def likely(ms, b):
    """The step's likely range in ms: the prediction over the band's ratios."""
    return (ms / b[1], ms / b[0]) if b else None


def band_words(b):
    if b is None:
        return "no published run of this kind to say how far off it may be"
    return (f"published runs of this kind ({b[3]}, {b[2]} runs) were predicted at "
            f"{b[0]:.2f}-{b[1]:.2f}x their measured steps")


def header(cfg, w, gpu):
    compute = f"mfu {cfg.plan.mfu:g} assumed" if cfg.plan.mfu else f"{cfg.plan.stack} kernels"
    print(f"plan: GPT {w.n_layer} layers x {w.n_embd} wide, {w.n_head} heads, vocab {w.vocab}, "
          f"{w.block} tokens, global batch {w.batch}, {w.precision}; {cfg.plan.nodes} x "
          f"{cfg.plan.gpus_per_node} {gpu.name} ({gpu.memory_gb:g} GB, "
          f"{gpu.peak[w.precision] / 1e12:g} TFLOP/s {w.precision}, {gpu.hbm_gbps:g} GB/s memory, "
          f"{compute}; {gpu.intra_node_gbps:g} GB/s in a node, {gpu.nics_per_node} x "
          f"{gpu.inter_node_gbps:g} GB/s network cards a node)")
    if gpu.generation not in ("ampere", "hopper"):
        print(f"{gpu.name}: no published efficiency of its generation ({gpu.generation}) is used: "
              "the A100's matmul and attention shares of its peak are assumed")
    if w.foreign:
        print(f"replaying another system's block (model.py trains GPT-2's): {w.kv_heads or w.n_head} "
              f"K/V heads, MLP {w.ffn} wide{' gated (SwiGLU)' if w.gated else ''}"
              f"{', untied LM head' if w.untied else ''}; planned, not runnable here")
    if w.experts:
        print(f"experts: {w.n_layer // w.every} of {w.n_layer} blocks, {w.experts} experts of "
              f"{w.expert_hidden} wide, {w.top_k} active a token (MFU counts those); the busiest "
              f"ep rank takes {MOE_IMBALANCE:g} x the even split (moe_imbalance, assumed)")


def plan(cfg):
    started = time.perf_counter()
    gpu = machine(cfg.plan)
    check(cfg, gpu)
    if not cfg.plan.stack:  # this product's own: PyTorch eager, or Inductor's kernels
        cfg.plan = dataclasses.replace(cfg.plan, stack="compiled" if cfg.trainer.compile else "eager")
    world = cfg.plan.nodes * cfg.plan.gpus_per_node
    w = workload(cfg)
    if not cfg.plan.search:
        row = evaluate_given(cfg, w, gpu, world)
        header(cfg, w, gpu)
        print_breakdown(row, gpu, world)
        if cfg.plan.out:
            write_json(cfg.plan.out, [row], [row] if "time" in row else [], gpu, world,
                       cfg.plan.gpus_per_node)
            print(f"the layout written to {cfg.plan.out}")
        return row
    layouts = valid_layouts(cfg, world)
    valid = [L for L, why in layouts if not why]
    if not valid:
        raise UserError(f"no layout runs this model on {world} GPUs: "
                        f"{next(why for _, why in layouts)}")
    rows = [evaluate(cfg, w, L, gpu, world) for L in valid]
    recomputed = with_recompute(cfg, w, rows, gpu, world)
    rows += recomputed
    variants = hybrid_and_offloaded(cfg, w, rows, gpu, world)
    rows += variants
    fits = sorted((r for r in rows if "time" in r), key=lambda r: (r["time"]["step_ms"], sum(r["fig"]["comm"].values()), r["need"]))
    if not fits:
        small = min(rows, key=lambda r: r["need"])
        raise UserError(f"no layout fits in {gpu.memory_gb:g} GB per GPU on {world} GPUs: the "
                        f"smallest, {small['layout'].name()}, needs {small['need'] / GB:.1f} GB "
                        "(more GPUs, a smaller model or batch, or plan.gpu_memory_gb)")
    best = fits[0]
    header(cfg, w, gpu)
    print(f"{len(layouts)} combinations, {len(valid)} run (parallel/layout.py's rules)"
          + (f" + {len(recomputed)} recomputing where they need it" if recomputed else "")
          + (f" + {len(variants)} hybrid-sharded or offloaded where that wins" if variants else "")
          + f", {len(fits)} fit in memory")
    b = None if cfg.plan.mfu else band(gpu, cfg.plan.stack)
    print("likely ms: step ms over how far off the model was where " + band_words(b)
          if b else f"likely ms: none, {band_words(b)}")
    for r in rows:
        r["band"] = b
    print_table(fits[:cfg.plan.top], best, w.experts)
    fewer = fewer_gpus(cfg, w, gpu, world, best)
    if fewer:
        print(fewer)
    print("run the first: " + run_command(cfg, best["layout"]))
    print("try it here first: " + dryrun_command(cfg, best["layout"]))
    if cfg.plan.out:
        write_json(cfg.plan.out, rows, fits, gpu, world, cfg.plan.gpus_per_node)
        print(f"all {len(rows)} layouts that run written to {cfg.plan.out}")
    print(f"planned in {time.perf_counter() - started:.1f} s")
    return best


def print_table(rows, best, experts):
    """The ranked layouts; with experts, ep and the all-to-all's milliseconds too."""
    moe = ("ep", "a2a ms") if experts else ()
    head = ("rank", "layout", "step ms", "likely ms", "MFU") + moe + (
        "state GB", "activ. GB", "need GB", "comm GB", "vs the first")
    table = [head]
    for i, r in enumerate(rows):
        fig, t = r["fig"], r["time"]
        cells = (str(r["layout"].ep), f"{t['ep']:.3g}") if experts else ()
        span = likely(t["step_ms"], r.get("band"))
        table.append((str(i + 1), r["layout"].name(), f"{t['step_ms']:.3g}",
                      f"{span[0]:.3g}-{span[1]:.3g}" if span else "-",
                      f"{100 * t['mfu']:.0f}%") + cells +
                     (f"{fig['state_bytes'] / GB:.3g}", f"{fig['activation_bytes'] / GB:.3g}",
                      f"{r['need'] / GB:.3g}", f"{sum(fig['comm'].values()) / GB:.3g}",
                      "fastest" if i == 0 else reason(r, best)))
    widths = [max(len(row[c]) for row in table) for c in range(len(head))]
    for row in table:
        print("  ".join(cell.ljust(widths[c]) if c in (1, len(head) - 1) else cell.rjust(widths[c])
                        for c, cell in enumerate(row)).rstrip())


AS_FAST = 1.05  # a step within 5% of the first choice's counts as as fast


def fewer_gpus(cfg, w, gpu, world, best):
    """A line when fewer GPUs would be as fast as the first choice: the fewest (1, 2, 4, ...
    dividing the world) on which plain data parallelism (`single` on one) steps within
    AS_FAST of it; a model too small to fill a GPU is bound by launches and latencies,
    not by FLOPs, so more GPUs only add collectives. "" when none would."""
    for n in (d for d in (2 ** k for k in range(world.bit_length())) if d < world and world % d == 0):
        L = Layout(dp_kind="single") if n == 1 else Layout(dp_kind="ddp_bucket", dp=n)
        if refusal(cfg, L, n):
            continue
        row = evaluate(cfg, w, L, gpu, n)
        if "time" in row and row["time"]["step_ms"] <= AS_FAST * best["time"]["step_ms"]:
            return (f"fewer GPUs would be as fast: {n} ({row['layout'].name()}) at "
                    f"{row['time']['step_ms']:.3g} ms a step against {best['time']['step_ms']:.3g} "
                    f"on {world}: this model is too small to fill them")
    return ""


def given_layout(cfg, world) -> Layout:
    """The layout the configuration's parallel.* and trainer.* keys name (plan.search=false)."""
    p, t = cfg.parallel, cfg.trainer
    if p.dp not in ("single", "ddp_bucket", "fsdp"):
        raise UserError(f"plan.search=false models parallel.dp=single, ddp_bucket or fsdp, not {p.dp!r}")
    if world % (p.tp * p.pp * p.cp):
        raise UserError(f"plan.search=false: tp x pp x cp = {p.tp * p.pp * p.cp} does not divide "
                        f"the {world} GPUs of plan.nodes x plan.gpus_per_node")
    dp = world // (p.tp * p.pp * p.cp)
    pipe = p.pp > 1
    V = p.pp_virtual_stages if p.pp_schedule == "interleaved" else 2 if p.pp_schedule == "zbv" else 1
    return Layout(p.dp, p.zero_stage if p.dp == "fsdp" else 0, dp, p.pp, p.cp, p.tp,
                  p.sequence_parallel, p.pp_schedule if pipe else "1f1b", V if pipe else 1,
                  p.microbatches if pipe else 1, t.grad_accum, t.activation_checkpointing,
                  p.dp_replicate, p.offload, p.ep,
                  ckpt_mode=t.activation_checkpointing_mode,
                  ckpt_every=t.activation_checkpointing_every)


def evaluate_given(cfg, w, gpu, world):
    """The row of exactly the configured layout (predicted even if it does not fit)."""
    L = given_layout(cfg, world)
    why = refusal(cfg, L, world)
    if why:
        raise UserError(f"plan.search=false: the configured layout does not run: {why}")
    fig = rank_figures(w, L)["fullest"]
    row = {"layout": L, "fig": fig, "need": memory_need(w, L, fig)}
    row["time"] = step_time(w, L, fig, gpu, cfg.plan)
    row["fits"] = row["need"] <= gpu.memory_gb * GB
    row["band"] = None if cfg.plan.mfu else band(gpu, cfg.plan.stack)
    return row


def print_breakdown(row, gpu, world):
    """plan.search=false: one layout's step, part by part, and its memory per rank."""
    t, fig = row["time"], row["fig"]
    print(f"layout: {row['layout'].name()} on {world} GPUs")
    b = row.get("band")
    span = likely(t["step_ms"], b)
    print(f"step {t['step_ms']:.4g} ms, MFU {100 * t['mfu']:.1f}%"
          + (f"; likely {span[0]:.4g}-{span[1]:.4g} ms ({band_words(b)})" if span
             else f" ({band_words(b)})"))
    for k, words in PARTS.items():
        if t[k] or k in ("compute", "bubble"):
            print(f"  {words:<26} {t[k]:>10.4g} ms")
    fits = "fits" if row["fits"] else "does NOT fit"
    print(f"memory per rank (fullest: pipeline rank {fig['pp_rank']}): state "
          f"{fig['state_bytes'] / GB:.3g} GB + activations {fig['activation_bytes'] / GB:.3g} GB, "
          f"needs {row['need'] / GB:.3g} GB: {fits} in {gpu.memory_gb:g} GB")


def _value(v):
    return str(v).lower() if isinstance(v, bool) else str(v)


def write_json(path, rows, fits, gpu, world, gpu_per_node):
    rank = {id(r): i + 1 for i, r in enumerate(fits)}
    out = []
    for r in rows:
        fig = r["fig"]
        item = {"layout": r["layout"].name(), **r["layout"].keys(), "world_size": world,
                "rank": rank.get(id(r)), "fits": r.get("fits", "time" in r), "memory_bytes": r["need"],
                "fullest_rank": {"pp_rank": fig["pp_rank"], "dp_rank": fig["dp_rank"],
                                 "comm_bytes": sum(fig["comm"].values())},  # what ties rank by
                **metrics_names(fig),
                "comm_bytes_by_link": bytes_by_link(r["layout"], fig, gpu_per_node)}
        if r["layout"].ep > 1:
            item["moe_imbalance"] = MOE_IMBALANCE  # the all-to-all's and experts' time assumes it
        if "time" in r:
            item["step_ms"] = r["time"]["step_ms"]
            if r.get("band"):  # over the published runs of this kind (planner/residuals.py)
                item["step_ms_likely"] = list(likely(r["time"]["step_ms"], r["band"]))
                item["published_kind"] = r["band"][3]
            item["mfu"] = r["time"]["mfu"]
            item["step_ms_parts"] = {k: r["time"][k] for k in PARTS}
            item["vs_first"] = reason(r, fits[0]) if rank.get(id(r), 1) > 1 else "fastest"
        else:
            item["refused"] = f"needs {r['need'] / GB:.2f} GB > {gpu.memory_gb:g} GB"
        out.append(item)
    out.sort(key=lambda o: (o["rank"] is None, o["rank"] or 0))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
