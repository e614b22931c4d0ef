"""Test-only worker for tensor, context and pipeline parallelism, under torchrun (gloo), 2/4/8 ranks.

    python -m torch.distributed.run --standalone --nproc_per_node=W tests/layout_worker.py

For each layout in CASES[W] (dp strategy, dp x pp x tp, schedule, micro-batches,
sequence parallelism, vocabulary, accumulation, clipping; hybrid sharding and offload)
every rank builds
the strategy by hand, trains STEPS steps on fixed global batches and measures
against a single-process replica of the same run (same initial weights, same
global batch) that it trains itself (once for all cases that share one: replica_run):
- per-step loss and pre-clip gradient norm (relative differences);
- after every step, whether every tensor TP does not split is bitwise equal
  on all ranks of the TP group, and whether the tied embedding's two copies
  (first and last pipeline stage) are bitwise equal;
- the collectives of each step, by kind (tests compare pure TP and pure PP
  layouts with the textbook counts);
- the final canonical parameters (state_dict(), gathered) against the replica's.
Then the random streams under dropout (RNG): a digest of the generator state
at every Dropout module and at every attention call, per TP rank and per CP
rank, and at every Dropout of every stage of a pipeline.

On 2 and 4 ranks the session also runs tests/planner_worker.py's measurements, on 2
ranks tests/dp_worker.py's checks, on 4 ranks tests/precision_worker.py's `recompute4`:
one launch instead of several.

The worker only measures and reports (rank 0 prints `RESULT <json>`), so all
ranks always reach the same collectives and a wrong result cannot hang.
"""

import hashlib
import os
import sys
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dp_worker import OneRank, serve  # noqa: E402  (this directory is the script's: on sys.path)
from model import GPT, GPTConfig  # noqa: E402
from parallel.parallelize import parallelize  # noqa: E402
from parallel.config import ParallelConfig  # noqa: E402
from parallel.grid import ProcessGrid  # noqa: E402
from training.config import TrainerConfig  # noqa: E402

# 3 steps: the first creates AdamW's state, the next two update it (and reuse every
# bucket, shard and pipeline buffer), accumulation and clipping in each
N_HEAD, N_EMBD, BLOCK, BATCH, STEPS = 4, 32, 16, 16, 3
TRAINER = TrainerConfig(lr=3e-3, weight_decay=0.1)  # every case's, and its replica's


@dataclass(frozen=True)
class Case:
    name: str
    dp_kind: str = "single"
    dp: int = 1     # per replica group (parallel.dp_replicate groups: HSDP); the grid's dp
    pp: int = 1
    tp: int = 1
    cp: int = 1
    parallel: dict = field(default_factory=dict)  # more ParallelConfig fields
    vocab: int = 64
    accum: int = 1
    clip: float = 1.0
    n_layer: int = 2
    trainer: dict = field(default_factory=dict)  # more TrainerConfig fields (the optimizer)

    @property
    def tcfg(self):
        return replace(TRAINER, **self.trainer)

    @property
    def replicate(self):
        return self.parallel.get("dp_replicate", 1)

    @property
    def max_norm(self):
        return self.clip if self.clip > 0 else float("inf")

    @property
    def hybrid(self):
        """Hybrid sharding or offload (tests/test_hsdp.py's cases, not the TP/PP/CP tests')."""
        return self.replicate > 1 or self.parallel.get("offload", False)


def hsdp(stage, replicate=2, offload=False, **more):
    return {"zero_stage": stage, "dp_replicate": replicate, "offload": offload, **more}


def pp(schedule, m, v=1, **more):
    return {"pp_schedule": schedule, "microbatches": m, "pp_virtual_stages": v, **more}


# Muon with fp32 Newton-Schulz (tests/test_muon.py): bf16's would round the last bits in
# which a layout's gradients differ from one process's into bf16 steps of the update
MUON = {"optimizer": "muon", "muon_ns_dtype": "fp32"}


CASES = {
    2: [
        Case("tp2", tp=2),
        Case("tp2-vocab65-noclip", tp=2, vocab=65, clip=0.0),
        Case("tp2-sp-vocab65-accum2", tp=2, parallel={"sequence_parallel": True}, vocab=65, accum=2),
        Case("pp2-1f1b-m1", pp=2, parallel=pp("1f1b", 1)),
        Case("pp2-1f1b-m2", pp=2, parallel=pp("1f1b", 2)),
        Case("pp2-1f1b-m4-noclip", pp=2, parallel=pp("1f1b", 4), clip=0.0),
        Case("pp2-1f1b-m8", pp=2, parallel=pp("1f1b", 8)),
        Case("pp2-gpipe-m1", pp=2, parallel=pp("gpipe", 1)),
        Case("pp2-gpipe-m4-vocab65", pp=2, parallel=pp("gpipe", 4), vocab=65),
        Case("pp2-gpipe-m8-accum2", pp=2, parallel=pp("gpipe", 8), accum=2),
        Case("pp2-interleaved-v2-m2", pp=2, parallel=pp("interleaved", 2, 2), n_layer=4),
        Case("pp2-interleaved-v2-m4-noclip", pp=2, parallel=pp("interleaved", 4, 2), n_layer=4,
             clip=0.0),
        Case("pp2-uneven-5layers-1f1b-m4", pp=2, parallel=pp("1f1b", 4), n_layer=5),
        Case("pp2-layers41-gpipe-m2", pp=2, parallel=pp("gpipe", 2, pp_layers=[4, 1]), n_layer=5),
        # zero bubble (split backward): M = P and 2P, accumulation, an uneven split
        Case("pp2-zb1p-m2", pp=2, parallel=pp("zb1p", 2)),
        Case("pp2-zb1p-m4-accum2-noclip", pp=2, parallel=pp("zb1p", 4), accum=2, clip=0.0),
        Case("pp2-zb1p-m4-uneven-5layers-vocab65", pp=2, parallel=pp("zb1p", 4), n_layer=5, vocab=65),
        Case("pp2-zbv-m2", pp=2, parallel=pp("zbv", 2), n_layer=4),
        Case("pp2-zbv-m4-accum2", pp=2, parallel=pp("zbv", 4), n_layer=4, accum=2),
        Case("pp2-zbv-m4-layers2111-noclip", pp=2, parallel=pp("zbv", 4, pp_layers=[2, 1, 1, 1]),
             n_layer=5, clip=0.0),
        Case("cp2-ddp_bucket", "ddp_bucket", cp=2),
        Case("cp2-ddp_naive-accum2-vocab65-noclip", "ddp_naive", cp=2, vocab=65, accum=2, clip=0.0),
        Case("cp2-fsdp3", "fsdp", cp=2, parallel={"zero_stage": 3}),
        Case("cp2-allgather-ddp_bucket-accum2", "ddp_bucket", cp=2, parallel={"cp_impl": "allgather"},
             accum=2),
        # PyTorch's data-parallel references average over dp x cp too (grid.grad_group)
        Case("cp2-torch_ddp", "torch_ddp", cp=2),
        Case("cp2-torch_fsdp-vocab65", "torch_fsdp", cp=2, vocab=65),
        # offload (tests/test_hsdp.py): every stage, accumulation 3; plain fsdp3 over 2
        # ranks, what hsdp2x2-fsdp3-accum2 on 4 ranks must gather and hold
        Case("dp2-fsdp3-accum2", "fsdp", dp=2, parallel={"zero_stage": 3}, accum=2, vocab=65),
        Case("dp2-fsdp1-offload-accum4-noclip", "fsdp", dp=2, parallel=hsdp(1, 1, True), accum=4,
             clip=0.0),
        Case("dp2-fsdp2-offload-accum4", "fsdp", dp=2, parallel=hsdp(2, 1, True), accum=4, vocab=65),
        Case("dp2-fsdp3-offload-accum4-noclip", "fsdp", dp=2, parallel=hsdp(3, 1, True), accum=4,
             clip=0.0, vocab=65),
        Case("hsdp2x1-fsdp2-accum2", "fsdp", dp=1, parallel=hsdp(2), accum=2),
        # Muon on the replicated strategies: every rank orthogonalizes every matrix
        Case("dp2-ddp_bucket-accum2-muon", "ddp_bucket", dp=2, accum=2, trainer=MUON),
        Case("dp2-ddp_naive-noclip-muon", "ddp_naive", dp=2, clip=0.0, trainer=MUON),
        Case("cp2-torch_ddp-muon", "torch_ddp", cp=2, trainer=MUON),
        Case("pp2-zbv-m4-muon", pp=2, parallel=pp("zbv", 4), n_layer=4, trainer=MUON),
        Case("pp2-interleaved-v2-m2-muon-rms-plain", pp=2, parallel=pp("interleaved", 2, 2),
             n_layer=4, trainer={**MUON, "muon_adjust_lr": "match_rms_adamw",
                                 "muon_nesterov": False}),
    ],
    4: [
        Case("tp4-vocab50", tp=4, vocab=50),
        Case("tp4-sp-vocab65", tp=4, parallel={"sequence_parallel": True}, vocab=65, clip=0.0),
        Case("dp2tp2-ddp_naive-accum2", "ddp_naive", dp=2, tp=2, vocab=65, accum=2),
        Case("dp2tp2-ddp_bucket-tinycap-accum2", "ddp_bucket", dp=2, tp=2,
             parallel={"bucket_cap_mb": 0.001}, vocab=65, accum=2, clip=0.0),
        Case("dp2tp2-ddp_bucket-ring", "ddp_bucket", dp=2, tp=2, parallel={"allreduce": "ring"},
             vocab=50),
        Case("dp2tp2-fsdp1-accum2-noclip", "fsdp", dp=2, tp=2, parallel={"zero_stage": 1},
             vocab=65, accum=2, clip=0.0),
        Case("dp2tp2-fsdp2-sp", "fsdp", dp=2, tp=2,
             parallel={"zero_stage": 2, "sequence_parallel": True}, vocab=50),
        Case("dp2tp2-fsdp3", "fsdp", dp=2, tp=2, parallel={"zero_stage": 3}, vocab=65),
        Case("dp2tp2-fsdp3-sp-accum2", "fsdp", dp=2, tp=2,
             parallel={"zero_stage": 3, "sequence_parallel": True}, vocab=65, accum=2, clip=0.0),
        Case("dp2tp2-torch_ddp", "torch_ddp", dp=2, tp=2, vocab=50),
        Case("pp4-1f1b-m1", pp=4, parallel=pp("1f1b", 1), n_layer=4),
        Case("pp4-1f1b-m2", pp=4, parallel=pp("1f1b", 2), n_layer=4),
        Case("pp4-1f1b-m8-noclip", pp=4, parallel=pp("1f1b", 8), n_layer=4, clip=0.0),
        Case("pp4-gpipe-m4", pp=4, parallel=pp("gpipe", 4), n_layer=5),
        Case("pp4-interleaved-v2-m4", pp=4, parallel=pp("interleaved", 4, 2), n_layer=8),
        Case("dp2pp2-ddp_naive-1f1b-m2-accum2", "ddp_naive", dp=2, pp=2, parallel=pp("1f1b", 2),
             accum=2),
        Case("dp2pp2-ddp_bucket-tinycap-1f1b-m4", "ddp_bucket", dp=2, pp=2,
             parallel=pp("1f1b", 4, bucket_cap_mb=0.001), clip=0.0),
        Case("dp2pp2-ddp_bucket-interleaved-v2-m2", "ddp_bucket", dp=2, pp=2,
             parallel=pp("interleaved", 2, 2), n_layer=4),
        Case("dp2pp2-fsdp1-gpipe-m2-noclip", "fsdp", dp=2, pp=2,
             parallel=pp("gpipe", 2, zero_stage=1), clip=0.0, vocab=65),
        Case("dp2pp2-fsdp2-1f1b-m2-accum2", "fsdp", dp=2, pp=2,
             parallel=pp("1f1b", 2, zero_stage=2), accum=2),
        Case("tp2pp2-1f1b-m2", tp=2, pp=2, parallel=pp("1f1b", 2), vocab=65),
        Case("tp2pp2-sp-interleaved-v2-m2", tp=2, pp=2,
             parallel=pp("interleaved", 2, 2, sequence_parallel=True), n_layer=4),
        Case("pp4-zb1p-m4", pp=4, parallel=pp("zb1p", 4), n_layer=4),
        Case("pp4-zb1p-m8-noclip", pp=4, parallel=pp("zb1p", 8), n_layer=4, clip=0.0),
        Case("pp4-zbv-m4", pp=4, parallel=pp("zbv", 4), n_layer=8),
        Case("pp4-zbv-m8-vocab65", pp=4, parallel=pp("zbv", 8), n_layer=8, vocab=65),
        Case("dp2pp2-ddp_bucket-tinycap-zb1p-m2", "ddp_bucket", dp=2, pp=2,
             parallel=pp("zb1p", 2, bucket_cap_mb=0.01)),
        Case("dp2pp2-ddp_bucket-tinycap-zbv-m4", "ddp_bucket", dp=2, pp=2,
             parallel=pp("zbv", 4, bucket_cap_mb=0.01), n_layer=4),
        Case("dp2pp2-fsdp1-zb1p-m2-accum2", "fsdp", dp=2, pp=2,
             parallel=pp("zb1p", 2, zero_stage=1), accum=2),
        Case("dp2pp2-fsdp1-zbv-m2", "fsdp", dp=2, pp=2, parallel=pp("zbv", 2, zero_stage=1), n_layer=4),
        Case("dp2pp2-fsdp2-zb1p-m4-noclip", "fsdp", dp=2, pp=2,
             parallel=pp("zb1p", 4, zero_stage=2), clip=0.0),
        Case("dp2pp2-fsdp2-zbv-m2-accum2", "fsdp", dp=2, pp=2,
             parallel=pp("zbv", 2, zero_stage=2), n_layer=4, accum=2),
        Case("tp2pp2-sp-zb1p-m2", tp=2, pp=2, parallel=pp("zb1p", 2, sequence_parallel=True), vocab=65),
        Case("tp2pp2-zbv-m4", tp=2, pp=2, parallel=pp("zbv", 4), n_layer=4, vocab=65),
        Case("cp4-ddp_bucket", "ddp_bucket", cp=4),
        Case("dp2cp2-ddp_bucket-ring-accum2", "ddp_bucket", dp=2, cp=2,
             parallel={"allreduce": "ring"}, accum=2),
        Case("dp2cp2-fsdp1-noclip", "fsdp", dp=2, cp=2, parallel={"zero_stage": 1}, clip=0.0),
        Case("dp2cp2-fsdp2-vocab65", "fsdp", dp=2, cp=2, parallel={"zero_stage": 2}, vocab=65),
        Case("cp2tp2-ddp_bucket-vocab65", "ddp_bucket", cp=2, tp=2, vocab=65),
        Case("cp2tp2-sp-ddp_naive-accum2", "ddp_naive", cp=2, tp=2,
             parallel={"sequence_parallel": True}, accum=2),
        Case("cp2pp2-ddp_bucket-1f1b-m2", "ddp_bucket", cp=2, pp=2, parallel=pp("1f1b", 2)),
        Case("cp2pp2-ddp_naive-gpipe-m4-noclip", "ddp_naive", cp=2, pp=2, parallel=pp("gpipe", 4),
             clip=0.0),
        Case("cp2pp2-fsdp2-interleaved-v2-m2", "fsdp", cp=2, pp=2,
             parallel=pp("interleaved", 2, 2, zero_stage=2), n_layer=4),
        Case("cp2pp2-ddp_bucket-zb1p-m2", "ddp_bucket", cp=2, pp=2, parallel=pp("zb1p", 2)),
        Case("cp2pp2-fsdp1-zbv-m2", "fsdp", cp=2, pp=2, parallel=pp("zbv", 2, zero_stage=1),
             n_layer=4),
        # hybrid sharding (tests/test_hsdp.py): 2 replica groups of 2, every stage with
        # accumulation, offload, and composed with tp, pp and cp
        Case("hsdp2x2-fsdp1-accum2-noclip", "fsdp", dp=2, parallel=hsdp(1), accum=2, clip=0.0),
        Case("hsdp2x2-fsdp2-accum4", "fsdp", dp=2, parallel=hsdp(2), accum=4, vocab=65),
        Case("hsdp2x2-fsdp3-accum2", "fsdp", dp=2, parallel=hsdp(3), accum=2, vocab=65),
        Case("hsdp2x2-fsdp3-offload-accum4-noclip", "fsdp", dp=2, parallel=hsdp(3, offload=True),
             accum=4, clip=0.0),
        Case("hsdp2x1tp2-fsdp2-sp", "fsdp", tp=2, parallel=hsdp(2, sequence_parallel=True), vocab=65),
        Case("hsdp2x1pp2-fsdp1-1f1b-m2-offload", "fsdp", pp=2,
             parallel=pp("1f1b", 2, **hsdp(1, offload=True))),
        Case("hsdp2x1cp2-fsdp3-accum2", "fsdp", cp=2, parallel=hsdp(3), accum=2),
        Case("hsdp2x2-torch_fsdp-offload-accum2", "torch_fsdp", dp=2,
             parallel={"dp_replicate": 2, "offload": True}, accum=2),
        Case("dp2pp2-ddp_bucket-1f1b-m2-muon", "ddp_bucket", dp=2, pp=2, parallel=pp("1f1b", 2),
             trainer=MUON),
        Case("dp2cp2-ddp_naive-accum2-muon", "ddp_naive", dp=2, cp=2, accum=2, trainer=MUON),
    ],
    8: [
        Case("dp2pp2tp2-ddp_bucket-1f1b-m2-accum2", "ddp_bucket", dp=2, pp=2, tp=2,
             parallel=pp("1f1b", 2), n_layer=5, vocab=65, accum=2),
        Case("dp2pp2tp2-fsdp2-sp-gpipe-m4-noclip", "fsdp", dp=2, pp=2, tp=2,
             parallel=pp("gpipe", 4, zero_stage=2, sequence_parallel=True), clip=0.0),
        Case("dp2pp2tp2-ddp_naive-interleaved-v2-m2", "ddp_naive", dp=2, pp=2, tp=2,
             parallel=pp("interleaved", 2, 2), n_layer=4),
        Case("dp2pp2tp2-ddp_bucket-zb1p-m2-accum2", "ddp_bucket", dp=2, pp=2, tp=2,
             parallel=pp("zb1p", 2), vocab=65, accum=2),
        Case("dp2pp2tp2-fsdp2-sp-zbv-m4-noclip", "fsdp", dp=2, pp=2, tp=2,
             parallel=pp("zbv", 4, zero_stage=2, sequence_parallel=True), n_layer=4, clip=0.0),
        Case("dp2cp2tp2-ddp_bucket-sp-accum2", "ddp_bucket", dp=2, cp=2, tp=2,
             parallel={"sequence_parallel": True}, vocab=65, accum=2),
        Case("cp2pp2tp2-fsdp1-1f1b-m2", "fsdp", cp=2, pp=2, tp=2,
             parallel=pp("1f1b", 2, zero_stage=1)),
        Case("hsdp2x2tp2-fsdp3-accum2", "fsdp", dp=2, tp=2, parallel=hsdp(3), vocab=65, accum=2),
        Case("hsdp2x2tp2-fsdp2-sp-offload-noclip", "fsdp", dp=2, tp=2,
             parallel=hsdp(2, offload=True, sequence_parallel=True), clip=0.0),
    ],
}


def global_batch(step, vocab):
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(vocab, (BATCH, BLOCK + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def gpt_config(vocab, n_layer=2, dropout=0.0):
    return GPTConfig(n_layer=n_layer, n_head=N_HEAD, n_embd=N_EMBD, vocab_size=vocab,
                     block_size=BLOCK, dropout=dropout)


def replicated_equal(strategy, grid):
    """Are all tensors TP does not split bitwise equal across this TP group?"""
    values = [r.values().reshape(-1) for r in strategy.regions() if r.placement.tp_replicated]
    flat = torch.cat(values).detach().clone() if values else torch.zeros(0)
    everyone = [torch.empty_like(flat) for _ in range(grid.tp_size)]
    dist.all_gather(everyone, flat, group=grid.tp_group)
    return all(torch.equal(f, flat) for f in everyone)


def tied_equal(strategy):
    """Are the first and the last stage's copies of the tied embedding bitwise equal?
    (None on ranks holding neither, and without a pipeline.)"""
    group = strategy.pipeline.embedding_group if strategy.pipeline else None
    if group is None:
        return None
    values = [r.values().reshape(-1) for r in strategy.regions() if r.placement.tied]
    flat = torch.cat(values).detach().clone() if values else torch.zeros(0)
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat, group=group)
    return torch.equal(*both)


def on_every_rank(flags):
    """Per step: True only if the flag holds on every rank that has one (rank 0 reports
    for all of them); None where no rank has one (no pipeline: no tied copies)."""
    value = torch.tensor([1 if f is None else int(f) for f in flags], dtype=torch.int64)
    has = torch.tensor([0 if f is None else 1 for f in flags], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    return [bool(v) if h else None for v, h in zip(value.tolist(), has.tolist())]


_replicas = {}


def replica_run(case):
    """The single-process run every case of the same (vocabulary, layers, accumulation,
    clipping, trainer) is measured against: per step its loss and pre-clip gradient norm, the
    validation loss after STEPS steps and the final parameters. It depends on nothing
    else (same seed, same global batches, no dropout), so each rank trains it once per
    such key and every case with that key compares against the same numbers."""
    key = (case.vocab, case.n_layer, case.accum, case.clip, repr(case.tcfg))
    if key not in _replicas:
        torch.manual_seed(1234)
        ref = parallelize(GPT(gpt_config(case.vocab, case.n_layer)), OneRank(),
                          ParallelConfig(dp="single"))
        ref.configure_optimizer(case.tcfg)
        steps = []
        for step in range(STEPS):
            x, y = global_batch(step, case.vocab)
            loss = ref.forward_backward(list(zip(x.chunk(case.accum), y.chunk(case.accum))))
            steps.append((loss, ref.clip_grad_norm_(case.max_norm)))
            ref.optimizer_step(TRAINER.lr)
        x, y = global_batch(STEPS, case.vocab)
        params = {n: p.detach().clone() for n, p in ref.module.named_parameters()}
        _replicas[key] = (steps, ref.eval_loss(x, y), params)
    return _replicas[key]


def check_case(case):
    grid = ProcessGrid({"dp_replicate": case.replicate, "dp": case.dp, "pp": case.pp,
                        "cp": case.cp, "tp": case.tp}, torch.device("cpu"))
    torch.manual_seed(1234)
    model = GPT(gpt_config(case.vocab, case.n_layer))
    strategy = parallelize(model, grid, ParallelConfig(dp=case.dp_kind, tp=case.tp, pp=case.pp,
                                                          cp=case.cp, **case.parallel))
    strategy.configure_optimizer(case.tcfg)
    ref_steps, ref_val, ref_state = replica_run(case)
    strategy.comm_stats()  # drop start-up traffic (dp broadcasts)
    out = {"loss_rel_diff": 0.0, "norm_rel_diff": 0.0, "replicated_equal": [], "tied_equal": [],
           "comm": [], **asdict(case)}
    per_rank = BATCH // grid.data_size  # dp_replicate x dp ranks read other rows
    for step in range(STEPS):
        x, y = global_batch(step, case.vocab)
        mine = slice(grid.data_rank * per_rank, (grid.data_rank + 1) * per_rank)
        micro = list(zip(x[mine].chunk(case.accum), y[mine].chunk(case.accum)))
        strategy.reseed(step * 1009)
        loss = strategy.forward_backward(micro)
        norm = strategy.clip_grad_norm_(case.max_norm)
        strategy.optimizer_step(TRAINER.lr)
        out["comm"].append(strategy.comm_stats())
        strategy.step_stats()  # keeps the pipeline's per-step record from growing
        ref_loss, ref_norm = ref_steps[step]
        out["loss_rel_diff"] = max(out["loss_rel_diff"], abs(loss - ref_loss) / abs(ref_loss))
        out["norm_rel_diff"] = max(out["norm_rel_diff"], abs(norm - ref_norm) / abs(ref_norm))
        out["replicated_equal"].append(replicated_equal(strategy, grid))
        out["tied_equal"].append(tied_equal(strategy))
    out["replicated_equal"] = on_every_rank(out["replicated_equal"])
    out["tied_equal"] = on_every_rank(out["tied_equal"])
    out["state"] = strategy.state_figures()  # state_bytes (host_state_bytes), the fullest rank's
    out["optimizer"] = type(strategy.optimizer).__name__  # a muon case runs Muon
    # the validation loss of the trained model on a batch it never saw (as the trainer
    # asks it: this rank's data-parallel share in, the global batch's mean out)
    x, y = global_batch(STEPS, case.vocab)
    mine = slice(grid.data_rank * per_rank, (grid.data_rank + 1) * per_rank)
    val = strategy.eval_loss(x[mine], y[mine])
    out["eval_rel_diff"] = abs(val - ref_val) / abs(ref_val)
    state = strategy.state_dict()
    if grid.is_main:
        out["shapes_canonical"] = sorted(state) == sorted(ref_state) and all(
            tuple(state[n].shape) == tuple(p.shape) for n, p in ref_state.items())
        out["param_max_abs_diff"] = max((state[n] - p).abs().max().item()
                                        for n, p in ref_state.items())
    return out


def digest():
    return hashlib.sha1(torch.default_generator.get_state().numpy().tobytes()).hexdigest()[:12]


def check_random_streams(sequence_parallel):
    """Generator state at every dropout and attention call, and whether replicated
    parameters stay equal across TP ranks while training with dropout."""
    grid = ProcessGrid({"tp": dist.get_world_size()}, torch.device("cpu"))
    torch.manual_seed(7)
    model = GPT(gpt_config(64, dropout=0.1))
    strategy = parallelize(model, grid, ParallelConfig(dp="single", tp=grid.tp_size,
                                                          sequence_parallel=sequence_parallel))
    strategy.configure_optimizer(TrainerConfig())
    seen = {"dropout": [], "attention": []}
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.register_forward_pre_hook(lambda mod, args: seen["dropout"].append(digest()))
    real_sdpa = F.scaled_dot_product_attention

    def spy(*args, **kw):
        seen["attention"].append(digest())
        return real_sdpa(*args, **kw)
    F.scaled_dot_product_attention = spy
    equal = []
    try:
        for step in range(3):
            x, y = global_batch(step, 64)
            strategy.reseed(step * 1009)
            strategy.forward_backward([(x, y)])
            strategy.clip_grad_norm_(1.0)
            strategy.optimizer_step(1e-3)
            equal.append(replicated_equal(strategy, grid))
    finally:
        F.scaled_dot_product_attention = real_sdpa
    everyone = [None] * grid.tp_size
    dist.all_gather_object(everyone, seen, group=grid.tp_group)
    same = lambda kind: [len({s[kind][i] for s in everyone}) == 1 for i in range(len(seen[kind]))]
    # a generator state met at two different call sites (on any ranks) is one stream
    # reused where two independent ones were meant: the masks would repeat each other
    sites = {}
    for s in everyone:
        for kind in s:
            for i, d in enumerate(s[kind]):
                sites.setdefault(d, set()).add((kind, i))
    return {"dropout_same_across_tp": same("dropout"), "attention_same_across_tp": same("attention"),
            "replicated_equal": on_every_rank(equal),
            "states_reused_across_call_sites": sum(len(v) > 1 for v in sites.values())}


def two_steps_seen_by_every_rank(strategy, seen):
    """Train two steps with dropout (each step's streams reseeded as the trainer does),
    then every rank's list `seen` (generator digests its hooks appended), by rank."""
    for step in range(2):
        x, y = global_batch(step, 64)
        strategy.reseed(step * 1009)
        strategy.forward_backward([(x, y)])
        strategy.optimizer_step(1e-3)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    return everyone


def check_pipeline_streams():
    """Generator state at every Dropout of every stage of a pure pipeline with dropout
    on: a state seen on two stages means two layers draw the same masks."""
    world = dist.get_world_size()
    grid = ProcessGrid({"pp": world}, torch.device("cpu"))
    torch.manual_seed(7)
    model = GPT(gpt_config(64, n_layer=world, dropout=0.1))
    strategy = parallelize(model, grid, ParallelConfig(dp="single", pp=world, pp_schedule="1f1b",
                                                          microbatches=2))
    strategy.configure_optimizer(TrainerConfig())
    seen = []
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.register_forward_pre_hook(lambda mod, args: seen.append(digest()))
    everyone = two_steps_seen_by_every_rank(strategy, seen)
    stages_of = {}
    for stage, states in enumerate(everyone):
        for d in states:
            stages_of.setdefault(d, set()).add(stage)
    return {"dropout_calls_per_stage": [len(s) for s in everyone],
            "states_on_two_stages": sum(len(v) > 1 for v in stages_of.values())}


def check_cp_streams():
    """Generator state at every Dropout and every attention call (the ring draws its
    masks' seed from the default generator) of a cp group of all ranks, with dropout
    on: cp ranks hold other tokens, so a state met on two ranks, or at two call sites,
    is one mask drawn for other tokens."""
    world = dist.get_world_size()
    grid = ProcessGrid({"cp": world}, torch.device("cpu"))
    torch.manual_seed(7)
    model = GPT(gpt_config(64, dropout=0.1))
    strategy = parallelize(model, grid, ParallelConfig(dp="ddp_naive", cp=world))
    strategy.configure_optimizer(TrainerConfig())
    seen = []
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.register_forward_pre_hook(lambda mod, args: seen.append(digest()))
        if hasattr(m, "attend"):
            m.attend = (lambda attend: lambda *a: (seen.append(digest()), attend(*a))[1])(m.attend)
    everyone = two_steps_seen_by_every_rank(strategy, seen)
    sites = {}
    for rank, states in enumerate(everyone):
        for i, d in enumerate(states):
            sites.setdefault(d, set()).add((rank, i))
    return {"calls_per_rank": [len(s) for s in everyone],
            "same_across_cp": [len({s[i] for s in everyone}) < world for i in range(len(seen))],
            "states_met_twice": sum(len(v) > 1 for v in sites.values())}


def compute():
    world = dist.get_world_size()
    result = {"cases": {}, "random": {}}
    # debugging aid: cases whose name contains it; LAYOUT_ONLY=random: the random streams only
    only = os.environ.get("LAYOUT_ONLY")
    for case in CASES[world]:
        if not only or only in case.name:
            result["cases"][case.name] = check_case(case)
    if world in (2, 4) and only in (None, "", "random"):  # streams of a TP / PP / CP group of all ranks
        for sp in (False, True):
            result["random"][f"sp={sp}"] = check_random_streams(sp)
        result["random"]["pp"] = check_pipeline_streams()
        result["random"]["cp"] = check_cp_streams()
    import experts_worker  # mixture-of-experts layouts (tests/test_experts.py)
    result["experts"] = experts_worker.compute()
    if not only:  # the combination matrix's cases of this world (tests/test_option_matrix.py)
        import matrix_worker
        result["matrix"] = matrix_worker.compute()
    if world == 2 and not only:  # a NaN in one rank's gradient (tests/test_nonfinite_steps.py)
        import nonfinite_worker
        result["nonfinite"] = nonfinite_worker.compute()
    if not only:  # other workers' checks for this rank count, sharing this launch (each
        # torchrun launch costs its interpreters' start-up, more than these checks)
        if world in (2, 4):  # tests/test_planner.py's measurements
            import planner_worker
            result["planner"] = planner_worker.compute()
        if world == 2:  # tests/test_ddp_own.py's 2-rank checks
            import dp_worker
            result["dp"] = dp_worker.compute()
        if world == 4:  # tests/test_precision.py's recompute under tp2 x pp2
            from precision_worker import RECOMPUTE4, check_recompute
            result["recompute4"] = check_recompute(RECOMPUTE4)
    return result


if __name__ == "__main__":
    serve(compute)
