"""The table of scripts/gpu_smoke.sh: each layout's metrics.jsonl against the first's.

    python scripts/smoke_table.py OUT single:0 ddp_bucket:1e-5 ...

OUT/<name>/ holds a job's `status` (exit code), `log` and `run/metrics.jsonl`. A
layout passes when its job exited 0 and every step's loss and pre-clip gradient
norm is within its relative tolerance of the reference's (the first name). Step
time: median over the steps after the first (warm-up). Peak memory: rank 0's
`peak_mem_mb`, and on CUDA `/ peak_mem_reserved_mb`. Exit status 1 if any fails.
"""

import json
import os
import statistics
import sys


def records(out, name):
    path = os.path.join(out, name, "run", "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def max_rel(ref, got, key):
    return max(abs(a[key] - b[key]) / max(abs(a[key]), 1e-12) for a, b in zip(ref, got))


def row(out, name, rtol, ref):
    with open(os.path.join(out, name, "status")) as f:
        status = int(f.read())
    got = records(out, name)
    if status != 0 or not got or len(got) != len(ref):
        why = "hung (timeout)" if status in (124, 137) else f"exit {status}, {len(got)} steps"
        return [name, "-", "-", "-", "-", f"FAIL: {why}"], False
    loss, norm = max_rel(ref, got, "loss"), max_rel(ref, got, "grad_norm")
    step_ms = statistics.median(r["step_ms"] for r in got[1:] or got)
    mem = f"{max(r['peak_mem_mb'] for r in got):.0f}"
    if "peak_mem_reserved_mb" in got[-1]:
        mem += f" / {max(r['peak_mem_reserved_mb'] for r in got):.0f}"
    ok = loss <= rtol and norm <= rtol
    return [name, f"{loss:.2g}", f"{norm:.2g}", f"{step_ms:.1f}", mem,
            "pass" if ok else f"FAIL: > {rtol:g}"], ok


def main(out, specs):
    names = [s.rsplit(":", 1)[0] for s in specs]
    ref = records(out, names[0])
    table = [["layout", "max loss diff", "max grad-norm diff", "step ms", "peak MiB", "result"]]
    failed = []
    if not ref:
        failed.append(names[0])
        table.append([names[0], "-", "-", "-", "-", "FAIL: the reference did not run"])
    else:
        for spec in specs:
            name, rtol = spec.rsplit(":", 1)
            cells, ok = row(out, name, float(rtol), ref)
            table.append(cells)
            if not ok:
                failed.append(name)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for name in failed:  # what went wrong, right under the table
        with open(os.path.join(out, name, "log")) as f:
            tail = f.read().splitlines()[-8:]
        print(f"---- {name}: last lines of {os.path.join(out, name, 'log')}\n" + "\n".join(tail))
    print(f"{len(specs) - len(failed)} of {len(specs)} layouts pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
