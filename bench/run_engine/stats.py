"""From the jobs' metrics.jsonl records to one summary per variant, plus textbook figures.

Metrics come from rank 0 only (the trainer logs on the main rank): step time is
rank 0's wall time of the whole optimizer step, which ends with a collective
(the loss average), so it is the slowest rank's time too; memory and traffic
are rank 0's, which is representative when ranks do the same work.
"""

import json
import math
import os
from dataclasses import asdict
from statistics import median

from bench.run_engine import experts
from planner.formulas import (WIRE_PER_PAYLOAD, cp_allgather_textbook, cp_kv_bytes,  # noqa: F401
                              cp_textbook, cp_with_gradients, textbook, tp_textbook)


def read_metrics(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def meta_gpt(cfg):
    """The GPT these jobs train, on the meta device (shapes only: no memory, no init
    cost), or None when the vocabulary cannot be known here."""
    import torch
    from char_dataset import build_tokenizer, load_text
    from model import GPT, GPTConfig
    try:
        vocab = build_tokenizer(cfg.data.tokenizer, load_text(cfg.data.path)).vocab_size
    except Exception as e:  # e.g. gpt2 tokenizer files missing: report without textbook figures
        print(f"note: cannot count parameters ({e}); textbook columns stay empty")
        return None
    with torch.device("meta"):
        return GPT(GPTConfig(**asdict(cfg.model), vocab_size=vocab, block_size=cfg.data.block_size))


def count_params(cfg):
    """Unique parameters of the GPT these jobs train (tied embedding counted once)."""
    model = meta_gpt(cfg)
    return model.num_params() if model is not None else None


def tp_parameters(cfg, tp):
    """Parameters on each rank under our tensor parallelism of degree tp, from the
    placements parallel/tensor_parallel/apply.py gives rank 0: {"split": elements of
    the tensors TP cuts (this rank's slice, vocabulary padding included),
    "replicated": elements of those every rank holds, "replicated_names": which}."""
    from types import SimpleNamespace

    import torch
    from parallel.comm import CommCounter
    from parallel.tensor_parallel.apply import apply_tensor_parallel
    model = meta_gpt(cfg)
    if model is None:
        return None
    grid = SimpleNamespace(tp_group=None, tp_size=tp, tp_rank=0, device=torch.device("cpu"))
    placements, _ = apply_tensor_parallel(model, grid, SimpleNamespace(sequence_parallel=False),
                                          CommCounter())
    out = {"split": 0, "split_canonical": 0, "replicated": 0, "replicated_names": set()}
    for p in placements.values():
        out["replicated" if p.tp_replicated else "split"] += math.prod(p.local_shape)
        if not p.tp_replicated:
            out["split_canonical"] += math.prod(p.shape)
        if p.tp_replicated:  # a block's "...ln_1.weight" -> "ln_1.weight"
            out["replicated_names"].add(".".join(p.name.split(".")[-2:]))
    out["replicated_names"] = sorted(out["replicated_names"])
    return out


def pp_textbook(cfg, pipe):
    """Pure pipeline, rank 0 per step: each activation its chunks send forward to another
    rank and each gradient they send back, one per micro-batch (together crossings x
    batch x tokens x width x 4 bytes, point to point: wire = payload; loop placement:
    2V - 1 crossings, zbv's V: 2), plus the tied embedding's gradient to the last stage
    when that is another rank, and the norm's scalar; state: 16 bytes per parameter of
    its chunks (blocks, embeddings)."""
    from parallel import model_plan
    from parallel.pipeline_parallel.schedules import (chunk_blocks, chunk_ranks, messages,
                                                      virtual_stages)
    model = meta_gpt(cfg)
    C, T, B = cfg.model.n_embd, cfg.data.block_size, cfg.trainer.batch_size
    named = dict(model.named_parameters())
    tied = named[model_plan.TIED].numel()
    P, schedule = pipe["P"], pipe["schedule"]
    V = virtual_stages(schedule, pipe["V"])
    ranks = chunk_ranks(schedule, P, V)
    mine = [c for c in range(P * V) if ranks[c] == 0]
    crossings = sum(dst != 0 for c in mine for kind in "FB"
                    for dst, _ in messages((kind, c, 0), ranks)[1])
    payload = crossings * B * T * C * 4 + (4 * tied if ranks[-1] != 0 else 0) + 4
    chunks = chunk_blocks(cfg.model.n_layer, P * V, cfg.parallel.pp_layers)
    prefixes = {pre for c in mine
                for pre in model_plan.chunk_prefixes(chunks[c], c == 0, c == P * V - 1)}
    params = sum(p.numel() for n, p in named.items() if any(n.startswith(pre) for pre in prefixes))
    return {"grad_bytes": 4 * params, "payload_bytes": payload, "wire_bytes": payload,
            "state_bytes": 16 * params}


def hybrid_keys(variant):
    """(parallel.dp_replicate, parallel.offload) of a variant."""
    keys = dict(o.split("=", 1) for o in variant.overrides)
    return int(keys.get("parallel.dp_replicate", 1)), keys.get("parallel.offload") == "true"


def hybrid_textbook(params, n, replicas, zero_stage):
    """ZeRO of `zero_stage` inside a replica group of n / replicas ranks (its textbook),
    plus the all-reduce of a gradient shard (4 bytes x params / group size) across the
    replica groups: a ring sends 2(R-1)/R of it. State: the group's formula."""
    if not params:
        return None
    group = n // replicas
    inside, shard = textbook(params, group, zero_stage), 4 * params / group
    across = 2 * (replicas - 1) / replicas * shard
    return {**inside, "payload_bytes": inside["payload_bytes"] + shard,
            "wire_bytes": inside["wire_bytes"] + across, "across_bytes": shard,
            "across_wire_bytes": across}


def kept(job, warmup):
    return job["records"][warmup:]


def job_median_ms(job, warmup):
    return median(r["step_ms"] for r in kept(job, warmup))


# an all-to-all's payload (parallel/comm.py: the rows handed over) includes the rank's own
# share, which stays: with even splits (n-1)/n of it travels
WIRE = {**WIRE_PER_PAYLOAD, "all_to_all": lambda n: (n - 1) / n,
        "all_to_all_counts": lambda n: (n - 1) / n}


def comm_per_step(records, n):
    """Median over steps of every comm_* counter, plus the ring wire estimate."""
    keys = sorted({k for r in records for k in r if k.startswith("comm_")})
    comm = {k: median(r.get(k, 0) for r in records) for k in keys}
    wire = 0.0
    for k, value in comm.items():
        kind = k[len("comm_"):-len("_bytes")] if k.endswith("_bytes") else None
        if kind and kind in WIRE:
            wire += value * WIRE[kind](n)
        elif kind:  # a collective this table does not know: count its payload once
            wire += value
    comm["wire_bytes_est"] = wire
    return comm


def ratio(by_round, a, b):
    """Median over rounds of (a's median step / b's median step) within the round."""
    per_round = [by_round[a, r] / by_round[b, r] for (name, r) in sorted(by_round)
                 if name == a and (b, r) in by_round]
    return {"median": median(per_round), "per_round": per_round} if per_round else None


def loss_diff(jobs, a, b):
    """Max relative per-step loss difference between the first good jobs of a and b:
    a fast variant that trains a different model is not a result."""
    first = {}
    for j in jobs:
        first.setdefault(j["variant"], j)
    if a not in first or b not in first:
        return None
    la, lb = ([r["loss"] for r in first[x]["records"]] for x in (a, b))
    if len(la) != len(lb):
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(la, lb))


def pipeline_shape(variant, ranks):
    """P, M, V and the schedule of a variant that runs a pipeline over all its ranks, or None."""
    keys = dict(o.split("=", 1) for o in variant.overrides)
    if "parallel.pp" not in keys:
        return None
    return {"P": ranks, "M": int(keys.get("parallel.microbatches", 1)),
            "V": int(keys.get("parallel.pp_virtual_stages", 1)),
            "schedule": keys.get("parallel.pp_schedule", "1f1b")}


def variant_sizes(variant, ranks):
    """The grid's {dimension: degree} of a variant on `ranks` ranks: its parallel.<dim>
    overrides, the data-parallel degree as parallel/layout.grid_sizes computes it."""
    from parallel.config import ParallelConfig
    from parallel.layout import MODEL_DIMS, grid_sizes
    keys = dict(o.split("=", 1) for o in variant.overrides)
    return grid_sizes(ParallelConfig(**{d: int(keys.get(f"parallel.{d}", 1)) for d in MODEL_DIMS}),
                      ranks)


def context_degree(variant):
    """parallel.cp of a variant (1 when it does not set it)."""
    keys = dict(o.split("=", 1) for o in variant.overrides)
    return int(keys.get("parallel.cp", 1))


def context_impl(variant):
    """parallel.cp_impl of a variant: ring (ours, the default) or allgather (the reference)."""
    return dict(o.split("=", 1) for o in variant.overrides).get("parallel.cp_impl", "ring")


CP_TEXTBOOKS = {"ring": cp_textbook, "allgather": cp_allgather_textbook}


def pipeline_figures(variant, ranks, recs, jobs):
    """Measured bubble (pp_bubble: the idle share of the schedule, mean over stages) and
    busy/idle per stage, beside the textbook (P-1)/(M+P-1), divided by V interleaved, and
    the schedule's own bubble in the unit-time model (F = B = W, a whole backward 2:
    pipeline_parallel/simulator.unit_time; for zb1p and zbv the only formula that fits);
    the first job's timeline of its last step. None for a variant without a pipeline."""
    shape = pipeline_shape(variant, ranks)
    if not recs or "pp_bubble" not in recs[0]:
        return None
    P, M, V = shape["P"], shape["M"], shape["V"]
    stages = sorted(int(k[len("pp_busy_ms_stage"):]) for k in recs[0] if k.startswith("pp_busy_ms_stage"))
    from parallel.pipeline_parallel.schedules import virtual_stages
    from parallel.pipeline_parallel.simulator import unit_time
    V = virtual_stages(shape["schedule"], V)
    return {**shape, "V": V, "bubble": median(r["pp_bubble"] for r in recs),
            "textbook_bubble": (P - 1) / (M + P - 1) / V,
            "unit_time_bubble": unit_time(shape["schedule"], P, M, V)[1],
            "busy_ms": [median(r[f"pp_busy_ms_stage{s}"] for r in recs) for s in stages],
            "idle_ms": [median(r[f"pp_idle_ms_stage{s}"] for r in recs) for s in stages],
            "timeline": next((j["timeline"] for j in jobs if j.get("timeline")), None)}


def compile_figures(variant, mine, ok, by_round):
    """trainer.compile jobs: per round, the time step 1 spent compiling and the whole
    step 1; code objects compiled and recompiles (the last record's counts); the loss
    against the same layout eager (its reference); per-block against whole-model
    compilation when both ran. None for an eager variant."""
    firsts = [j["records"][0] for j in mine if j["records"] and "compile_ms" in j["records"][0]]
    if not firsts:
        return None
    last = mine[0]["records"][-1]
    return {"compile_s_per_round": [r["compile_ms"] / 1000 for r in firsts],
            "step1_s_per_round": [r["step_ms"] / 1000 for r in firsts],
            "job_s_per_round": [j["seconds"] for j in mine],
            "frames": last.get("compile_frames"), "recompiles": last.get("compile_recompiles"),
            "loss_rel_diff_vs_reference": loss_diff(ok, variant.name, variant.reference)
            if variant.reference else None,
            "vs_whole_model": ratio(by_round, variant.name, variant.name + "_model")
            if variant.name.startswith("single") and not variant.name.endswith("_model") else None}


def summarize(jobs, variants, params, warmup, cfg=None):
    """variants: [(Variant, ranks, threads)]; failed jobs are left out of every figure.
    cfg: the jobs' config (model, data, batch), for the tensor-parallel figures."""
    ok = [j for j in jobs if j["ok"]]
    by_round = {(j["variant"], j["round"]): job_median_ms(j, warmup) for j in ok}
    moe_model = meta_gpt(cfg) if cfg is not None and params and cfg.model.moe_experts else None
    out = {}
    for v, ranks, threads in variants:
        mine = [j for j in ok if j["variant"] == v.name]
        if not mine:
            continue
        recs = [r for j in mine for r in kept(j, warmup)]
        out[v.name] = {
            "ranks": ranks, "threads": threads, "reference": v.reference, "note": v.note,
            "jobs": len(mine), "steps_kept": len(recs),
            "step_ms": median(r["step_ms"] for r in recs),
            "step_ms_per_round": [by_round[v.name, j["round"]] for j in mine],
            "tokens_per_s": median(r["tokens_per_s"] for r in recs),
            "peak_mem_mb": max(r["peak_mem_mb"] for j in mine for r in j["records"]),
            "state_bytes": max(r["state_bytes"] for r in recs),
            "activation_peak_mb": max((r["activation_peak_mb"] for r in recs
                                       if "activation_peak_mb" in r), default=None),
            "comm": comm_per_step(recs, ranks),
            "vs_single": ratio(by_round, v.name, "single"),
            "vs_reference": ratio(by_round, v.name, v.reference) if v.reference else None,
            "loss_rel_diff_vs_single": loss_diff(ok, v.name, "single"),
            "textbook": textbook(params, ranks, v.zero_stage),
        }
        hosted = [r["host_state_bytes"] for r in recs if "host_state_bytes" in r]
        out[v.name]["host_state_bytes"] = max(hosted) if hosted else None
        replicas, offload = hybrid_keys(v)
        if replicas > 1 or offload:
            out[v.name]["hybrid"] = {"replicas": replicas, "shards": ranks // replicas,
                                     "offload": offload}
            if replicas > 1:
                out[v.name]["textbook"] = hybrid_textbook(params, ranks, replicas, v.zero_stage)
        out[v.name]["pipeline"] = pipeline_figures(v, ranks, recs, mine)
        compiled = compile_figures(v, mine, ok, by_round)
        if compiled:
            out[v.name]["compile"] = compiled
        # PyTorch's references communicate through torch, not our counted comm
        out[v.name]["traffic_counted"] = not any(
            o.startswith("parallel.dp=torch_") or o.endswith("_impl=torch") for o in v.overrides)
        if pipeline_shape(v, ranks) and cfg is not None and params:
            out[v.name]["textbook"] = pp_textbook(cfg, pipeline_shape(v, ranks))
        cp = context_degree(v)
        if cp > 1 and cfg is not None and params:
            impl = context_impl(v)
            out[v.name]["textbook"] = CP_TEXTBOOKS[impl](cfg, params, cp, ranks)
            # the same ranks splitting the batch instead: beside the reference, when it ran
            out[v.name]["context_parallel"] = {"cp": cp, "dp": variant_sizes(v, ranks)["dp"], "impl": impl,
                                               "vs_ddp_bucket": ratio(by_round, v.name, "ddp_bucket")}
        moe = experts.figures(v, ranks, recs, cfg, moe_model, ratio, loss_diff, ok, by_round)
        if moe:
            out[v.name]["textbook"], out[v.name]["expert_parallel"] = moe
        if v.tensor_parallel and cfg is not None and params:
            layout = tp_parameters(cfg, ranks)
            book = out[v.name]["textbook"] = {**tp_textbook(cfg, ranks),
                                             "grad_bytes": 4 * params}
            if layout:
                book["state_bytes"] = 16 * (layout["split"] + layout["replicated"])
                out[v.name]["tp_parameters"] = layout
    return out
