"""bench.run's results.md: its tables and their notes, from stats.summarize's summary.

One function per section; markdown() puts them in order under bench.report's header.
"""

import re

from bench.report import header, table
from bench.run_engine import experts

MiB = 2**20


def fmt_ms(x):
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def fmt_ratio(r):
    if not r:
        return "-"
    lo, hi = min(r["per_round"]), max(r["per_round"])
    spread = f" ({lo:.2f}-{hi:.2f})" if len(r["per_round"]) > 1 else ""
    return f"{r['median']:.2f}x{spread}"


def fmt_mib(b):
    return "-" if b is None else f"{b / MiB:.2f}"


def last_line(text):
    """The line that says why a job failed: main.py's 'error...' line or a Python
    exception, not the banner torchrun prints after it."""
    lines = [ln.strip() for ln in text.splitlines() if any(c.isalpha() for c in ln)]
    why = [ln for ln in lines if re.match(r"error( on rank \d+)?: |\w*(Error|Exception)\b", ln)]
    return (why or lines or [""])[-1]


def step_time(summary):
    rows = []
    for name, v in summary.items():
        ref = f"{fmt_ratio(v['vs_reference'])} vs {v['reference']}" if v["reference"] else "-"
        diff = v["loss_rel_diff_vs_single"]
        rows.append([name, f"{v['ranks']} x {v['threads']}", fmt_ms(v["step_ms"]),
                     f"{v['tokens_per_s']:.0f}",
                     "baseline" if name == "single" else fmt_ratio(v["vs_single"]), ref,
                     "-" if diff is None else f"{diff:.1e}"])
    return ["", "## Step time", "",
            *table(["variant", "ranks x threads", "step ms", "tokens/s", "vs single",
                    "vs reference", "loss rel. diff vs single"], rows, "llrrrrr"),
            "", "Step ms and tokens/s: medians over every kept step of every round. Ratios: "
            "within each round, this variant's median step over the other's; then the median "
            "over rounds (min-max in brackets)."]


def communication(summary):
    rows = []
    for name, v in summary.items():
        c, t = v["comm"], v["textbook"] or {}
        counted = v.get("traffic_counted", True) and (c.get("comm_calls", 0) > 0 or v["ranks"] == 1)
        wire, book = c["wire_bytes_est"], t.get("wire_bytes")
        rows.append([name, format(c.get("comm_calls", 0), "g") if counted else "-",
                     fmt_mib(c.get("comm_bytes", 0)) if counted else "not counted",
                     fmt_mib(wire) if counted else "-", fmt_mib(book),
                     f"{wire / book:.2f}x" if counted and book else "-",
                     fmt_mib(v["state_bytes"]), fmt_mib(t.get("state_bytes")),
                     f"{v['peak_mem_mb']:.0f}"])
    return [
        "", "## Communication and memory (rank 0, per optimizer step)", "",
        *table(["variant", "comm calls", "payload MiB", "est. wire MiB", "textbook wire MiB",
                "wire / textbook", "state MiB", "textbook state MiB", "peak RSS MiB"],
               rows, "l" + "r" * 8),
        "", "- payload: bytes handed to collectives (parallel/comm.py: the all_reduce tensor, "
        "the all_gather output, the reduce_scatter input). Est. wire: what a ring algorithm "
        "would make one rank send for that payload (all-reduce 2(N-1)/N, all-gather and "
        "reduce-scatter (N-1)/N). Textbook wire: one gradient (4 bytes x params) all-reduced by "
        "a ring, 2(N-1)/N x gradient bytes, for DDP and ZeRO-1/2; 1.5x that for ZeRO-3 (TP and "
        "pipeline variants: their own textbook, see below).",
        "- 'not counted': PyTorch's own DDP/FSDP/TP/pipelining send through their own code, not "
        "our counter.",
        "- state: parameters + gradients + optimizer state on the rank at the end of a step "
        "(fp32 Adam: 16 bytes/param, /N for what a ZeRO stage shards). Peak RSS: max resident "
        "memory of rank 0's process (Python and torch included), max over the logged steps.",
    ]


def activations(summary):
    acts = {n: v["activation_peak_mb"] for n, v in summary.items() if v.get("activation_peak_mb")}
    if not acts:
        return []
    rows = [[name, f"{mb:.1f}", f"{mb / acts['single']:.2f}x" if acts.get("single") else "-"]
            for name, mb in acts.items()]
    return ["", "## Activation memory (rank 0, peak per step)", "",
            *table(["variant", "saved for backward MiB", "vs single"], rows, "lrr"),
            "", "- bytes of the tensors autograd holds for backward (activation_meter.py, "
            "`trainer.measure_activations=true`), peak within a step."]


def unit_time_bubble(p):
    """The schedule's bubble with F = B = W (simulator.unit_time), from the run's shape: a
    property of the schedule, so results written before it was recorded show it too."""
    if "unit_time_bubble" in p:
        return p["unit_time_bubble"]
    from parallel.pipeline_parallel.simulator import unit_time
    return unit_time(p["schedule"], p["P"], p["M"], p["V"])[1]


def pipelines(summary):
    pipes = {n: v["pipeline"] for n, v in summary.items() if v.get("pipeline")}
    if not pipes:
        return []
    rows = [[name, f"{p['P']} x {p['M']}" + (f" x {p['V']}" if p["V"] > 1 else ""),
             f"{p['bubble']:.3f}", f"{p['textbook_bubble']:.3f}",
             f"{unit_time_bubble(p):.3f}",
             " / ".join(f"{b:.1f}" for b in p["busy_ms"]),
             " / ".join(f"{i:.1f}" for i in p["idle_ms"])] for name, p in pipes.items()]
    lines = ["", "## Pipeline: bubble and busy time (per stage, median step)", "",
             *table(["variant", "P x M (x V)", "bubble measured", "textbook (P-1)/(M+P-1)/V",
                     "schedule, unit time", "busy ms per stage", "idle ms per stage"], rows,
                    "llrrrll"),
             "", "- bubble: the idle share of each stage's schedule (time waiting for a "
             "neighbour, from the start of the step's first action to the end of its last), "
             "averaged over stages; busy: time computing forwards and backwards. The "
             "textbook assumes equal stages, a backward costing what a forward does and "
             "free communication. Schedule, unit time: this schedule's own order run with "
             "F = B = W = 1 unit (a whole backward 2) and free messages "
             "(pipeline_parallel/simulator.unit_time): the bubble it should have; for zb1p "
             "and zbv, whose backward is split, the only fitting formula.",
             "- pipeline textbook traffic (rank 0, point to point, so wire = payload): one "
             "activation forward per micro-batch from each of its V chunks and one gradient "
             "back into each but the first, (2V-1) x batch x tokens x width x 4 bytes a "
             "step (zbv, whose rank 0 holds the first and the last chunk: 2), plus the tied "
             "embedding's gradient to the last stage (none under zbv) and the norm's "
             "scalar; textbook state: 16 bytes per parameter of rank 0's chunks."]
    if any(p["timeline"] for p in pipes.values()):
        lines += ["", "![pipeline timelines](pipeline_timeline.png)"]
    return lines


def tensor_parallel(summary):
    tp = {n: v for n, v in summary.items() if v.get("tp_parameters")}
    if not tp:
        return []
    rows = []
    for name, v in tp.items():
        t = v["tp_parameters"]
        rows.append([name, f"{t['split']:,} / {t['split_canonical']:,}",
                     f"{t['split'] / t['split_canonical']:.4f} (1/{v['ranks']} = "
                     f"{1 / v['ranks']:.4f})", f"{t['replicated']:,}",
                     ", ".join(t["replicated_names"])])
    return ["", "## Tensor parallelism: parameters per rank", "",
            *table(["variant", "split tensors: this rank / whole", "share",
                    "replicated tensors (every rank)", "which"], rows, "lrrrl"),
            "", "- split: elements of the weights TP cuts (attention and MLP matrices, "
            "their column-parallel biases, the vocabulary-padded embedding) held by one "
            "rank; replicated: elements every rank holds in full. For TP variants the "
            "textbook traffic is Megatron's: per layer and micro-batch four all-reduces of "
            "one activation (batch x tokens x width x 4 bytes), plus the embedding, the LM "
            "head input and the loss's scalars per token; textbook state: 16 bytes per "
            "local parameter."]


KV_KINDS = {"send": "ring sends", "all_gather": "all-gather (forward)",
            "reduce_scatter": "reduce-scatter (backward)"}


def context_parallel(summary):
    cps = {n: v for n, v in summary.items() if v.get("context_parallel")}
    if not cps:
        return []
    single = (summary.get("single") or {}).get("activation_peak_mb")
    rows, kv_rows = [], []
    for name, v in cps.items():
        c, t, info, act = v["comm"], v["textbook"], v["context_parallel"], v["activation_peak_mb"]
        cp, reduced = info["cp"], c.get("comm_all_reduce_bytes", 0)
        rows.append([name, info.get("impl", "ring"), f"{cp} x {info['dp']}",
                     fmt_ratio(info.get("vs_ddp_bucket")), fmt_mib(reduced),
                     fmt_mib(t["all_reduce_bytes"]),
                     f"{reduced / t['all_reduce_bytes']:.2f}x" if t["all_reduce_bytes"] else "-",
                     "-" if act is None else f"{act:.1f}",
                     f"{act / single:.2f}x (1/{cp} = {1 / cp:.2f})" if act and single else "-"])
        for kind, book in t["kv_bytes"].items():
            got = c.get(f"comm_{kind}_bytes", 0)
            kv_rows.append([name, KV_KINDS.get(kind, kind), format(c.get(f"comm_{kind}_calls", 0), "g"),
                            fmt_mib(got), fmt_mib(book), f"{got / book:.2f}x" if book else "-",
                            fmt_mib(t["kv_wire_bytes"][kind])])
    return ["", "## Context parallelism (rank 0, per optimizer step)", "",
            *table(["variant", "attention", "cp x dp", "step time vs ddp_bucket",
                    "gradient all-reduce MiB", "textbook MiB", "all-reduce / textbook",
                    "saved for backward MiB", "vs single"], rows, "lll" + "r" * 6),
            "", *table(["variant", "keys and values", "calls", "payload MiB", "textbook MiB",
                        "payload / textbook", "textbook wire MiB"], kv_rows, "ll" + "r" * 5),
            "", "- step time vs ddp_bucket: the same ranks splitting the batch instead of every "
            "sequence (ratios as in the step-time table). Gradient all-reduce: one fp32 "
            "gradient over dp x cp ranks, on top of the keys and values' traffic.",
            "- ring (`parallel.cp_impl=ring`): the bytes this rank's ring exchanges send "
            "(parallel/comm.py kind \"send\"). Textbook, per layer and micro-batch, with kv = "
            "this rank's keys and values (2 x sequences x T/cp tokens x width x 4 bytes): cp-1 "
            "sends of kv in forward, cp-1 of keys, values and their gradients (2 kv) in backward "
            "and one more of the gradients (kv) to their owner. Point to point: wire = payload.",
            "- all-gather (`parallel.cp_impl=allgather`, the reference): per layer and "
            "micro-batch one all-gather of every rank's kv forward, its output (what is counted) "
            "cp x kv, and one reduce-scatter of their gradients backward, its input cp x kv; a "
            "ring algorithm sends (cp-1)/cp of each.",
            "- saved for backward: each rank holds T/cp tokens of every sequence, so its "
            "activations should fall near 1/cp of single's (with "
            "`trainer.measure_activations=true`); the all-gather's attention also saves the whole "
            "sequence's keys and values and, on CPU, the (T/cp) x T float mask SDPA makes of "
            "its boolean causal mask."]


def hybrid(summary):
    """Hybrid sharding and offload: each variant against its PyTorch reference, its state
    on the device and on the host, and its collectives by kind."""
    done = {n: v for n, v in summary.items() if v.get("hybrid")}
    if not done:
        return []
    rows = []
    for name, v in done.items():
        h, c, t = v["hybrid"], v["comm"], v["textbook"] or {}
        counted = v.get("traffic_counted", True)
        kind = lambda k: fmt_mib(c.get(f"comm_{k}_bytes", 0)) if counted else "-"  # noqa: E731
        ref = v.get("vs_reference")
        rows.append([name, f"{h['replicas']} x {h['shards']}", "yes" if h["offload"] else "no",
                     f"{fmt_ratio(ref)} vs {v['reference']}" if v["reference"] else "-",
                     f"{1 / ref['median']:.2f}x" if ref else "-",
                     fmt_mib(v["state_bytes"]), fmt_mib(v.get("host_state_bytes")),
                     kind("all_gather"), kind("reduce_scatter"), kind("all_reduce"),
                     fmt_mib(t.get("across_bytes"))])
    return ["", "## Hybrid sharding and offload (rank 0, per optimizer step)", "",
            *table(["variant", "replica groups x shards", "offload", "step time vs reference",
                    "speed vs reference", "device state MiB", "host state MiB",
                    "all-gather MiB", "reduce-scatter MiB", "all-reduce MiB",
                    "textbook across MiB"], rows, "lll" + "r" * 8),
            "", "- speed vs reference: the reference's step time over this variant's (1 / the "
            "median ratio); the goal is at least 0.95x.",
            "- device / host state: parameters, gradients and AdamW state at the end of a step "
            "on the device (`state_bytes`) and in host memory (`host_state_bytes`: offload). On "
            "CPU both are host memory; the split is what a GPU run would hold where.",
            "- all-gather and reduce-scatter run inside a replica group; the all-reduce is the "
            "gradient shards' across the groups (plus the norm's 4-byte scalar); textbook "
            "across: one fp32 gradient shard, 4 bytes x params / shards (a ring sends 2(R-1)/R "
            "of it). PyTorch's FSDP2 sends through its own code: not counted."]


def compilation(summary):
    done = {n: v for n, v in summary.items() if v.get("compile")}
    if not done:
        return []
    per_round = lambda xs: " / ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    rows = []
    for name, v in done.items():
        c, diff = v["compile"], v["compile"]["loss_rel_diff_vs_reference"]
        rows.append([name, f"{fmt_ratio(v['vs_reference'])} vs {v['reference']}",
                     per_round(c["compile_s_per_round"]), per_round(c["step1_s_per_round"]),
                     per_round(c["job_s_per_round"]), f"{c['frames']} / {c['recompiles']}",
                     "-" if diff is None else f"{diff:.1e}"])
    lines = ["", "## Compilation (trainer.compile)", "",
             *table(["variant", "step time vs eager", "compiling in step 1, s (by round)",
                     "step 1, s", "whole job, s", "code objects / recompiles",
                     "loss rel. diff vs eager"], rows, "lrrrrrr"),
             "", "- compiling: dynamo's capture, AOT autograd and inductor's code generation in "
             "step 1 (`compile_ms`, forward and the deferred backward), on rank 0; step 1: its "
             "whole time. Each variant's round 1 starts with an empty inductor cache (one per variant "
             "and invocation, `TORCHINDUCTOR_CACHE_DIR` in the runs directory); later rounds find "
             "round 1's kernels there, as a second run on one machine would. Steps after the first "
             "`--warmup` ones never compile (compile_ms 0).",
             "- loss rel. diff vs eager: max relative per-step difference from the same layout "
             "eager over the whole job: inductor reorders floating-point sums."]
    for name, v in done.items():
        whole = v["compile"].get("vs_whole_model")
        if whole:
            lines.append(f"- per block (`{name}`) against the whole model in one graph "
                         f"(`{name}_model`, nanoGPT's way): {fmt_ratio(whole)} the step time.")
    return lines


def left_out(skipped, jobs):
    lines = ["", "## Skipped", "", *(f"- {n}: {why}" for n, why in skipped.items())] if skipped else []
    failed = [j for j in jobs if not j["ok"]]
    if failed:
        lines += ["", "## Failed jobs (left out of every figure)", ""]
        lines += [f"- round {j['round']} {j['variant']}: exit {j['returncode']}, "
                  f"{len(j['records'])} steps logged: `{last_line(j['error'])}`"
                  for j in failed]
    return lines


def markdown(cmd, settings, summary, skipped, jobs, chart):
    """results.md; settings: run.py's, bench.report.environment() included; chart: the
    step-time chart's file name, or None when it could not be drawn."""
    s = settings
    details = [f"model/data/batch, same for every variant: `{' '.join(s['overrides'])}`",
               f"{s['params']:,} parameters; one fp32 gradient = {fmt_mib(4 * s['params'])} MiB"
               if s["params"] else "parameters: not counted",
               f"rounds: {s['rounds']}, {s['steps']} steps per job, first {s['warmup']} steps of "
               "each job dropped; jobs alternate within each round"]
    lines = [*header(f"Benchmark: {s['model']} model, {s['nproc']} ranks", cmd, details, s),
             *step_time(summary), *communication(summary), *activations(summary),
             *pipelines(summary), *tensor_parallel(summary), *context_parallel(summary),
             *hybrid(summary), *experts.section(summary, fmt_ratio), *compilation(summary),
             *left_out(skipped, jobs),
             "", f"![step time and traffic]({chart})" if chart else
             "(no chart: matplotlib is not installed)", ""]
    return "\n".join(lines)
