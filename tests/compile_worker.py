"""Test-only worker for trainer.compile (issue 23), under torchrun (gloo) on 2 ranks.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/compile_worker.py

For each layout of LAYOUTS every rank (a one-process layout: one rank, and the
others gather its result) builds the strategy by hand twice, eager and compiled
(backend aot_eager: dynamo's capture and AOT autograd, as inductor gets them, without
inductor's minutes of code generation on this CPU), and trains both
STEPS steps on the same fixed global batches, evaluating at EVAL_AT:
- per-step losses and pre-clip gradient norms, compiled against eager;
- every step's collectives by kind and bytes (fsdp's gathers, TP's f/g, the
  buckets, the pipeline's sends): compilation must not add, drop or hide one;
- compilations per code object, counted afresh for each layout (dynamo reset),
  over training and evaluation, and every graph break's reason: only the
  collectives and random-stream switches marked `torch.compiler.disable` may
  split a block, and no frame may fall back to eager;
- ddp_bucket: buckets whose all-reduce started while backward still ran.

Like tests/precision_worker.py, it only measures (rank 0 prints `RESULT <json>`),
so a wrong result cannot hang a rank.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dp_worker import OneRank, serve  # noqa: E402
from layout_worker import global_batch, gpt_config  # noqa: E402
from model import GPT  # noqa: E402
from parallel.parallelize import parallelize  # noqa: E402
from parallel.compile import compile_events  # noqa: E402
from parallel.config import ParallelConfig  # noqa: E402
from parallel.grid import ProcessGrid  # noqa: E402
from training.config import TrainerConfig  # noqa: E402

# two evaluations between training steps: every signature a block meets (training,
# evaluation, training again after it) is compiled and met again
STEPS, EVAL_AT, VOCAB, LR, BATCH = 4, (2, 4), 65, 3e-3, 16
PP = lambda schedule, m, **more: {"pp_schedule": schedule, "microbatches": m, **more}  # noqa: E731

# name: (dp strategy, (dp, pp, tp, cp), more ParallelConfig, more TrainerConfig, model)
LAYOUTS = {
    "single": ("single", (1, 1, 1, 1), {}, {}, {}),
    "single-whole-model": ("single", (1, 1, 1, 1), {}, {"compile_scope": "model"}, {}),
    "ddp_naive": ("ddp_naive", (2, 1, 1, 1), {}, {}, {}),
    "ddp_bucket-tinycap": ("ddp_bucket", (2, 1, 1, 1), {"bucket_cap_mb": 0.001}, {}, {}),
    "fsdp1": ("fsdp", (2, 1, 1, 1), {"zero_stage": 1}, {}, {}),
    "fsdp2": ("fsdp", (2, 1, 1, 1), {"zero_stage": 2}, {}, {}),
    "fsdp3": ("fsdp", (2, 1, 1, 1), {"zero_stage": 3}, {}, {}),
    "tp2": ("single", (1, 1, 2, 1), {}, {}, {}),
    "tp2-sp": ("single", (1, 1, 2, 1), {"sequence_parallel": True}, {}, {}),
    "pp2-gpipe-m4": ("single", (1, 2, 1, 1), PP("gpipe", 4), {}, {}),
    "pp2-1f1b-m2": ("single", (1, 2, 1, 1), PP("1f1b", 2), {}, {}),
    "pp2-interleaved-v2-m2": ("single", (1, 2, 1, 1), PP("interleaved", 2, pp_virtual_stages=2),
                              {}, {"n_layer": 4}),
    "cp2": ("ddp_bucket", (1, 1, 1, 2), {}, {}, {}),
    "fsdp3-recompute": ("fsdp", (2, 1, 1, 1), {"zero_stage": 3}, {"activation_checkpointing": True}, {}),
    # dropout on: the recompute must replay the TP rank's own stream in compiled code too
    "tp2-sp-recompute-dropout": ("single", (1, 1, 2, 1), {"sequence_parallel": True},
                                 {"activation_checkpointing": True}, {"dropout": 0.1}),
    "pp2-1f1b-m2-recompute": ("single", (1, 2, 1, 1), PP("1f1b", 2),
                              {"activation_checkpointing": True}, {}),
    "ddp_bucket-bf16": ("ddp_bucket", (2, 1, 1, 1), {}, {"precision": "bf16"}, {}),
    "tp2-bf16": ("single", (1, 1, 2, 1), {}, {"precision": "bf16"}, {}),
}
ALLOWED_BREAK = "torch.compiler.disable"  # the only graph breaks a block may have


def build(layout, compiled):
    kind, (dp, pp, tp, cp), pcfg, more, model = layout
    tcfg = TrainerConfig(lr=LR, weight_decay=0.1, compile=compiled, compile_backend="aot_eager",
                         **more)
    torch.manual_seed(1234)
    gpt = GPT(gpt_config(VOCAB, model.get("n_layer", 2), model.get("dropout", 0.0)))
    config = ParallelConfig(dp=kind, tp=tp, pp=pp, cp=cp, **pcfg)
    grid = OneRank() if dp * pp * tp * cp == 1 else ProcessGrid(
        {"dp": dp, "pp": pp, "tp": tp, "cp": cp}, torch.device("cpu"))
    strategy = parallelize(gpt, grid, config)
    strategy.configure_compute(tcfg)
    strategy.configure_optimizer(tcfg)
    strategy.comm_stats()  # drop start-up traffic
    return strategy, grid


def train(layout, compiled):
    """Per step (loss, grad norm, collectives), the eval losses, and ddp_bucket's spy."""
    strategy, grid = build(layout, compiled)
    spy = {"early_launches": 0}
    if hasattr(strategy, "buckets"):
        start = strategy.start_all_reduce

        def early(flat, bucket):  # a bucket launched while some gradient is still to come
            spy["early_launches"] += not all(all(b.ready) for b in strategy.buckets)
            return start(flat, bucket)
        strategy.start_all_reduce = early
    per_rank = BATCH // grid.dp_size
    steps, evals = [], []
    for step in range(STEPS):
        x, y = global_batch(step, VOCAB)
        mine = slice(grid.dp_rank * per_rank, (grid.dp_rank + 1) * per_rank)
        strategy.reseed(step * 1009)
        loss = strategy.forward_backward([(x[mine], y[mine])])
        norm = strategy.clip_grad_norm_(1.0)
        strategy.optimizer_step(LR)
        steps.append((loss, norm, strategy.comm_stats()))
        strategy.step_stats()
        if step + 1 in EVAL_AT:  # no grad, eval mode (and under a pipeline another shape)
            evals.append(strategy.eval_loss(x[mine], y[mine]))
    spy["grads_copied"] = getattr(strategy, "grads_copied", 0)
    return steps, evals, spy


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def check(layout):
    eager, eager_evals, _ = train(layout, False)
    torch._dynamo.reset()  # this layout's compilations, counted from nothing
    torch._dynamo.utils.counters.clear()
    got, evals, spy = train(layout, True)
    events = compile_events()
    counters = torch._dynamo.utils.counters
    breaks = [reason.splitlines()[0] for reason in counters["graph_break"]]
    return {
        "loss_rel_diff": max(rel(g[0], e[0]) for g, e in zip(got, eager)),
        "norm_rel_diff": max(rel(g[1], e[1]) for g, e in zip(got, eager)),
        "eval_rel_diff": max(rel(g, e) for g, e in zip(evals, eager_evals)),
        "comm_equal": all(g[2] == e[2] for g, e in zip(got, eager)),
        "comm_calls": got[-1][2].get("comm_calls", 0),
        **events.counts(),
        "frames_failed": counters["frames"]["total"] - counters["frames"]["ok"],
        "unexpected_breaks": sorted({b for b in breaks if ALLOWED_BREAK not in b}),
        "disabled_breaks": sum(n for r, n in counters["graph_break"].items() if ALLOWED_BREAK in r),
        **spy,
    }


def one_process(name):
    dp, pp, tp, cp = LAYOUTS[name][1]
    return dp * pp * tp * cp == 1


def compute():
    """Layouts over every rank in order; the one-process layouts (no collectives) shared
    out, one rank each, and their results gathered: each is compiled once, not on every rank."""
    names = sys.argv[1].split(",") if sys.argv[1:] else list(LAYOUTS)
    rank, world = dist.get_rank(), dist.get_world_size()
    alone = [n for n in names if one_process(n)]
    mine = {n: check(LAYOUTS[n]) for i, n in enumerate(alone) if i % world == rank}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    done = {n: r for results in everyone for n, r in results.items()}
    return {name: done[name] if name in done else check(LAYOUTS[name]) for name in names}


if __name__ == "__main__":
    serve(compute, timeout_s=120)
