"""`python -m bench.cp_balance`: per-rank causal attention time of context parallelism's
zigzag split against a contiguous split (bench/README.md).

    python -m bench.cp_balance                  # T=2048, cp 2 and 4 -> runs/bench/cp_balance/
    python -m bench.cp_balance --seq 256 --repeats 2 --out "$(mktemp -d)"   # smoke test, seconds

The sequence is cut into 2 x cp chunks of c = T / (2 cp) tokens. Zigzag (ours): rank r
holds chunks r and 2cp-1-r. Contiguous: rank r holds chunk r of cp, i.e. chunks 2r and
2r+1. Under a causal mask a query chunk attends to key chunks <= itself, so the
contiguous split gives the last rank the most work and rank 0 the least.

What is measured: in one process with one thread (a rank's OMP_NUM_THREADS=1), for every
rank in turn, the forward and the backward of our ring attention, the autograd Function
training runs (parallel/context_parallel/ring_attention.py), on that rank's 2c tokens.
Communication is replaced by a stand-in that hands each ring step this rank's own keys
and values back at once: the same blocks, shapes and arithmetic a rank computes (scores,
mask, online softmax, the matmuls; backward recomputes the scores as training does), with
no transfer and no wait. Zigzag runs the Function as it is, its blocks the ones `blocks()`
gives; contiguous runs the same Function with `contiguous_blocks()` in place of `blocks()`
(every key chunk <= the query chunk, in c x c blocks, so the wholly masked quarter of the
diagonal is skipped: the contiguous split at its most favourable). For scale, the same
for PyTorch's fused causal attention over the whole sequence in one process (what runs
without context parallelism). Each figure is the median over --repeats; ranks, splits and
the whole-sequence call alternate within every repeat.

Not measured: communication and its overlap with compute, the rest of the model (every
other layer is per token, the same work on every rank under either split), and waiting.
In training every ring step ends in an exchange, so a step's attention takes about the
slowest rank's time: the max/min ratio is what the imbalance costs the others.
"""

import argparse
import functools
import os
import statistics
import sys
import time
from contextlib import nullcontext
from types import SimpleNamespace
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # also runs as `python bench/cp_balance.py`
    sys.path.insert(0, REPO)

from bench import report  # noqa: E402
from parallel.context_parallel import ring_attention as ring  # noqa: E402

SPLITS = ("zigzag", "contiguous")


def contiguous_blocks(me, src, size):
    """ring.blocks() for the contiguous split: [(query part, key part, causal)] that rank
    `me` (chunks 2me, 2me+1 as its parts 0, 1) computes against rank `src`'s keys."""
    if src == me:
        return [(0, 0, True), (1, 0, False), (1, 1, True)]
    if src < me:
        return [(0, 0, False), (0, 1, False), (1, 0, False), (1, 1, False)]
    return []


def held_chunks(split, rank, size):
    """The two chunks (of 2 x size) that `rank` holds as its parts 0 and 1."""
    return ring.zigzag_chunks(rank, size) if split == "zigzag" else (2 * rank, 2 * rank + 1)


def rank_blocks(split, rank, size):
    """[(query chunk, key chunk, causal)] rank `rank` computes over the whole ring, in
    chunk indices of the sequence: the zigzag from ring.blocks(), as training runs it."""
    pick = ring.blocks if split == "zigzag" else contiguous_blocks
    mine, out = held_chunks(split, rank, size), []
    for src in range(size):
        theirs = held_chunks(split, src, size)
        out += [(mine[qp], theirs[kp], causal) for qp, kp, causal in pick(rank, src, size)]
    return out


def accounting(split, rank, size):
    """What a rank computes, in c x c blocks: `blocks` computed (a causal block costs a full
    one: it is computed, then masked) and `causal_work` (the unmasked part: a diagonal
    block counts 1/2), the work an ideal kernel would do."""
    done = rank_blocks(split, rank, size)
    return {"chunks": list(held_chunks(split, rank, size)), "blocks": len(done),
            "causal_work": sum(0.5 if causal else 1.0 for *_, causal in done)}


def standin(rank, size):
    """The cp context ring_attention reads (rank, size, pass_on) with no communication:
    every ring step gets this rank's own keys and values back at once (the same shapes,
    so the same arithmetic; not the other ranks' values)."""
    return SimpleNamespace(rank=rank, size=size, pass_on=lambda t: (lambda: t))


def split_blocks(split):
    """Context in which ring_attention computes `split`'s blocks: it looks `blocks` up in
    its module at every call, so the contiguous split swaps in contiguous_blocks."""
    return mock.patch.object(ring, "blocks", contiguous_blocks) if split == "contiguous" \
        else nullcontext()


def time_call(attend, qkv, grad):
    """(forward ms, backward ms) of attend(q, k, v) and its backward."""
    import torch
    q, k, v = (t.detach().requires_grad_() for t in qkv)
    started = time.perf_counter()
    out = attend(q, k, v)
    middle = time.perf_counter()
    torch.autograd.backward(out, grad)
    return (middle - started) * 1e3, (time.perf_counter() - middle) * 1e3


def time_rank(split, rank, size, qkv, grad):
    """One ring attention call (forward, backward) as rank `rank` of `size` computes it."""
    with split_blocks(split):
        return time_call(lambda q, k, v: ring.ring_attention(q, k, v, 0.0, standin(rank, size)),
                         qkv, grad)


def time_whole(qkv, grad):
    """PyTorch's fused causal attention over the whole sequence, what one process without
    context parallelism runs (model.causal_attention): the scale of the ranks' times."""
    import torch.nn.functional as F
    return time_call(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                     qkv, grad)


def medians(samples):
    fwd, bwd = zip(*samples)
    return {"forward_ms": statistics.median(fwd), "backward_ms": statistics.median(bwd),
            "total_ms": statistics.median(f + b for f, b in samples),
            "samples_ms": [[round(f, 2), round(b, 2)] for f, b in samples]}


def measure(sizes, seq, batch, heads, head_dim, repeats):
    """(one row per (cp, split, rank): the accounting and the median times over repeats;
    the same for PyTorch's SDPA over the whole sequence)."""
    import torch
    torch.manual_seed(0)
    # q, k, v laid out as the model hands them over: (B, heads, T, d) views of one
    # (B, T, 3 x heads x d) projection (model.CausalSelfAttention); the layout changes the time
    projection = {n: torch.randn(batch, seq // n, 3, heads, head_dim) for n in [1, *sizes]}
    inputs = {n: ([t.transpose(1, 2) for t in projection[n].unbind(2)],
                  torch.randn(batch, heads, seq // n, head_dim)) for n in [1, *sizes]}
    calls = {(n, s, r): functools.partial(time_rank, s, r, n, *inputs[n])
             for n in sizes for s in SPLITS for r in range(n)}
    calls["whole"] = functools.partial(time_whole, *inputs[1])
    for call in calls.values():  # warm-up: first-call allocations are nobody's compute
        call()
    times = {key: [] for key in calls}
    for i in range(repeats):
        for key, call in calls.items():  # alternating, so a noisy moment hits every rank alike
            times[key].append(call())
        print(f"repeat {i + 1}/{repeats}", flush=True)
    rows = [{"cp": n, "split": s, "rank": r, **accounting(s, r, n), **medians(times[n, s, r])}
            for n, s, r in (key for key in calls if key != "whole")]
    return rows, medians(times["whole"])


def summarize(rows):
    """Per (cp, split): max/min over ranks of measured time, computed blocks and causal
    work, and the slowest rank's time (what a training step waits for)."""
    out = []
    for key in dict.fromkeys((r["cp"], r["split"]) for r in rows):
        mine = [r for r in rows if (r["cp"], r["split"]) == key]
        spread = {f: max(r[f] for r in mine) / min(r[f] for r in mine)
                  for f in ("total_ms", "blocks", "causal_work")}
        out.append({"cp": key[0], "split": key[1], "slowest_ms": max(r["total_ms"] for r in mine),
                    "sum_ms": sum(r["total_ms"] for r in mine),
                    **{f"ratio_{f}": v for f, v in spread.items()}})
    return out


def rank_table(rows):
    cells = [[r["cp"], r["split"], r["rank"], " + ".join(map(str, r["chunks"])), r["blocks"],
              f"{r['causal_work']:g}", f"{r['forward_ms']:.1f}", f"{r['backward_ms']:.1f}",
              f"{r['total_ms']:.1f}"] for r in rows]
    return report.table(["cp", "split", "rank", "chunks held", "c x c blocks computed",
                         "causal work (blocks)", "forward ms", "backward ms", "forward + backward ms"],
                        cells, "rlrlrrrrr")


def summary_table(summary):
    cells = [[s["cp"], s["split"], f"{s['ratio_total_ms']:.2f}x", f"{s['ratio_blocks']:.2f}x",
              f"{s['ratio_causal_work']:.2f}x", f"{s['slowest_ms']:.1f}", f"{s['sum_ms']:.1f}"]
             for s in summary]
    return report.table(["cp", "split", "max / min measured", "max / min blocks",
                         "max / min causal work", "slowest rank ms", "sum over ranks ms"],
                        cells, "rlrrrrr")


def whole_table(whole, seq):
    return report.table(["attention", "tokens", "forward ms", "backward ms", "forward + backward ms"],
                        [["PyTorch SDPA, causal, one process", seq, f"{whole['forward_ms']:.1f}",
                          f"{whole['backward_ms']:.1f}", f"{whole['total_ms']:.1f}"]], "lrrrr")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.cp_balance", description=__doc__.split("\n")[0])
    p.add_argument("--cp", default="2,4", help="context-parallel degrees (%(default)s)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (%(default)s)")
    p.add_argument("--batch", type=int, default=2, help="sequences (%(default)s)")
    p.add_argument("--heads", type=int, default=4, help="(%(default)s)")
    p.add_argument("--head-dim", type=int, default=32, help="(%(default)s)")
    p.add_argument("--repeats", type=int, default=15, help="(%(default)s)")
    p.add_argument("--out", default=os.path.join("runs", "bench", "cp_balance"))
    args = p.parse_args(argv)
    sizes = [int(n) for n in args.cp.split(",")]
    if any(args.seq % (2 * n) for n in sizes):
        p.error(f"--seq {args.seq} must be divisible by 2 x every --cp degree")

    import torch
    torch.set_num_threads(1)  # as one rank runs (OMP_NUM_THREADS=1)
    load_before = os.getloadavg()
    rows, whole = measure(sizes, args.seq, args.batch, args.heads, args.head_dim, args.repeats)
    summary = summarize(rows)
    command = report.command_line("-m bench.cp_balance", argv)
    env = report.environment(load_before)
    details = [f"q, k, v of ({args.batch} sequences, {args.heads} heads, {args.seq} // cp tokens, "
               f"{args.head_dim} per head) per rank, views of one qkv projection as in the model, "
               f"fp32, one thread; median of {args.repeats} "
               "repeats; c = seq / (2 cp) tokens per chunk",
               "measured: forward and backward of our ring attention (ring_attention.py's autograd "
               "Function) for each rank's blocks, communication replaced by a stand-in that returns "
               "the rank's own keys and values at once; contiguous: the same Function with "
               "contiguous_blocks() in place of blocks()",
               "not measured: communication and its overlap, the rest of the model (per token: "
               "the same on every rank), waiting; a training step waits for the slowest rank"]
    text = "\n".join([*report.header("Context parallelism: per-rank attention time, zigzag vs "
                                     "contiguous split", command, details, env),
                      "", "## Balance", "", *summary_table(summary),
                      "", "## Per rank", "", *rank_table(rows),
                      "", "- causal work: c x c blocks below the diagonal count 1, diagonal ones "
                      "1/2 (the unmasked half); blocks computed: what the code computes, a diagonal "
                      "block in full before masking. Both splits compute the same blocks in total; "
                      "the zigzag gives every rank the same number.",
                      "", "## Scale: no context parallelism", "", *whole_table(whole, args.seq),
                      "", "- PyTorch's fused causal attention (scaled_dot_product_attention, what "
                      "model.causal_attention runs without cp) over the whole sequence in one "
                      "process, one thread: a cp rank's time above is for 1/cp of the tokens, "
                      "computed by our ring in unfused fp32 blocks.", ""])
    settings = {k: v for k, v in vars(args).items() if k != "out"}  # --out may name this machine
    paths = report.write_results(args.out, {"command": command, "environment": env, "settings": settings,
                                            "rows": rows, "summary": summary, "whole": whole}, text)
    print(text)
    print("wrote " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
