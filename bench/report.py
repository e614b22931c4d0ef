"""Write a benchmark's results: results.json (everything), results.md (tables), step_time.png."""

import json
import os
import platform
import re
import subprocess
import time

MiB = 2**20


def environment(load_before):
    """What a reader needs to judge the numbers: code version, machine, how busy it was."""
    import torch
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit = ""
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "git": commit, "torch": torch.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}


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


def busy_warning(s):
    # a load average near the core count means other work shared the cores: ratios
    # within a round still compare, absolute times do not
    # (only "before" tells: "after" includes the benchmark's own jobs)
    load = s["loadavg_before"][0]
    if load < 0.5 * (s["cpus"] or 1):
        return []
    return [f"- **the machine was busy** (1-min load average {load} on {s['cpus']} CPUs): "
            "treat absolute times as noisy"]


def markdown(cmd, settings, summary, skipped, jobs, chart):
    s = settings
    lines = [
        f"# Benchmark: {s['model']} model, {s['nproc']} ranks", "",
        "Command (from the repository root):", "", f"    {cmd}", "",
        f"- model/data/batch, same for every variant: `{' '.join(s['overrides'])}`",
        f"- {s['params']:,} parameters; one fp32 gradient = {fmt_mib(4 * s['params'])} MiB"
        if s["params"] else "- parameters: not counted",
        f"- rounds: {s['rounds']}, {s['steps']} steps per job, first {s['warmup']} steps of each "
        "job dropped; jobs alternate within each round",
        f"- {s['date']}, git {s['git'] or '?'}, torch {s['torch']}, python {s['python']}, "
        f"{s['cpus']} CPUs, 1-min load average {s['loadavg_before'][0]} before the run "
        f"({s['loadavg_after'][0]} after, its own jobs included)",
        *busy_warning(s),
        "", "## Step time", "",
        "| variant | ranks x threads | step ms | tokens/s | vs single | vs reference | "
        "loss rel. diff vs single |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, v in summary.items():
        ref = f"{fmt_ratio(v['vs_reference'])} vs {v['reference']}" if v["reference"] else "-"
        diff = v["loss_rel_diff_vs_single"]
        vs_single = "baseline" if name == "single" else fmt_ratio(v["vs_single"])
        lines.append(f"| {name} | {v['ranks']} x {v['threads']} | {fmt_ms(v['step_ms'])} | "
                     f"{v['tokens_per_s']:.0f} | {vs_single} | {ref} | "
                     f"{'-' if diff is None else f'{diff:.1e}'} |")
    lines += ["", "Step ms and tokens/s: medians over every kept step of every round. Ratios: "
              "within each round, this variant's median step over the other's; then the median "
              "over rounds (min-max in brackets).", "",
              "## Communication and memory (rank 0, per optimizer step)", "",
              "| variant | comm calls | payload MiB | est. wire MiB | textbook wire MiB | "
              "wire / textbook | state MiB | textbook state MiB | peak RSS MiB |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, v in summary.items():
        c, t = v["comm"], v["textbook"] or {}
        counted = v.get("traffic_counted", True) and (c.get("comm_calls", 0) > 0 or v["ranks"] == 1)
        wire, book = c["wire_bytes_est"], t.get("wire_bytes")
        rel = f"{wire / book:.2f}x" if counted and book else "-"
        lines.append(
            f"| {name} | {format(c.get('comm_calls', 0), 'g') if counted else '-'} | "
            f"{fmt_mib(c.get('comm_bytes', 0)) if counted else 'not counted'} | "
            f"{fmt_mib(wire) if counted else '-'} | {fmt_mib(book)} | {rel} | "
            f"{fmt_mib(v['state_bytes'])} | {fmt_mib(t.get('state_bytes'))} | "
            f"{v['peak_mem_mb']:.0f} |")
    lines += [
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
    acts = {n: v["activation_peak_mb"] for n, v in summary.items() if v.get("activation_peak_mb")}
    if acts:
        lines += ["", "## Activation memory (rank 0, peak per step)", "",
                  "| variant | saved for backward MiB | vs single |", "|---|---:|---:|"]
        for name, mb in acts.items():
            rel = f"{mb / acts['single']:.2f}x" if acts.get("single") else "-"
            lines.append(f"| {name} | {mb:.1f} | {rel} |")
        lines += ["", "- bytes of the tensors autograd holds for backward (activation_meter.py, "
                  "`trainer.measure_activations=true`), peak within a step."]
    pipes = {n: v["pipeline"] for n, v in summary.items() if v.get("pipeline")}
    if pipes:
        lines += ["", "## Pipeline: bubble and busy time (per stage, median step)", "",
                  "| variant | P x M (x V) | bubble measured | textbook (P-1)/(M+P-1)/V | "
                  "busy ms per stage | idle ms per stage |", "|---|---|---:|---:|---|---|"]
        for name, p in pipes.items():
            shape = f"{p['P']} x {p['M']}" + (f" x {p['V']}" if p["V"] > 1 else "")
            lines.append(f"| {name} | {shape} | {p['bubble']:.3f} | {p['textbook_bubble']:.3f} | "
                         f"{' / '.join(f'{b:.1f}' for b in p['busy_ms'])} | "
                         f"{' / '.join(f'{i:.1f}' for i in p['idle_ms'])} |")
        lines += ["", "- bubble: the idle share of each stage's schedule (time waiting for a "
                  "neighbour, from the start of the step's first action to the end of its last), "
                  "averaged over stages; busy: time computing forwards and backwards. The "
                  "textbook assumes equal stages, a backward costing what a forward does and "
                  "free communication.",
                  "- pipeline textbook traffic (rank 0, point to point, so wire = payload): one "
                  "activation forward per micro-batch from each of its V chunks and one gradient "
                  "back into each but the first, (2V-1) x batch x tokens x width x 4 bytes a "
                  "step, plus the tied embedding's gradient (to the last stage) and the norm's "
                  "scalar; textbook state: 16 bytes per parameter of rank 0's chunks."]
        if any(p["timeline"] for p in pipes.values()):
            lines += ["", "![pipeline timelines](pipeline_timeline.png)"]
    tp = {n: v for n, v in summary.items() if v.get("tp_parameters")}
    if tp:
        lines += ["", "## Tensor parallelism: parameters per rank", "",
                  "| variant | split tensors: this rank / whole | share | replicated tensors "
                  "(every rank) | which |", "|---|---:|---:|---:|---|"]
        for name, v in tp.items():
            t = v["tp_parameters"]
            lines.append(f"| {name} | {t['split']:,} / {t['split_canonical']:,} | "
                         f"{t['split'] / t['split_canonical']:.4f} (1/{v['ranks']} = "
                         f"{1 / v['ranks']:.4f}) | {t['replicated']:,} | "
                         f"{', '.join(t['replicated_names'])} |")
        lines += ["", "- split: elements of the weights TP cuts (attention and MLP matrices, "
                  "their column-parallel biases, the vocabulary-padded embedding) held by one "
                  "rank; replicated: elements every rank holds in full. For TP variants the "
                  "textbook traffic is Megatron's: per layer and micro-batch four all-reduces of "
                  "one activation (batch x tokens x width x 4 bytes), plus the embedding, the LM "
                  "head input and the loss's scalars per token; textbook state: 16 bytes per "
                  "local parameter."]
    if skipped:
        lines += ["", "## Skipped", ""] + [f"- {n}: {why}" for n, why in skipped.items()]
    failed = [j for j in jobs if not j["ok"]]
    if failed:
        lines += ["", "## Failed jobs (left out of every figure)", ""]
        lines += [f"- round {j['round']} {j['variant']}: exit {j['returncode']}, "
                  f"{len(j['records'])} steps logged: `{last_line(j['error'])}`"
                  for j in failed]
    lines += ["", f"![step time and traffic]({chart})" if chart else
              "(no chart: matplotlib is not installed)", ""]
    return "\n".join(lines)


def chart(path, summary):
    """Left: step time vs single (bar = median, dots = rounds). Right: traffic vs textbook."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display here
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(summary)[::-1]  # first variant on top
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.45 * len(names) + 1.6), sharey=True)
    for i, n in enumerate(names):
        r = summary[n]["vs_single"]
        if r:
            left.barh(i, r["median"], color="tab:blue", alpha=0.6)
            left.plot(r["per_round"], [i] * len(r["per_round"]), "k.", markersize=4)
    left.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    left.set_yticks(range(len(names)), names)
    left.set_xlabel("step time / single (same round)")
    wire = [summary[n]["comm"]["wire_bytes_est"] / MiB for n in names]
    book = [(summary[n]["textbook"] or {}).get("wire_bytes", 0) / MiB for n in names]
    right.barh([i + 0.2 for i in range(len(names))], wire, height=0.4, label="est. wire (counted)")
    right.barh([i - 0.2 for i in range(len(names))], book, height=0.4, label="textbook")
    right.set_xlabel("MiB sent per rank per step")
    right.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.basename(path)


def timeline_chart(path, summary):
    """One panel per pipeline variant: a row per stage, a box per forward (light) and
    backward (dark), labelled by micro-batch (and chunk, interleaved)."""
    runs = {n: v["pipeline"]["timeline"] for n, v in summary.items()
            if v.get("pipeline") and v["pipeline"]["timeline"]}
    if not runs:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    height = sum(1.0 + 0.5 * len(t["stages"]) for t in runs.values())
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, height), squeeze=False)
    for ax, (name, t) in zip(axes[:, 0], runs.items()):
        for s, actions in enumerate(t["stages"]):
            for kind, chunk, m, t0, t1 in actions:
                ax.broken_barh([(t0, t1 - t0)], (s - 0.4, 0.8),
                               color="tab:blue" if kind == "F" else "tab:orange",
                               alpha=0.55 if kind == "F" else 0.85, edgecolor="black", linewidth=0.4)
                label = f"{m}" if t["virtual_stages"] == 1 else f"{m}.{chunk}"
                ax.text((t0 + t1) / 2, s, label, ha="center", va="center", fontsize=6)
        ax.set_yticks(range(len(t["stages"])), [f"stage {s}" for s in range(len(t["stages"]))])
        ax.invert_yaxis()
        ax.set_title(f"{name}: {t['schedule']}, M={t['microbatches']}"
                     + (f", V={t['virtual_stages']}" if t["virtual_stages"] > 1 else "")
                     + " (blue forward, orange backward; label = micro-batch[.chunk])", fontsize=8)
        ax.set_xlabel("ms since the step's first action")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.basename(path)


def write_all(out, cmd, settings, summary, skipped, jobs):
    os.makedirs(out, exist_ok=True)
    paths = {k: os.path.join(out, f) for k, f in
             (("json", "results.json"), ("md", "results.md"), ("png", "step_time.png"))}
    with open(paths["json"], "w") as f:
        json.dump({"command": cmd, "settings": settings, "variants": summary,
                   "skipped": skipped, "jobs": jobs}, f, indent=1)
    png = chart(paths["png"], summary)
    if timeline_chart(os.path.join(out, "pipeline_timeline.png"), summary):
        paths["timeline"] = os.path.join(out, "pipeline_timeline.png")
    if png is None:
        del paths["png"]
    with open(paths["md"], "w") as f:
        f.write(markdown(cmd, settings, summary, skipped, jobs, png))
    return paths
