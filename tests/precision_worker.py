"""Test-only worker for issue 10's compute options, under torchrun (gloo) on 2 ranks.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/precision_worker.py

Like tests/layout_worker.py, every rank builds strategies by hand, trains them on
fixed global batches and measures against a single-process replica it trains
itself; rank 0 prints `RESULT <json>` and the worker never asserts, so a wrong
result cannot hang a rank.

- precision: bf16 and fp16 (trainer.precision), STEPS steps, `single` against
  fp32 `single`, and every layout of LAYOUTS against `single` in the same
  precision: per-step losses and
  pre-clip gradient norms (relative differences), and the steps fp16
  skipped on every rank (a small fp16_growth_interval makes the scaler
  overflow and back off several times, so skipping must be agreed);
- reduce: parallel.reduce_dtype=bf16 against fp32 reduction, the same layout:
  collective bytes of each step by kind, and the loss difference;
- sp_bytes: tp=2 with sequence parallelism, one step in fp32 and in bf16: the bytes
  its all-gathers and reduce-scatters move (bf16 sends the gathered activations in
  bf16: at most 0.55x fp32's);
- recompute: trainer.activation_checkpointing (full, selective, selective on
  every 2nd block) against the same layout without it, fp32, with dropout 0.1: per-step losses, and the gradients of
  one step on every rank, which must be bitwise equal (the TP random
  streams and fsdp's gather hooks replayed in the recompute). Layouts where a
  forward follows a recompute within one step (gradient accumulation, and on 4
  ranks, `recompute4`, TP x PP under 1F1B) show a TP stream the recompute
  left rewound.

    ... tests/precision_worker.py recompute4   # --nproc_per_node=4: only RECOMPUTE4
                                               # (the tests run it in layout_worker's 4-rank session)
    ... tests/precision_worker.py sp_bytes     # only sp_bytes (quick, by hand)
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
from parallel.config import ParallelConfig  # noqa: E402
from parallel.grid import ProcessGrid  # noqa: E402
from training.config import TrainerConfig  # noqa: E402

STEPS, VOCAB, LAYERS, LR = 30, 65, 2, 3e-3
FP16 = {"fp16_growth_interval": 3}  # the scale grows until it overflows, then halves: skipped steps

# name: (dp strategy, (dp, pp, tp), more ParallelConfig)
LAYOUTS = {
    "ddp_naive": ("ddp_naive", (2, 1, 1), {}),
    "ddp_bucket-ring": ("ddp_bucket", (2, 1, 1), {"allreduce": "ring", "bucket_cap_mb": 0.001}),
    "fsdp1": ("fsdp", (2, 1, 1), {"zero_stage": 1}),
    "fsdp2": ("fsdp", (2, 1, 1), {"zero_stage": 2}),
    "fsdp3": ("fsdp", (2, 1, 1), {"zero_stage": 3}),
    "tp2-sp": ("single", (1, 1, 2), {"sequence_parallel": True}),
    "pp2-1f1b-m2": ("single", (1, 2, 1), {"pp_schedule": "1f1b", "microbatches": 2}),
}
REDUCE = {**{n: LAYOUTS[n] for n in ("ddp_naive", "ddp_bucket-ring", "fsdp1", "fsdp2", "fsdp3")},
          # 2 replica groups of 1: the all-reduce across them carries the gradient
          "hsdp2x1-fsdp2": ("fsdp", (2, 1, 1), {"zero_stage": 2, "dp_replicate": 2})}
RECOMPUTE = {  # name: layout, dropout
    "single": ("single", (1, 1, 1), {}),
    "fsdp1": LAYOUTS["fsdp1"],
    "fsdp3": LAYOUTS["fsdp3"],
    "ddp_bucket": ("ddp_bucket", (2, 1, 1), {}),
    "tp2": ("single", (1, 1, 2), {}),
    "tp2-sp": LAYOUTS["tp2-sp"],
    "pp2-1f1b-m2": LAYOUTS["pp2-1f1b-m2"],
    "tp2-accum2": ("single", (1, 1, 2), {"accum": 2}),  # a forward after each recompute
}
RECOMPUTE4 = {  # 4 ranks: the last stage's 1F1B runs F1 after B0's recompute; two blocks a
    # stage, or the stream after recomputing a stage's only block is where F0 left it anyway
    "tp2-pp2-1f1b-m2": ("single", (1, 2, 2), {"pp_schedule": "1f1b", "microbatches": 2,
                                               "layers": 4}),
}


def build(layout, tcfg, dropout=0.0, **more):
    kind, (dp, pp, tp), extra = layout
    layers = extra.get("layers", LAYERS)
    extra = {k: v for k, v in extra.items() if k not in ("accum", "layers")}  # not config keys
    torch.manual_seed(1234)
    model = GPT(gpt_config(VOCAB, layers, dropout))
    pcfg = ParallelConfig(dp=kind, tp=tp, pp=pp, **{**extra, **more})
    if dp * pp * tp == 1:  # the single-process replica, on every rank
        grid = OneRank()
        strategy = parallelize(model, grid, pcfg)
    else:  # dp: the data-parallel ranks, in parallel.dp_replicate groups
        replicas = extra.get("dp_replicate", 1)
        grid = ProcessGrid({"dp_replicate": replicas, "dp": dp // replicas, "pp": pp, "tp": tp},
                           torch.device("cpu"))
        strategy = parallelize(model, grid, pcfg)
    strategy.configure_compute(tcfg)
    strategy.configure_optimizer(tcfg)
    strategy.comm_stats()  # drop start-up traffic
    return strategy, grid


def train(layout, tcfg, steps, dropout=0.0, grads_at=None, **more):
    """Per-step (loss, grad norm, skipped, comm) and, at step grads_at, this rank's gradients."""
    strategy, grid = build(layout, tcfg, dropout, **more)
    per_rank, accum = 16 // grid.data_size, layout[2].get("accum", 1)
    out, grads = [], None
    for step in range(steps):
        x, y = global_batch(step, VOCAB)
        mine = slice(grid.data_rank * per_rank, (grid.data_rank + 1) * per_rank)
        strategy.reseed(step * 1009)
        loss = strategy.forward_backward(list(zip(x[mine].chunk(accum), y[mine].chunk(accum))))
        if step == grads_at:
            grads = [g.detach().clone() for g in strategy.grads()]
        norm = strategy.clip_grad_norm_(1.0)
        strategy.optimizer_step(LR)
        comm = strategy.comm_stats()
        strategy.step_stats()
        out.append((loss, norm, strategy.precision.skip_step, comm))
    return out, grads


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def check_precision(precision, fp32):
    tcfg = TrainerConfig(lr=LR, weight_decay=0.1, precision=precision, **FP16)
    ref, _ = train(("single", (1, 1, 1), {}), tcfg, STEPS)
    # the reference itself against fp32: a fault common to every layout (clipping still
    # scaled gradients, say) keeps parity but moves the run away from fp32's
    result = {"single_vs_fp32": {
        "loss_rel_diff": max(rel(g[0], r[0]) for g, r in zip(ref, fp32)),
        "norm_rel_diff": max(rel(g[1], r[1]) for g, r in zip(ref, fp32) if not g[2])}}
    for name, layout in LAYOUTS.items():
        got, _ = train(layout, tcfg, STEPS)
        # gradient norms compare while both runs skipped the same steps (after a step one
        # of them skipped, they train different models); the losses, over all 30 steps
        same = next((i for i, (g, r) in enumerate(zip(got, ref)) if g[2] != r[2]), STEPS)
        finite = [(g, r) for g, r in zip(got[:same], ref[:same]) if not (g[2] or r[2])]
        result[name] = {
            "loss_rel_diff": max(rel(g[0], r[0]) for g, r in zip(got, ref)),
            "norm_rel_diff": max(rel(g[1], r[1]) for g, r in finite), "norm_steps": len(finite),
            "skipped": [s for s, g in enumerate(got) if g[2]],
            "ref_skipped": [s for s, r in enumerate(ref) if r[2]],
            "skip_agreed": agreed([g[2] for g in got]),
        }
    return result


def agreed(flags):
    """Did every rank skip the same steps?"""
    mine = torch.tensor([int(f) for f in flags])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(e, mine) for e in everyone)


def check_stage_dtypes(precision):
    """The dtypes of every Linear's output on each pipeline stage (pp=2, 1F1B, M=2) in one
    step under `precision`'s autocast: a stage left in fp32 shows as float32."""
    tcfg = TrainerConfig(lr=LR, weight_decay=0.1, precision=precision)
    strategy, grid = build(LAYOUTS["pp2-1f1b-m2"], tcfg)
    seen = set()
    for m in strategy.module.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out: seen.add(str(out.dtype)))
    x, y = global_batch(0, VOCAB)
    strategy.reseed(0)
    strategy.forward_backward([(x, y)])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(seen))
    return everyone


def check_reduce():
    tcfg = TrainerConfig(lr=LR, weight_decay=0.1)
    result = {}
    for name, layout in REDUCE.items():
        fp32, _ = train(layout, tcfg, 10)
        bf16, _ = train(layout, tcfg, 10, reduce_dtype="bf16")
        result[name] = {"comm_fp32": fp32[-1][3], "comm_bf16": bf16[-1][3],
                        "loss_rel_diff": max(rel(b[0], f[0]) for b, f in zip(bf16, fp32))}
    return result


def check_sp_bytes():
    """{precision: that step's all-gather and reduce-scatter bytes} of tp2-sp, 4 blocks
    (the default model's depth: the embedding's fp32 reduce-scatter weighs less the
    deeper the model)."""
    out = {}
    layout = ("single", (1, 1, 2), {"sequence_parallel": True, "layers": 4})
    for precision in ("fp32", "bf16"):
        tcfg = TrainerConfig(lr=LR, weight_decay=0.1, precision=precision)
        steps, _ = train(layout, tcfg, 1)
        comm = steps[-1][3]
        out[precision] = {k: comm.get(k, 0) for k in ("comm_all_gather_bytes",
                                                      "comm_reduce_scatter_bytes")}
    return out


# variant: (trainer.activation_checkpointing_mode, activation_checkpointing_every); every=2
# recomputes block 0 of 2 (of 4 under RECOMPUTE4: one block a stage)
RECOMPUTE_MODES = {"full": ("full", 1), "selective": ("selective", 1), "selective-every2": ("selective", 2)}


def check_recompute(layouts):
    result = {}
    for name, layout in layouts.items():
        plain, g_plain = train(layout, TrainerConfig(lr=LR, weight_decay=0.1), 4, dropout=0.1, grads_at=2)
        result[name] = {}
        for variant, (mode, every) in RECOMPUTE_MODES.items():
            tcfg = TrainerConfig(lr=LR, weight_decay=0.1, activation_checkpointing=True,
                                 activation_checkpointing_mode=mode, activation_checkpointing_every=every)
            recomputed, g_ckpt = train(layout, tcfg, 4, dropout=0.1, grads_at=2)
            same_grads = len(g_plain) == len(g_ckpt) and all(torch.equal(a, b) for a, b in zip(g_plain, g_ckpt))
            flags = torch.tensor([int(same_grads)])
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            result[name][variant] = {"losses_equal": [p[0] == r[0] for p, r in zip(plain, recomputed)],
                                     "grads_bitwise_equal_on_every_rank": bool(flags.item())}
    return result


def compute():
    if sys.argv[1:] == ["recompute4"]:
        return {"recompute": check_recompute(RECOMPUTE4)}
    if sys.argv[1:] == ["sp_bytes"]:
        return {"sp_bytes": check_sp_bytes()}
    fp32, _ = train(("single", (1, 1, 1), {}), TrainerConfig(lr=LR, weight_decay=0.1), STEPS)
    return {"precision": {p: check_precision(p, fp32) for p in ("bf16", "fp16")},
            "stage_dtypes": {p: check_stage_dtypes(p) for p in ("bf16", "fp16")},
            "reduce": check_reduce(), "recompute": check_recompute(RECOMPUTE),
            "sp_bytes": check_sp_bytes()}


if __name__ == "__main__":
    serve(compute)
