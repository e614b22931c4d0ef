"""`python -m bench.allreduce`: torch's all-reduce against our ring all-reduce, on gloo.

    python -m bench.allreduce --size-mb 25                  # 2 processes x 1 thread
    python -m bench.allreduce --size-mb 1,25,100 --nproc 3 --iters 20 --extra

Spawns --nproc processes on loopback, runs each collective on a float32 tensor
of each size and reports the median time per call (the slowest rank's),
algorithm bandwidth (size / time), bus bandwidth (what each rank sends: x
2(N-1)/N for an all-reduce, the nccl-tests convention) and time relative to
torch's all-reduce. The ring is imported lazily from RING: until it exists its
row is skipped with a note. --extra adds all-gather and reduce-scatter (FSDP's
collectives; on gloo reduce-scatter can be slower than all-reduce). The table goes
to stdout; --json also writes it, with the command and the machine, through
bench/report.py.
"""

import argparse
import datetime
import importlib
import os
import socket
import sys
import time
from statistics import median

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # also runs as `python bench/allreduce.py`
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench import report  # noqa: E402
# torch's own collectives under either name (torch 2.13 renamed them)
from parallel.comm import all_gather_single, reduce_scatter_single  # noqa: E402

# Where our ring all-reduce lives, "module:function". A guess until the ddp branch
# lands: if it is named differently, this line (and call_ring below) is all to fix.
RING = "parallel.data_parallel.ring:ring_all_reduce"
MiB = 2**20


def load_ring(where):
    """(function, None) or (None, why it is unavailable)."""
    module, _, name = where.partition(":")
    try:
        return getattr(importlib.import_module(module), name), None
    except (ImportError, AttributeError, ValueError) as e:
        return None, (f"{where} not available ({type(e).__name__}: {e}); pass --ring "
                      "module:function or fix RING in bench/allreduce.py")


def call_ring(ring, tensor, group):
    """parallel.data_parallel.ring.ring_all_reduce(tensor, comm, group): in-place SUM over
    `group`, like dist.all_reduce, sending through a CommCounter. A returned result is
    handled too."""
    from parallel.comm import CommCounter
    out = ring(tensor, CommCounter(), group=group)
    if torch.is_tensor(out) and out is not tensor:
        tensor.copy_(out)


def timed(call, reset, warmup, iters):
    """Median over iters of the slowest rank's time for one call (all ranks start together)."""
    times = []
    for i in range(warmup + iters):
        reset()  # repeated in-place sums would grow the values without bound
        dist.barrier()
        started = time.perf_counter()
        call()
        slowest = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(slowest.item())
    return median(times)


def check_ring(ring, x, n):
    """Max relative difference of the ring's result from dist.all_reduce's."""
    want, got = x.clone(), x.clone()
    dist.all_reduce(want)
    call_ring(ring, got, dist.group.WORLD)
    scale = want.abs().max().clamp_min(1e-30)
    diff = ((got - want).abs().max() / scale).item()
    if diff > 1e-5 and ((got * n - want).abs().max() / scale).item() <= 1e-5:
        return diff, "the ring averages instead of summing: adapt call_ring"
    return diff, "ok" if diff <= 1e-5 else "MISMATCH"


def worker(rank, n, port, args, results):
    torch.set_num_threads(1)  # as the training jobs: one thread per rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n, timeout=datetime.timedelta(seconds=120))
    ring, why_not = load_ring(args.ring)
    rows, checks = [], []
    for size_mb in args.sizes:
        numel = max(n, int(size_mb * MiB) // 4 // n * n)  # divisible by n for the sharded ops
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        buf, shard = x.clone(), torch.empty(numel // n)
        ops = {"torch all_reduce": (lambda: dist.all_reduce(buf), 2 * (n - 1) / n)}
        if ring:
            checks.append((size_mb, *check_ring(ring, x, n)))
            ops["ring all_reduce"] = (lambda: call_ring(ring, buf, dist.group.WORLD), 2 * (n - 1) / n)
        if args.extra:  # sizes are the full tensor: all-gather output, reduce-scatter input
            ops["torch all_gather"] = (lambda: all_gather_single(buf, shard), (n - 1) / n)
            ops["torch reduce_scatter"] = (lambda: reduce_scatter_single(shard, buf), (n - 1) / n)
        for name, (call, bus) in ops.items():
            s = timed(call, lambda: buf.copy_(x), args.warmup, args.iters)
            rows.append({"size_mb": size_mb, "op": name, "ms": 1e3 * s,
                         "algbw_gbs": numel * 4 / s / 1e9, "busbw_gbs": numel * 4 / s / 1e9 * bus})
    if rank == 0:
        results.put({"rows": rows, "ring_checks": checks, "ring_missing": why_not})
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.allreduce", description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", default="25", help="MiB per tensor; a comma list for several")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--extra", action="store_true", help="also all-gather and reduce-scatter")
    p.add_argument("--ring", default=RING, help="our ring all-reduce, as module:function")
    p.add_argument("--json", default="", help="also write the results here (with the command "
                   "and the machine)")
    args = p.parse_args(argv)
    args.sizes = [float(s) for s in args.size_mb.split(",")]

    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    load_before = os.getloadavg()
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args.nproc, free_port(), args, results), nprocs=args.nproc)
    out = results.get()

    print(f"gloo, {args.nproc} ranks x 1 thread, median of {args.iters} calls (slowest rank)")
    print(f"{'MiB':>7} {'collective':<21} {'ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11} "
          f"{'vs torch all_reduce':>20}")
    base = {r["size_mb"]: r["ms"] for r in out["rows"] if r["op"] == "torch all_reduce"}
    for r in out["rows"]:
        r["vs_torch_all_reduce"] = r["ms"] / base[r["size_mb"]]
        print(f"{r['size_mb']:>7g} {r['op']:<21} {r['ms']:>9.2f} {r['algbw_gbs']:>11.2f} "
              f"{r['busbw_gbs']:>11.2f} {r['vs_torch_all_reduce']:>19.2f}x")
    for size_mb, diff, verdict in out["ring_checks"]:
        print(f"ring at {size_mb:g} MiB: max relative difference from dist.all_reduce "
              f"{diff:.1e} ({verdict})")
    if out["ring_missing"]:
        print(f"note: ring skipped: {out['ring_missing']}")
    if args.json:
        command = report.command_line(
            "-m bench.allreduce" if __package__ else "bench/allreduce.py", argv)
        report.write_json(args.json, {"command": command,
                                      "environment": report.environment(load_before),
                                      "nproc": args.nproc, "iters": args.iters, **out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
