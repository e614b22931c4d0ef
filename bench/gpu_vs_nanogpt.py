"""`python -m bench.gpu_vs_nanogpt --nanogpt PATH`: nanoGPT's own bench.py against our
`single` at the same shape (bench/README.md).

    python -m bench.gpu_vs_nanogpt --nanogpt ../nanoGPT                 # -> runs/bench/gpu-vs-nanogpt/<cuda|cpu>/
    python -m bench.gpu_vs_nanogpt --nanogpt ../nanoGPT --block 64 --batch 1 --rounds 3   # CPU

PATH is a checkout of karpathy/nanoGPT; its bench.py runs there as it is (bench/nanogpt_runner.py),
nothing of it is copied here. Its shape is fixed: 12 layers x 768 wide, 12 heads, no biases,
vocabulary 50304, AdamW (weight decay 1e-2, lr 1e-4, betas 0.9/0.95, fused on CUDA), 10 burn-in
and 20 timed iterations. Ours is a real main.py job (bench.run's engine: run_engine/jobs.py,
parallel.dp=single) set to the same: 50304 rows (the embedded corpus' characters padded by
model.vocab_pad_to), the same AdamW with no clipping and a constant lr, 30 steps, the last 20
timed. On a GPU both run at nanoGPT's defaults: 1024 tokens, micro-batch 12, bf16 autocast,
compiled (ours whole-model: trainer.compile_scope=model, what bench.py's torch.compile does);
on a CPU in fp32, eager, at the --block/--batch given. The two alternate in rounds (nanoGPT,
ours, nanoGPT, ours, ...), the ratio is taken within a round, and the report gives each figure's
median with its min-max over rounds. --layers/--heads/--width shrink our side only (bench.py
hardcodes its model): for the tests; the report then says the shapes differ.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from statistics import median

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # also runs as `python bench/gpu_vs_nanogpt.py`
    sys.path.insert(0, REPO)

from bench import nanogpt_runner as nano, report  # noqa: E402

VOCAB = 50304                       # bench.py's: GPT-2's 50257 padded to a multiple of 64
NANO_SHAPE = (12, 12, 768)          # bench.py's n_layer, n_head, n_embd
STEPS = nano.BURN_IN + nano.TIMED   # ours runs as many steps as bench.py and times the same ones
# the recorded command names no directory of this machine (a fresh clone runs it as written)
PLACEHOLDER = "NANOGPT_CHECKOUT"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.gpu_vs_nanogpt", description=__doc__.split("\n")[0])
    p.add_argument("--nanogpt", required=True, metavar="PATH", help="a checkout of karpathy/nanoGPT")
    p.add_argument("--rounds", type=int, default=3, help="(%(default)s)")
    p.add_argument("--block", type=int, default=0, help="tokens per sequence (0: 1024 on a GPU, 64 on a CPU)")
    p.add_argument("--batch", type=int, default=0, help="micro-batch (0: 12 on a GPU, 1 on a CPU)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="both sides (auto: bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--compile", choices=("auto", "true", "false"), default="auto",
                   help="both sides (auto: true on a GPU, false on a CPU)")
    p.add_argument("--layers", type=int, default=NANO_SHAPE[0], help="OUR side only, for tests (%(default)s)")
    p.add_argument("--heads", type=int, default=NANO_SHAPE[1], help="OUR side only, for tests (%(default)s)")
    p.add_argument("--width", type=int, default=NANO_SHAPE[2], help="OUR side only, for tests (%(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="OMP threads of each side's one process (%(default)s: every CPU)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run counts as hung (%(default)s)")
    p.add_argument("--budget-s", type=float, default=0,
                   help="seconds for the whole command (0: no limit): a round starts only if it "
                        "fits as the last one did, a run is killed when the budget ends")
    p.add_argument("--rows", default="", metavar="FILE",
                   help="append each run's figures to FILE as a JSON line as soon as it ends")
    p.add_argument("--out", default="", help="output directory (default runs/bench/gpu-vs-nanogpt/<cuda|cpu>)")
    p.add_argument("--runs-dir", default="", help="keep our jobs' run directories here (default: deleted)")
    args = p.parse_args(argv)
    if why := nano.checkout_error(args.nanogpt):
        p.exit(2, f"error: {why}\n")  # one line, before anything slow (torch's import)
    return args


def plan(args, cuda):
    """What both sides run on this device: a dict the report keeps as settings."""
    from launch.devices import precision_for  # trainer.precision=auto's choice
    precision = args.precision if args.precision != "auto" else precision_for("cuda" if cuda else "cpu")
    compiled = args.compile == "true" if args.compile != "auto" else cuda
    return {"device": "cuda" if cuda else "cpu", "block": args.block or (1024 if cuda else 64),
            "batch": args.batch or (12 if cuda else 1), "precision": precision, "compile": compiled,
            "ours_shape": [args.layers, args.heads, args.width], "nanogpt_shape": list(NANO_SHAPE),
            "vocab": VOCAB, "threads": args.threads, "rounds": args.rounds,
            "burn_in": nano.BURN_IN, "timed": nano.TIMED}


def our_overrides(s):
    """main.py's keys for nanoGPT's bench at this plan: its model, optimizer and loop."""
    from bench.run_engine.jobs import common_overrides
    from bench.run_engine.variants import MODELS
    # the engine's keys every bench job shares (logging each step, no eval, save or sample),
    # without its model sizes: the shape here is nanoGPT's
    shared = [o for o in common_overrides("tiny", "", STEPS) if o not in MODELS["tiny"]]
    L, H, C = s["ours_shape"]
    return shared + [
        "parallel.dp=single", f"model.n_layer={L}", f"model.n_head={H}", f"model.n_embd={C}",
        "model.bias=false", "model.dropout=0.0",
        # bench.py trains on random ids of 50304; ours reads the embedded corpus (characters,
        # no tiktoken files needed offline), its rows padded to the same 50304: same matmuls
        "data.tokenizer=char", f"model.vocab_pad_to={VOCAB}",
        f"data.block_size={s['block']}", f"trainer.batch_size={s['batch']}", "trainer.grad_accum=1",
        # bench.py's configure_optimizers(weight_decay=1e-2, learning_rate=1e-4, betas=(0.9, 0.95)):
        # a constant lr and no gradient clipping
        "trainer.lr=1e-4", "trainer.min_lr=1e-4", "trainer.warmup_steps=0",
        "trainer.weight_decay=0.01", "trainer.beta1=0.9", "trainer.beta2=0.95", "trainer.grad_clip=0",
        f"trainer.precision={s['precision']}",
        *(["trainer.compile=true", "trainer.compile_scope=model"] if s["compile"] else [])]


def flops_per_token(s, shape):
    """nanoGPT's estimate_mfu count (telemetry/mfu.py, the same formula) at this shape and
    50304 rows. Both sides' MFUs come from it: our logged `mfu` counts the tokenizer's
    vocabulary, not the padded rows the LM head multiplies."""
    from telemetry.mfu import flops_per_token as fpt
    L, _, C = shape
    return fpt({"n_layer": L, "n_embd": C, "block_size": s["block"], "vocab_size": VOCAB, "bias": False})


def figures(ms, s, shape, device_peak):
    """tokens/s and the MFUs of a side of this shape that took `ms` per iteration. Both
    sides' MFUs by the one formula: bench.py prints its own with 2 decimals (0.00% on a CPU)."""
    ms = round(ms, 4)  # bench.py prints 4 decimals; tokens/s is the recorded figure's
    tok_s = s["batch"] * s["block"] * 1000 / ms
    mfu_a100_pct = 100 * flops_per_token(s, shape) * tok_s / nano.A100_BF16_PEAK
    return {"ms_per_iter": ms, "tokens_per_s": tok_s,
            "mfu_a100_pct": mfu_a100_pct,
            "mfu_device_pct": mfu_a100_pct * nano.A100_BF16_PEAK / device_peak if device_peak else None}


def our_side(job, s, device_peak):
    """Our job's figures over the timed steps, the way bench.py times them: their total
    time over their count (a mean, not a median)."""
    timed = [r["step_ms"] for r in job["records"][nano.BURN_IN:]]
    return figures(sum(timed) / len(timed), s, s["ours_shape"], device_peak)


KEYS = ("tokens_per_s", "ms_per_iter", "mfu_a100_pct", "mfu_device_pct", "mfu_pct")


def summarize(rounds):
    """Median, min and max over rounds of each side's figures and of the per-round ratio."""
    def spread(values):
        values = [v for v in values if v is not None]
        return {"median": median(values), "min": min(values), "max": max(values)} if values else None
    ok = [r for r in rounds if r["ratio"] is not None]
    return {"rounds_ok": len(ok), "ratio": spread([r["ratio"] for r in ok]),
            **{side: {k: spread([r[side].get(k) for r in ok]) for k in KEYS} for side in ("nanogpt", "ours")}}


def fmt(x, digits=1):
    return "-" if x is None else f"{x:,.{digits}f}"


def fmt_mfu(x):
    # 3 significant figures: a CPU's 0.0123% and a GPU's 41.2% alike
    return "-" if x is None else f"{x:.3g}"


def tables(doc):
    """results.md's tables and summary line from results.json alone (the test re-renders them)."""
    summ, rounds = doc["summary"], doc["rounds"]
    rows = [[r["round"], *(fmt(r[side].get(k), 1) if r[side].get("ms_per_iter") else "FAILED"
                           for side in ("nanogpt", "ours") for k in ("ms_per_iter", "tokens_per_s")),
             fmt(r["ratio"], 3)] for r in rounds]
    per_round = report.table(["round", "nanoGPT ms/iter", "nanoGPT tokens/s", "ours ms/iter",
                              "ours tokens/s", "ours / nanoGPT"], rows, "rrrrrr")
    if not summ["rounds_ok"]:
        return per_round, "no round completed on both sides"

    def cell(side, key, f=fmt):
        v = summ[side][key]
        return "-" if v is None else f"{f(v['median'])} ({f(v['min'])}-{f(v['max'])})"
    summary = report.table(["", "nanoGPT bench.py", "ours (single)"], [
        ["ms per iteration"] + [cell(side, "ms_per_iter") for side in ("nanogpt", "ours")],
        ["tokens/s"] + [cell(side, "tokens_per_s") for side in ("nanogpt", "ours")],
        ["MFU %, A100 bf16 peak (312 TFLOP/s: bench.py's yardstick)"]
        + [cell(side, "mfu_a100_pct", fmt_mfu) for side in ("nanogpt", "ours")],
        ["MFU %, this device's peak"] + [cell(side, "mfu_device_pct", fmt_mfu) for side in ("nanogpt", "ours")],
        ["MFU % as bench.py prints it (A100 bf16 peak, 2 decimals)", cell("nanogpt", "mfu_pct", fmt_mfu), "-"],
    ], "lrr")
    r = summ["ratio"]
    line = (f"ours / nanoGPT tokens/s: **{r['median']:.3f}** ({r['min']:.3f}-{r['max']:.3f}) over "
            f"{summ['rounds_ok']} round(s)")
    return per_round + [""] + summary, line


def markdown(doc):
    s = doc["settings"]
    same = s["ours_shape"] == s["nanogpt_shape"]
    details = [
        f"nanoGPT checkout at commit {doc['nanogpt_commit'] or '?'}: its bench.py as it is "
        f"({', '.join(doc['nanogpt_args'])})",
        f"ours: main.py, parallel.dp=single ({' '.join(doc['our_overrides'])})",
        f"device {s['device']}, {s['precision']}, {'compiled' if s['compile'] else 'eager'}, "
        f"{s['batch']} x {s['block']} tokens, vocabulary {s['vocab']}, OMP threads: {s['threads']} a side, "
        f"{s['rounds']} rounds, each side {s['burn_in']} burn-in + {s['timed']} timed iterations "
        "(mean time of the timed ones)",
        "shape: both 12 layers x 768, 12 heads" if same else
        f"**shapes differ** (ours {s['ours_shape']} layers/heads/width against nanoGPT's "
        f"{s['nanogpt_shape']}): a test run, no comparison",
        "MFU: (6 N + 12 L C T) FLOPs per token (N without the position embedding, 50304 rows) x "
        "tokens/s over a peak; bench.py divides by an A100's bf16 312 TFLOP/s on any device, and "
        "ours is given on the same yardstick. 'this device's peak' is telemetry/mfu.py's (GPUs it lists)",
    ]
    lines = report.header("nanoGPT's bench.py against ours (single)", doc["command"], details, doc["env"])
    body, line = tables(doc)
    failed = [f"- round {r['round']} {side}: exit {r[side]['returncode']}: "
              f"{(r[side]['error'].strip().splitlines() or [''])[-1][:300]}"
              for r in doc["rounds"] for side in ("nanogpt", "ours") if r[side]["error"]]
    return "\n".join(lines + ["", line, "", *body, *([""] + failed if failed else [])]) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    import torch
    from bench.run_engine.jobs import check, run_job
    from telemetry.mfu import device_peak
    cuda = torch.cuda.is_available()
    s = plan(args, cuda)
    peak = device_peak(torch.device("cuda"), s["precision"]) if cuda else None
    overrides = our_overrides(s)
    why, _ = check(overrides, 1)
    if why:
        raise SystemExit(f"error: main.py refuses our side's keys: {why}")
    nano_args = nano.options(s["batch"], s["block"], s["device"],
                             "bfloat16" if s["precision"] == "bf16" else "float32", s["compile"])
    runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="bench-nanogpt-")
    load_before, rounds, begun = os.getloadavg(), [], time.monotonic()
    # the checkout named by a placeholder, wherever it was (peers/nanoGPT on a GPU machine)
    shown = [PLACEHOLDER if a == args.nanogpt else a.replace(args.nanogpt, PLACEHOLDER)
             if os.path.isabs(args.nanogpt) else a for a in argv]
    how = "-m bench.gpu_vs_nanogpt" if __package__ else "bench/gpu_vs_nanogpt.py"
    # one folder per device kind, so a GPU's run sits beside the CPU's committed one (and a
    # docs/bench/<name>/results.json one level up would be read as bench.run's by test_bench)
    out = args.out or os.path.join("runs", "bench", "gpu-vs-nanogpt", s["device"])

    def left():  # seconds of the budget left (the run's own timeout where there is none)
        return args.timeout if not args.budget_s else max(
            1.0, min(args.timeout, args.budget_s - (time.monotonic() - begun)))

    def results():  # written after every round: a call cut short keeps the rounds done
        doc = {"command": report.command_line(how, shown),
               "settings": s, "env": report.environment(load_before),
               "nanogpt_commit": nano.checkout_commit(args.nanogpt), "nanogpt_args": nano_args,
               "our_overrides": overrides, "summary": summarize(rounds), "rounds": rounds}
        return doc, report.write_results(out, doc, markdown(doc))

    try:
        for rnd in range(1, args.rounds + 1):
            # the last round's time: the first compiles both sides, the next reuse the caches
            last = rounds[-1]["seconds"] if rounds else 0
            if rounds and args.budget_s and time.monotonic() - begun + last > args.budget_s:
                print(f"round {rnd}/{args.rounds}: not started, --budget-s {args.budget_s:g} "
                      f"would not hold it (the last round took {last:.0f} s)", flush=True)
                break
            started = time.monotonic()
            # nanoGPT first, ours second in every round; each side keeps one inductor cache
            theirs = nano.run(os.path.abspath(args.nanogpt), nano_args, args.threads, left(),
                              os.path.join(runs_dir, "inductor-cache-nanogpt"))
            if theirs["ms_per_iter"]:
                theirs.update(figures(theirs["ms_per_iter"], s, s["nanogpt_shape"], peak))
            print(f"round {rnd}/{args.rounds} nanoGPT " + (
                f"{theirs['ms_per_iter']:9.1f} ms/iter {theirs['tokens_per_s']:10.1f} tokens/s"
                if theirs["ms_per_iter"] else f"FAILED ({theirs['returncode']})"), flush=True)
            append_row(args.rows, rnd, "nanogpt", theirs)
            job = run_job(1, args.threads, overrides, os.path.join(runs_dir, f"r{rnd}-ours"), left(),
                          os.path.join(runs_dir, "inductor-cache-ours"))
            ok = job["returncode"] == 0 and len(job["records"]) == STEPS
            ours = {"returncode": job["returncode"], "seconds": job["seconds"],
                    "error": "" if ok else job["error"][-5000:] or "too few records",
                    **(our_side(job, s, peak) if ok else {}), "records": job["records"]}
            print(f"round {rnd}/{args.rounds} ours    " + (
                f"{ours['ms_per_iter']:9.1f} ms/iter {ours['tokens_per_s']:10.1f} tokens/s"
                if ok else f"FAILED ({job['returncode']})"), flush=True)
            append_row(args.rows, rnd, "ours", ours)
            both = ok and theirs["ms_per_iter"]
            rounds.append({"round": rnd, "nanogpt": theirs, "ours": ours,
                           "seconds": round(time.monotonic() - started, 1),
                           "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"] if both else None})
            results()
    finally:
        if not args.runs_dir:
            shutil.rmtree(runs_dir, ignore_errors=True)

    doc, paths = results()
    print("\n" + open(paths["md"]).read())
    print("wrote " + ", ".join(paths.values()))
    # every round it started passed (--budget-s may have left some unstarted: said above)
    return 0 if rounds and doc["summary"]["rounds_ok"] == len(rounds) else 1


def append_row(path, rnd, side, run):
    """One run's figures as a JSON line of --rows, the moment it ends."""
    if path:
        row = {"round": rnd, "side": side, **{k: run.get(k) for k in (
            "returncode", "seconds", "ms_per_iter", "tokens_per_s", "mfu_a100_pct", "mfu_device_pct")},
            "error": (run.get("error") or "").strip().splitlines()[-1:]}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
