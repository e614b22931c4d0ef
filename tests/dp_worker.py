"""Test-only worker for the own data-parallel strategies, run under torchrun (gloo).

    python -m torch.distributed.run --standalone --nproc_per_node=W tests/dp_worker.py

Every rank runs the checks below in the same order; rank 0 prints one line
`RESULT <json>` that tests/test_ddp_own.py asserts on. The worker only
measures and reports (no asserts), so all ranks always reach the same
collectives and a wrong result cannot turn into a hang.

- ring:   parallel/data_parallel/ring.py against dist.all_reduce on random tensors of uneven sizes
          (0, 1, < W, not divisible by W, ...), sync and async with several rings in flight;
- train:  a strategy built by hand trains a few steps; after every step an
          all_gather of the full parameter vector says whether all ranks hold
          bit-identical parameters, and a single-process replica of the same
          global batch (rank 0's initial weights) gives the parity differences
          (gradients after the sync, losses, parameters); forward_backward must
          leave the parameters untouched;
- unused: a parameter that never gets a gradient must raise a UserError naming it.
"""

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from errors import UserError  # noqa: E402
from launch.exit import flush_and_exit  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from parallel.parallelize import parallelize  # noqa: E402
from parallel.comm import CommCounter  # noqa: E402
from parallel.config import ParallelConfig  # noqa: E402
from parallel.grid import DIMS, ProcessGrid  # noqa: E402
from parallel.data_parallel.ring import RingRunner, ring_all_reduce  # noqa: E402
from training.config import TrainerConfig  # noqa: E402

# odd vocabulary, so no parameter size is a multiple of 2, 3 or 4 by accident
GPT_CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=16)
BATCH, STEPS = 12, 4
TRAIN = [  # (dp, allreduce, bucket_cap_mb, grad_accum)
    ("ddp_naive", "native", 25.0, 1),
    ("ddp_naive", "ring", 25.0, 2),
    ("ddp_bucket", "native", 0.001, 2),
    ("ddp_bucket", "ring", 0.001, 1),
    ("ddp_bucket", "ring", 25.0, 3),
]


def check_ring(world, rank):
    """Max |ring - dist.all_reduce| over many sizes, and whether ranks agree bit for bit."""
    gen = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    sizes = [0, 1, world - 1, world, world + 1, 2 * world + 1, 7, 1000, 4099, 65537]
    worst, identical, comm = {}, True, CommCounter()

    def compare(ring_result, x, dtype):
        """Record max |ring - all_reduce| / max |all_reduce| per dtype."""
        nonlocal identical
        expected = x.clone()
        dist.all_reduce(expected)
        diff = 0.0
        if x.numel():
            diff = ((ring_result - expected).abs().max() / expected.abs().max().clamp(min=1)).item()
        worst[str(dtype)] = max(worst.get(str(dtype), 0.0), diff)
        gathered = [torch.empty_like(ring_result) for _ in range(world)]
        dist.all_gather(gathered, ring_result)
        identical &= all(torch.equal(g, ring_result) for g in gathered)

    for dtype in (torch.float32, torch.float64, torch.int64):
        for n in sizes:
            x = (torch.randn(n, generator=gen, dtype=torch.float64) * 10).to(dtype)
            compare(ring_all_reduce(x.clone(), comm), x, dtype)
    # non-contiguous input, shaped
    x = torch.randn(9, 7, generator=gen).t()
    compare(ring_all_reduce(x.clone().t().contiguous().t(), comm), x, torch.float32)
    # async: several rings in flight at once, waited in reverse order
    runner = RingRunner(comm)
    xs = [torch.randn(n, generator=gen) for n in (5, 301, world - 1, 2048)]
    outs = [x.clone() for x in xs]
    handles = [runner.submit(o) for o in outs]
    for h in reversed(handles):
        h.wait()
    for o, x in zip(outs, xs):
        compare(o, x, torch.float32)
    return {"rel_diff": worst, "identical_across_ranks": identical,
            "sends": comm.calls["send"], "recvs": comm.calls["recv"]}


def global_batch(step):
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(GPT_CFG.vocab_size, (BATCH, GPT_CFG.block_size + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


class OneRank:
    """Just enough of a ProcessGrid for a single-process reference replica: every
    dimension of grid.DIMS of size 1 (`<dim>_size`, `<dim>_rank`), so a new dimension
    needs no line here."""
    grad_size = data_size = shard_size = world_size = 1
    grad_rank = data_rank = shard_rank = rank = 0
    ep_size, ep_rank, ep_group = 1, 0, None  # no expert parallelism (ProcessGrid.carve_experts)
    sizes = {d: 1 for d in DIMS}
    is_main = True
    device = torch.device("cpu")


for _dim in DIMS:
    setattr(OneRank, f"{_dim}_size", 1)
    setattr(OneRank, f"{_dim}_rank", 0)


def check_train(grid, dp, allreduce, cap, accum):
    tcfg = TrainerConfig(lr=3e-3, weight_decay=0.1)
    torch.manual_seed(1234 + grid.rank)  # replicas start DIFFERENT: the broadcast must fix it
    strategy = parallelize(GPT(GPT_CFG), grid,
                              ParallelConfig(dp=dp, allreduce=allreduce, bucket_cap_mb=cap))
    strategy.configure_optimizer(tcfg)
    torch.manual_seed(1234)  # rank 0's initial weights
    ref = parallelize(GPT(GPT_CFG), OneRank(), ParallelConfig(dp="single"))
    ref.configure_optimizer(tcfg)
    comm = strategy.comm_stats()  # the start-up broadcast
    out = {"identical_each_step": [], "loss_rel_diff": 0.0, "grad_rel_diff": 0.0,
           "param_max_abs_diff": 0.0, "params_changed_in_backward": False,
           "grads_in_buckets": True, "broadcast": comm.get("comm_broadcast_calls", 0),
           "all_reduce_calls": [], "send_calls": [],
           "buckets": len(getattr(strategy, "buckets", []))}
    if hasattr(strategy, "buckets"):  # spy: how many buckets start while backward still runs?
        out["early_launches"], start = 0, strategy.start_all_reduce

        def spy(flat, bucket):
            out["early_launches"] += not all(all(b.ready) for b in strategy.buckets)
            return start(flat, bucket)
        strategy.start_all_reduce = spy
    per_rank = BATCH // grid.dp_size
    for step in range(STEPS):
        x, y = global_batch(step)
        mine = slice(grid.dp_rank * per_rank, (grid.dp_rank + 1) * per_rank)
        micro = list(zip(x[mine].chunk(accum), y[mine].chunk(accum)))
        before = [p.detach().clone() for p in strategy.module.parameters()]
        loss = strategy.forward_backward(micro)
        # only the optimizer may change a parameter: a sync that all-reduces parameter
        # values instead of gradients (picotron's naive DP) changes them here
        out["params_changed_in_backward"] |= not all(
            torch.equal(b, p) for b, p in zip(before, strategy.module.parameters()))
        for bucket in getattr(strategy, "buckets", []):  # .grad must be views, not copies
            for p, view in zip(bucket.params, bucket.views):
                out["grads_in_buckets"] &= p.grad is not None and p.grad.data_ptr() == view.data_ptr()
        out["grads_in_buckets"] &= getattr(strategy, "grads_copied", 0) == 0  # accumulated in place
        ref_loss = ref.forward_backward([(x, y)])
        for p, rp in zip(strategy.module.parameters(), ref.module.parameters()):
            scale = rp.grad.abs().max().item() or 1.0
            out["grad_rel_diff"] = max(out["grad_rel_diff"],
                                       (p.grad - rp.grad).abs().max().item() / scale)
        for s in (strategy, ref):
            s.clip_grad_norm_(1.0)
            s.optimizer_step(tcfg.lr)
        stats = strategy.comm_stats()
        out["all_reduce_calls"].append(stats.get("comm_all_reduce_calls", 0))
        out["send_calls"].append(stats.get("comm_send_calls", 0))
        out["loss_rel_diff"] = max(out["loss_rel_diff"], abs(loss - ref_loss) / abs(ref_loss))

        flat = torch.cat([p.detach().reshape(-1) for p in strategy.module.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(grid.dp_size)]
        dist.all_gather(everyone, flat)
        out["identical_each_step"].append(all(torch.equal(f, flat) for f in everyone))
        ref_flat = torch.cat([p.detach().reshape(-1) for p in ref.module.parameters()])
        out["param_max_abs_diff"] = max(out["param_max_abs_diff"],
                                        (flat - ref_flat).abs().max().item())
    return out


def check_unused(grid, dp, cap):
    torch.manual_seed(1234)
    model = GPT(GPT_CFG)
    model.register_parameter("spare", torch.nn.Parameter(torch.zeros(5)))  # never used
    strategy = parallelize(model, grid, ParallelConfig(dp=dp, bucket_cap_mb=cap))
    strategy.configure_optimizer(TrainerConfig())
    x, y = global_batch(0)
    try:
        strategy.forward_backward([(x, y)])
    except UserError as e:
        return str(e)
    return None


def compute():
    rank, world = dist.get_rank(), dist.get_world_size()
    grid = ProcessGrid({"dp": world}, torch.device("cpu"))
    result = {"ring": check_ring(world, rank), "train": {}, "unused": {}}
    for dp, allreduce, cap, accum in TRAIN:
        result["train"][f"{dp}-{allreduce}-{cap}-{accum}"] = check_train(grid, dp, allreduce, cap, accum)
    for dp, cap in (("ddp_naive", 25.0), ("ddp_bucket", 25.0), ("ddp_bucket", 0.001)):
        result["unused"][f"{dp}-{cap}"] = check_unused(grid, dp, cap)
    return result


def report_and_exit(main):
    """Run a worker's main; rank 0 prints RESULT inside it. Exit through os._exit: the
    teardown after destroy_process_group sometimes aborts (SIGABRT)."""
    code = 0
    try:
        main()
    except BaseException:
        traceback.print_exc()
        code = 1
    flush_and_exit(code)


def reuse_groups():
    """From here on, `dist.new_group` with the ranks, timeout and backend of an earlier
    call returns that group instead of a new one. A worker builds a ProcessGrid per case,
    about a hundred in a session, and each grid its groups; a group is never freed
    (torch's registry holds it until destroy_process_group), and each gloo group keeps a
    thread that wakes every 10 ms: by the last case a 4-rank session spent more CPU in
    those wake-ups than in its cases. The cases run one after another, each to its
    last collective, so a group reused by the next case carries nothing over; within
    one grid every group has other ranks (the host group: all of them, but a group of
    its own, as in a run). Every rank asks for the same groups in the same order, so
    every rank reuses the same ones."""
    made, create = {}, dist.new_group

    def new_group(ranks=None, timeout=None, backend=None, **more):
        key = (None if ranks is None else tuple(ranks), timeout, backend, tuple(sorted(more.items())))
        if key not in made:
            made[key] = create(ranks, timeout=timeout, backend=backend, **more)
        return made[key]
    dist.new_group = new_group


def serve(compute, timeout_s=60):
    """A torchrun test worker's whole life: gloo with one thread per rank (its groups
    reused: reuse_groups), `compute()` on
    every rank, and its (JSON-able) result printed once, by rank 0, as the `RESULT {...}`
    line the tests read; then report_and_exit's exit status. TEST_WORKER_TIMEOUT_S, when
    set, replaces timeout_s (a session run ahead on idle CPU: prefetch.py)."""
    timeout_s = float(os.environ.get("TEST_WORKER_TIMEOUT_S", timeout_s))

    def main():
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        reuse_groups()
        result = compute()
        dist.barrier()
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
        dist.destroy_process_group()
    report_and_exit(main)


if __name__ == "__main__":
    serve(compute)
