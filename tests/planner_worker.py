"""Test-only worker for the planner (issue 22), under torchrun (gloo), 2 or 4 ranks.

    python -m torch.distributed.run --standalone --nproc_per_node=W tests/planner_worker.py

For each layout of CASES[W] every rank builds the strategy by hand (as
tests/layout_worker.py does) and trains STEPS steps on fixed global batches, with
telemetry/activation_meter.py around each forward_backward, as the trainer does under
`trainer.measure_activations=true`. Each rank reports, for the last step, what the
trainer would write to metrics.jsonl if it were rank 0: its collectives by kind
(`comm_stats()`), `state_bytes()` (the max over ranks) and its own activation peak.
tests/test_planner.py holds the planner's predictions for the same layouts equal to
them. It only measures (rank 0 prints `RESULT <json>`), so a wrong figure cannot hang.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dp_worker import serve  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from parallel.parallelize import parallelize  # noqa: E402
from parallel.config import ParallelConfig  # noqa: E402
from parallel.grid import ProcessGrid  # noqa: E402
from telemetry.activation_meter import ActivationMeter  # noqa: E402
from training.config import TrainerConfig  # noqa: E402

N_HEAD, N_EMBD, BLOCK, BATCH, STEPS = 4, 32, 16, 16, 2

# name: (planner Layout fields, n_layer, vocab[, the model's experts]). The parity layouts of
# tests/layout_worker.py, one of each kind: dp, fsdp stages, tp with and without sequence
# parallelism, every pipeline schedule, cp, checkpointing, hybrid sharding (R replica
# groups; the planner's dp counts all of them) and offload, compositions on 4 ranks, and
# mixture-of-experts models with expert parallelism (ep: the experts' own units and
# all-reduces, the all-to-all; with tp: the routers' partial gradients, the token shares).
MOE = {"experts": 4, "top_k": 2, "hidden": 48}  # planner Workload fields (model.moe_*)
CASES = {
    2: {
        "ddp_bucket": (dict(dp_kind="ddp_bucket", dp=2), 2, 65),
        "fsdp1": (dict(dp_kind="fsdp", zero_stage=1, dp=2), 2, 65),
        "fsdp2-accum2": (dict(dp_kind="fsdp", zero_stage=2, dp=2, grad_accum=2), 2, 65),
        "fsdp3": (dict(dp_kind="fsdp", zero_stage=3, dp=2), 2, 65),
        "fsdp3-ckpt": (dict(dp_kind="fsdp", zero_stage=3, dp=2, ckpt=True), 2, 64),
        "tp2": (dict(tp=2), 2, 65),
        "tp2-sp": (dict(tp=2, sp=True), 2, 65),
        "pp2-gpipe-m4": (dict(pp=2, schedule="gpipe", M=4), 2, 64),
        "pp2-1f1b-m4": (dict(pp=2, schedule="1f1b", M=4), 2, 64),
        "pp2-interleaved-v2-m2": (dict(pp=2, schedule="interleaved", V=2, M=2), 4, 64),
        "pp2-zb1p-m4": (dict(pp=2, schedule="zb1p", M=4), 2, 64),
        "pp2-zbv-m4": (dict(pp=2, schedule="zbv", V=2, M=4), 4, 64),
        "cp2-ddp_bucket": (dict(dp_kind="ddp_bucket", cp=2), 2, 64),
        "fsdp2-offload-accum2": (dict(dp_kind="fsdp", zero_stage=2, dp=2, grad_accum=2, offload=True),
                                 2, 65),
        "hsdp2x1-fsdp1-offload": (dict(dp_kind="fsdp", zero_stage=1, dp=2, R=2, offload=True), 2, 65),
        "ep2-fsdp2": (dict(dp_kind="fsdp", zero_stage=2, dp=2, ep=2), 2, 65, MOE),
    },
    4: {
        "dp2tp2-fsdp2-sp": (dict(dp_kind="fsdp", zero_stage=2, dp=2, tp=2, sp=True), 2, 65),
        "dp2pp2-fsdp1-1f1b-m2": (dict(dp_kind="fsdp", zero_stage=1, dp=2, pp=2, schedule="1f1b",
                                      M=2), 2, 65),
        "tp2pp2-sp-ddp-zb1p-m2": (dict(tp=2, pp=2, sp=True, schedule="zb1p", M=2), 2, 65),
        "dp2cp2-fsdp3": (dict(dp_kind="fsdp", zero_stage=3, dp=2, cp=2), 2, 64),
        "hsdp2x2-fsdp3": (dict(dp_kind="fsdp", zero_stage=3, dp=4, R=2), 2, 65),
        "hsdp2x2-fsdp2-offload-accum2": (dict(dp_kind="fsdp", zero_stage=2, dp=4, R=2, offload=True,
                                              grad_accum=2), 2, 64),
        "ep2-dp4-fsdp3": (dict(dp_kind="fsdp", zero_stage=3, dp=4, ep=2), 2, 65, MOE),
        "ep2tp2-ddp_bucket": (dict(dp_kind="ddp_bucket", dp=2, tp=2, ep=2), 2, 65, MOE),
    },
}


def parallel_config(f):
    pp = f.get("pp", 1)
    more = {"pp_schedule": f.get("schedule", "1f1b"), "microbatches": f.get("M", 1),
            "pp_virtual_stages": f.get("V", 1) if f.get("schedule") == "interleaved" else 1} \
        if pp > 1 else {}
    return ParallelConfig(dp=f.get("dp_kind", "single"), tp=f.get("tp", 1), pp=pp, cp=f.get("cp", 1),
                          zero_stage=f.get("zero_stage", 3) or 3,
                          dp_replicate=f.get("R", 1), offload=f.get("offload", False),
                          sequence_parallel=f.get("sp", False), ep=f.get("ep", 1), **more)


def global_batch(step, vocab):
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(vocab, (BATCH, BLOCK + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def run_case(fields, n_layer, vocab, moe=None):
    sizes = {d: fields.get(d, 1) for d in ("dp", "pp", "cp", "tp")}
    sizes["dp_replicate"] = fields.get("R", 1)  # the planner's dp is all replica groups'
    sizes["dp"] //= sizes["dp_replicate"]
    grid = ProcessGrid(sizes, torch.device("cpu"), ep=fields.get("ep", 1))
    tcfg = TrainerConfig(lr=3e-3, activation_checkpointing=fields.get("ckpt", False))
    torch.manual_seed(1234)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=N_HEAD, n_embd=N_EMBD, vocab_size=vocab,
                          block_size=BLOCK, **{f"moe_{k}": v for k, v in (moe or {}).items()}))
    strategy = parallelize(model, grid, parallel_config(fields))
    strategy.configure_compute(tcfg)
    strategy.configure_optimizer(tcfg)
    strategy.comm_stats()  # start-up traffic (the dp broadcast) is not a step's
    accum, per_rank = fields.get("grad_accum", 1), BATCH // grid.data_size
    for step in range(STEPS):
        x, y = global_batch(step, vocab)
        mine = slice(grid.data_rank * per_rank, (grid.data_rank + 1) * per_rank)
        micro = list(zip(x[mine].chunk(accum), y[mine].chunk(accum)))
        strategy.reseed(step * 1009)
        meter = ActivationMeter()
        with meter:
            strategy.forward_backward(micro)
        strategy.clip_grad_norm_(1.0)
        strategy.optimizer_step(tcfg.lr)
        comm = strategy.comm_stats()
        strategy.step_stats()
        state = strategy.state_figures()
    mine = {"rank": grid.rank, "coords": grid.coords, "shard_rank": grid.shard_rank,
            "comm": comm, "state_bytes": state["state_bytes"],
            "host_state_bytes": state.get("host_state_bytes", 0),
            "activation_peak_bytes": meter.peak_bytes}
    everyone = [None] * grid.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def compute():
    world = dist.get_world_size()
    only = os.environ.get("PLANNER_ONLY")  # debugging aid: cases whose name contains it
    return {name: run_case(*case) for name, case in CASES[world].items()
            if not only or only in name}


if __name__ == "__main__":
    serve(compute)
