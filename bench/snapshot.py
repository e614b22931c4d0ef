"""`python -m bench.snapshot`: what a sharded snapshot costs, per rank, at 1, 2 and 4 ranks.

    python -m bench.snapshot                          # default model, ddp_bucket and fsdp3
    python -m bench.snapshot --nproc 1,2,4 --repeats 5 --out docs/bench/snapshot

For each strategy and world size, one torchrun job builds the benchmark's
default model (~3.2M parameters) under that strategy, trains one step (so
AdamW state exists), then times `save_sharded` (each rank writes its part)
and `open_snapshot` + `load_shards` (each rank reads back what it holds),
`--repeats` times, on a local directory. Reports the slowest rank's write
and read time (median over repeats) and the bytes each rank wrote and read,
in --out's results.json and results.md (written by bench/report.py).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import report  # noqa: E402

STRATEGIES = {"ddp_bucket": ["parallel.dp=ddp_bucket"],
              "fsdp3": ["parallel.dp=fsdp", "parallel.zero_stage=3"]}
MODEL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=256", "data.block_size=128",
         "trainer.batch_size=16"]


def worker(overrides, directory, repeats):
    """Runs inside each torchrun rank."""
    import torch
    import torch.distributed as dist
    from dataclasses import asdict
    from config import load_config
    from checkpoint.snapshot_reader import open_snapshot
    from checkpoint.snapshot_writer import save_sharded
    from main import init_process_group
    from model import GPT, GPTConfig
    from parallel.parallelize import parallelize
    from parallel.grid import ProcessGrid
    from parallel.layout import grid_sizes

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = load_config(overrides, world)
    device = torch.device("cpu")
    init_process_group(device, 120, rank, world)
    grid = ProcessGrid(grid_sizes(cfg.parallel, world), device)  # as main.py builds it
    torch.manual_seed(0)
    gpt = GPTConfig(**asdict(cfg.model), vocab_size=65, block_size=cfg.data.block_size)
    strategy = parallelize(GPT(gpt), grid, cfg.parallel)
    strategy.configure_optimizer(cfg.trainer)
    per_rank = cfg.trainer.batch_size // world
    x = torch.randint(0, 65, (per_rank, cfg.data.block_size))
    strategy.forward_backward([(x, x)])
    strategy.clip_grad_norm_(1.0)
    strategy.optimizer_step(1e-3)

    meta = {"gpt_config": asdict(gpt), "config": {}}
    writes, reads, written = [], [], 0
    for i in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        pieces = strategy.shard_pieces()
        save_sharded(directory, grid, i + 1, pieces, meta)
        writes.append(time.perf_counter() - started)
        written = sum(t.numel() * t.element_size() for *_, t in pieces)
        dist.barrier()
        started = time.perf_counter()
        strategy.load_shards(open_snapshot(directory))
        reads.append(time.perf_counter() - started)
    slowest = torch.tensor([statistics.median(writes), statistics.median(reads)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    sizes = [None] * world
    dist.all_gather_object(sizes, written)
    if rank == 0:
        print("RESULT " + json.dumps({"write_s": slowest[0].item(), "read_s": slowest[1].item(),
                                      "bytes_per_rank": sizes}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run(strategy, nproc, repeats):
    with tempfile.TemporaryDirectory(prefix="bench-snapshot-") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "-m", "bench.snapshot", "--worker",
               "--dir", os.path.join(tmp, "snap"), "--repeats", str(repeats),
               *MODEL, *STRATEGIES[strategy]]
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode or not lines:
            raise SystemExit(f"{strategy} x{nproc} failed:\n{out.stderr[-3000:]}")
        return json.loads(lines[0][len("RESULT "):])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.snapshot", description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--nproc", default="1,2,4")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/bench/snapshot")
    args, overrides = p.parse_known_args(argv)
    if args.worker:
        return worker(overrides, args.dir, args.repeats)

    load_before, rows = os.getloadavg(), []
    for strategy in args.strategies.split(","):
        for n in (int(v) for v in args.nproc.split(",")):
            r = run(strategy, n, args.repeats)
            rows.append({"strategy": strategy, "ranks": n, **r})
            print(f"{strategy:<11} x{n}: write {r['write_s'] * 1e3:7.1f} ms  read {r['read_s'] * 1e3:7.1f} ms"
                  f"  MB per rank {[round(b / 2**20, 2) for b in r['bytes_per_rank']]}", flush=True)
    command = report.command_line("-m bench.snapshot", argv)
    env = report.environment(load_before)
    text = "\n".join(report.header("Snapshot cost", command, [
        f"default bench model, local disk, median of {args.repeats} repeats, slowest rank"], env)
        + ["", *table(rows), ""])
    report.write_results(args.out, {"command": command, "environment": env, "rows": rows}, text)
    print(text)


def table(rows):
    """results.md's table: one row per strategy and world size (results.json's rows)."""
    cells = []
    for r in rows:
        b = r["bytes_per_rank"]
        cells.append([r["strategy"], r["ranks"], f"{r['write_s'] * 1e3:.1f}", f"{r['read_s'] * 1e3:.1f}",
                      f"{min(b) / 2**20:.2f}-{max(b) / 2**20:.2f}", f"{sum(b) / 2**20:.2f}"])
    return report.table(["strategy", "ranks", "write ms", "read ms", "MB written per rank (min-max)",
                         "total MB"], cells)


if __name__ == "__main__":
    sys.exit(main())
