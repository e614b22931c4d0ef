"""The table of scripts/gpu_smoke.sh: each layout's jobs against the first's (`single`).

    python scripts/smoke_table.py OUT single:0 ddp_bucket:1e-5 tp2-sp-dropout:- ...

OUT/<name>/ holds a job's `status` (exit code), `log` and `run/` (metrics.jsonl, and
ranks.json: every rank's peak memory and device, whether replicas hold the same
weights, a digest of them); `rerun/` the same job run again (determinism), `debug/` the
rerun of a failed job with the backends' debug output, `killed.jsonl`, `kill.json` and
`resume/` for the row that kills a job and resumes it (snapshot-kill-resume).

Columns: max relative loss and pre-clip gradient-norm difference against the reference
over its steps (tolerance "-": not compared, e.g. dropout, whose masks follow the layout);
median step time over the steps after the first (and against PyTorch's own
implementation of the same layout where the row has one: SMOKE_SPEED_PAIRS "own=torch
..."); median MFU (CUDA only); peak memory of every rank in MiB (CUDA: allocated) and
what `mode=plan` predicts for the layout's fullest rank; whether every box of the
weights two ranks hold is the same on both (replicas); whether the rerun was bitwise
equal (losses, gradient norms, weights); pass/fail. Under the table: the last lines of
each failed job's log and where its debug rerun's logs are; then which device model ran
which rows. Exit status 1 if any row fails.
"""

import json
import os
import re
import statistics
import sys

MIB = 2**20


def records(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_json(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def max_rel(ref, got, key):
    return max(abs(a[key] - b[key]) / max(abs(a[key]), 1e-12) for a, b in zip(ref, got))


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def step_ms(got):
    return median(r.get("step_ms") for r in (got[1:] or got))


def planned_mib(run_dir, world):
    """What mode=plan predicts the layout's fullest rank needs (MiB), or None where the
    planner does not model the run (a reference strategy it has no figures for)."""
    try:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.path.insert(0, repo)
        from checkpoint.resume import snapshot_location
        from checkpoint.snapshot_reader import open_snapshot
        from config import load_config
        from parallel.layout import grid_sizes
        from planner.figures import rank_figures
        from planner.memory import memory_need
        from planner.report import workload
        from planner.shapes import Layout
        cfg = load_config([f"config={os.path.join(run_dir, 'config.yaml')}"], world)
        vocab = open_snapshot(snapshot_location(cfg.trainer)).meta["gpt_config"]["vocab_size"]
        cfg.plan.vocab_size = vocab
        p, t = cfg.parallel, cfg.trainer
        kind = {"ddp_naive": "ddp_bucket", "torch_ddp": "ddp_bucket", "torch_fsdp": "fsdp"}.get(p.dp, p.dp)
        sizes = grid_sizes(p, world)
        if kind == "ddp_bucket" and sizes["dp"] * sizes["cp"] == 1:
            kind = "single"
        L = Layout(kind, (3 if p.dp == "torch_fsdp" else p.zero_stage) if kind == "fsdp" else 0,
                   sizes["dp"], sizes["pp"], sizes["cp"], sizes["tp"], p.sequence_parallel,
                   p.pp_schedule, 2 if p.pp_schedule == "zbv" else p.pp_virtual_stages,
                   p.microbatches, t.grad_accum, t.activation_checkpointing)
        w = workload(cfg)
        return memory_need(w, L, rank_figures(w, L)["fullest"]) / MIB
    except Exception:  # noqa: BLE001: a column of the table, never its failure
        return None


def memory_cell(ranks, planned):
    if not ranks:
        peaks = "-"
    else:
        values = [r.get("peak_mem_mb") for r in ranks["ranks"]]
        peaks = "/".join(f"{v:.0f}" for v in values) if len(values) <= 4 else \
            f"{min(values):.0f}..{max(values):.0f} ({len(values)} ranks)"
    return peaks + (f" (plan {planned:.0f})" if planned is not None else "")


def determinism(out, name, got, ranks):
    """"bitwise", "DIFFERS: ..." or "-" (no rerun)."""
    again = records(os.path.join(out, name, "rerun", "run", "metrics.jsonl"))
    status = read_json(os.path.join(out, name, "rerun", "status")) \
        if os.path.exists(os.path.join(out, name, "rerun", "status")) else None
    if status is None:
        return "-", True
    if status != 0 or len(again) != len(got):
        return f"DIFFERS: rerun exit {status}, {len(again)} steps", False
    for a, b in zip(got, again):
        for key in ("loss", "grad_norm"):
            if a.get(key) != b.get(key):
                return f"DIFFERS: {key} at step {a['step']}", False
    rerun_ranks = read_json(os.path.join(out, name, "rerun", "run", "ranks.json"))
    if ranks and rerun_ranks and ranks.get("weights_digest") != rerun_ranks.get("weights_digest"):
        return "DIFFERS: weights", False
    return "bitwise", True


def kill_resume(out, name, got):
    """The async snapshot row: (note, problem or "")."""
    kill = read_json(os.path.join(out, name, "kill.json")) or {}
    killed = records(os.path.join(out, name, "killed.jsonl"))
    with open(os.path.join(out, name, "log"), errors="replace") as f:
        found = re.findall(r"resuming from snapshot \S+ at step (\d+)", f.read())
    if not kill.get("killed_running"):
        return "", "the job finished before the kill"
    if not found:
        return "", "the resumed job did not start from a snapshot"
    resumed = int(found[-1])
    again = {r["step"]: r for r in got}
    for r in killed:  # steps trained before the kill and again after the resume: bitwise
        if r["step"] > resumed and r["step"] in again and \
                (r["loss"], r["grad_norm"]) != (again[r["step"]]["loss"], again[r["step"]]["grad_norm"]):
            return "", f"step {r['step']} trained again differs"
    steps = [r["step"] for r in got]
    if steps != list(range(1, len(steps) + 1)):
        return "", f"metrics.jsonl steps {steps[:3]}...{steps[-3:]}"
    return f"killed at step {len(killed)}, resumed from {resumed}", ""


def row(out, name, rtol, ref):
    with open(os.path.join(out, name, "status")) as f:
        status = int(f.read())
    run_dir = os.path.join(out, name, "run")
    got = records(os.path.join(run_dir, "metrics.jsonl"))
    ranks = read_json(os.path.join(run_dir, "ranks.json"))
    blank = {"name": name, "loss": "-", "norm": "-", "ms": None, "mfu": "-", "mem": "-",
             "replicas": "-", "rerun": "-", "note": ""}
    if status != 0 or not got or len(got) < len(ref):
        why = "hung (timeout)" if status in (124, 137) else f"exit {status}, {len(got)} steps"
        return {**blank, "result": f"FAIL: {why}"}, False
    problems = []
    compared = got[:len(ref)]
    loss, norm = max_rel(ref, compared, "loss"), max_rel(ref, compared, "grad_norm")
    if rtol != "-" and not (loss <= float(rtol) and norm <= float(rtol)):
        problems.append(f"> {float(rtol):g}")
    mfus = median(r.get("mfu") for r in got[1:] or got)
    world = len(ranks["ranks"]) if ranks else 1
    cells = {"name": name, "loss": f"{loss:.2g}", "norm": f"{norm:.2g}", "ms": step_ms(got),
             "mfu": f"{mfus:.1%}" if mfus is not None else "-",
             "mem": memory_cell(ranks, planned_mib(run_dir, world) if ranks else None),
             "replicas": "-", "rerun": "-", "note": ""}
    if ranks:
        if ranks["replicas_equal"]:
            cells["replicas"] = f"equal ({ranks['replicas_checked']})"
        else:
            cells["replicas"] = f"DIFFER ({len(ranks['replicas_differ'])})"
            problems.append(f"replicas differ: {ranks['replicas_differ'][0]}")
    cells["rerun"], same = determinism(out, name, got, ranks)
    if not same:
        problems.append("not deterministic")
    if os.path.exists(os.path.join(out, name, "kill.json")):
        cells["note"], problem = kill_resume(out, name, got)
        if problem:
            problems.append(problem)
    ok = not problems
    return {**cells, "result": "pass" if ok else "FAIL: " + "; ".join(problems)}, ok


def speed_pairs():
    pairs = {}
    for item in os.environ.get("SMOKE_SPEED_PAIRS", "").split():
        own, _, torch_name = item.partition("=")
        pairs[own] = torch_name
    return pairs


def device_summary(out, names):
    """"<device model> x<ranks>: rows" lines, from every row's ranks.json."""
    groups = {}
    for name in names:
        ranks = read_json(os.path.join(out, name, "run", "ranks.json"))
        if ranks:
            models = sorted({r["device_name"] for r in ranks["ranks"]})
            groups.setdefault(" + ".join(models), []).append(f"{name} ({len(ranks['ranks'])})")
    return [f"ran on {model}: {', '.join(rows)}" for model, rows in groups.items()]


def main(out, specs):
    names = [s.rsplit(":", 1)[0] for s in specs]
    ref = records(os.path.join(out, names[0], "run", "metrics.jsonl"))
    header = ["layout", "max loss diff", "max grad-norm diff", "step ms", "vs torch", "mfu",
              "peak MiB per rank (plan)", "replicas", "rerun", "result"]
    failed, rows = [], []
    if not ref:
        failed.append(names[0])
        rows.append({"name": names[0], "result": "FAIL: the reference did not run"})
    else:
        for spec in specs:
            name, rtol = spec.rsplit(":", 1)
            cells, ok = row(out, name, rtol, ref)
            rows.append(cells)
            if not ok:
                failed.append(name)
    timed = {r["name"]: r.get("ms") for r in rows}
    pairs = speed_pairs()
    table = [header]
    for r in rows:
        theirs = timed.get(pairs.get(r["name"]))
        versus = f"{r['ms'] / theirs:.2f}x {pairs[r['name']]}" if r.get("ms") and theirs else "-"
        result = r["result"] + (f" ({r['note']})" if r.get("note") and r["result"] == "pass" else "")
        table.append([r["name"], r.get("loss", "-"), r.get("norm", "-"),
                      f"{r['ms']:.1f}" if r.get("ms") else "-", versus, r.get("mfu", "-"),
                      r.get("mem", "-"), r.get("replicas", "-"), r.get("rerun", "-"), result])
    widths = [max(len(t[i]) for t in table) for i in range(len(header))]
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip())
    for name in failed:  # what went wrong, right under the table
        log = os.path.join(out, name, "log")
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                tail = f.read().splitlines()[-8:]
            print(f"---- {name}: last lines of {log}\n" + "\n".join(tail))
        debug = os.path.join(out, name, "debug")
        if os.path.isdir(debug):
            print(f"---- {name}: rerun with NCCL_DEBUG=WARN, TORCH_DISTRIBUTED_DEBUG=DETAIL and the "
                  f"NCCL flight recorder: {os.path.join(debug, 'log')} (traces: "
                  f"{os.path.join(debug, 'nccl_trace_rank_*')})")
    for line in device_summary(out, names):
        print(line)
    print(f"{len(specs) - len(failed)} of {len(specs)} layouts pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
