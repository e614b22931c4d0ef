"""Test-only: mixture-of-experts layouts against one process, run inside tests/layout_worker.py's
launches (2, 4 and 8 ranks; `compute()` there calls `compute()` here) and, for the
layouts that need 6 or 12 ranks, launched on its own (harness.EXPERTS_SESSIONS):

    python -m torch.distributed.run --standalone --nproc_per_node=6 tests/experts_worker.py

For each case of CASES[world] every rank builds a GPT with experts, parallelizes it by
hand (expert parallelism carved out of dp x cp, composed with the case's other
dimensions), trains STEPS steps on fixed global batches, and measures against a
single-process replica of the same run (same initial weights, same global batch):
- per-step loss, pre-clip gradient norm, the balance loss and the z-loss as
  metrics.jsonl reports them (telemetry/expert_load.py), and the busiest expert's
  load: relative differences;
- the validation loss of the trained model, and the final canonical parameters
  (state_dict(), gathered) against the replica's;
- the all-to-all bytes each step, summed over ranks (tests compare them with the
  textbook count).
`collapse`: a choice bias that sends every token to expert 0 (top-1): the most uneven
all-to-all there is, every rank's tokens to one rank. `bias`: DeepSeek-V3's choice biases
moving every step (model.moe_bias_rate), from the step's counts over the whole world.
`distinct`: the ep group, the expert-data-parallel group and the data-parallel (gradient)
group of three sizes, all above 1 (6 experts, top-2), so that a divisor or a group taken
for another passes none of them (with dp x cp == ep, or an expert-data-parallel group of
one rank, dividing by ep or keying the expert group without tp changes nothing).
"""

import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dp_worker import OneRank, serve  # noqa: E402
from layout_worker import Case, hsdp, pp, replicated_equal, on_every_rank  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from parallel.config import ParallelConfig  # noqa: E402
from parallel.grid import ProcessGrid  # noqa: E402
from parallel.parallelize import parallelize  # noqa: E402
from telemetry.expert_load import expert_load  # noqa: E402
from training.config import TrainerConfig  # noqa: E402

N_HEAD, N_EMBD, BLOCK, BATCH, STEPS, VOCAB = 4, 32, 16, 24, 3, 64  # 24: 3 micro-batches of
# equal size on 2 data-parallel ranks (unequal ones would weigh tokens unequally)
TRAINER = TrainerConfig(lr=3e-3, weight_decay=0.1)
MOE = {"moe_experts": 4, "moe_top_k": 2, "moe_hidden": 48}  # 48: a width that is not 4 x C


def global_batch(step, vocab):
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(vocab, (BATCH, BLOCK + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def ep(n, **more):
    return {"ep": n, **more}


DISTINCT = set()  # names of the `distinct` cases: 6 experts; sizes checked by test_experts.py


def distinct(case):
    """A case whose ep, expert-data-parallel and data-parallel sizes all differ (and
    exceed 1): its model has 6 experts (divisible by ep 2 and 3)."""
    DISTINCT.add(case.name)
    return case


def moe(**more):
    return {**MOE, **more}


CASES = {  # each Case's `parallel` holds ep; its `moe`-like keys travel in MOE_OF
    2: [
        Case("ep2-ddp_naive", "ddp_naive", dp=2, parallel=ep(2)),
        Case("ep2-ddp_bucket-accum3", "ddp_bucket", dp=2, parallel=ep(2), accum=3),
        Case("ep2-fsdp1-noclip", "fsdp", dp=2, parallel=ep(2, zero_stage=1), clip=0.0),
        Case("ep2-fsdp2-accum2", "fsdp", dp=2, parallel=ep(2, zero_stage=2), accum=2),
        Case("ep2-fsdp3", "fsdp", dp=2, parallel=ep(2, zero_stage=3)),
        Case("ep2-collapse-top1-ddp_bucket", "ddp_bucket", dp=2, parallel=ep(2)),
        Case("ep1-dp2-ddp_bucket", "ddp_bucket", dp=2),  # experts replicated: the bench's baseline
        Case("ep2-allgather-fsdp2", "fsdp", dp=2, parallel=ep(2, zero_stage=2, ep_impl="allgather")),
        Case("ep2cp2-ddp_naive", "ddp_naive", cp=2, parallel=ep(2)),  # ep carved from cp alone
        Case("ep2-bias-ddp_bucket", "ddp_bucket", dp=2, parallel=ep(2)),  # DeepSeek-V3's biases
        # compute options (TRAINER_OF): against one process in the same precision
        Case("ep2-bf16-fsdp2", "fsdp", dp=2, parallel=ep(2, zero_stage=2)),
        Case("ep2-fp16-ddp_bucket-accum2", "ddp_bucket", dp=2, parallel=ep(2), accum=2),
        Case("ep2-recompute-fsdp3-accum2", "fsdp", dp=2, parallel=ep(2, zero_stage=3), accum=2),
        Case("ep2-compile-ddp_bucket", "ddp_bucket", dp=2, parallel=ep(2)),
        Case("ep2-muon-ddp_bucket-accum3", "ddp_bucket", dp=2, parallel=ep(2), accum=3),
        Case("ep2cp2-muon-ddp_naive", "ddp_naive", cp=2, parallel=ep(2)),
    ],
    4: [
        Case("ep4-ddp_bucket", "ddp_bucket", dp=4, parallel=ep(4)),
        Case("ep2-dp4-fsdp3-accum2", "fsdp", dp=4, parallel=ep(2, zero_stage=3), accum=2),
        Case("ep2tp2-ddp_naive", "ddp_naive", dp=2, tp=2, parallel=ep(2)),
        Case("ep2tp2-sp-fsdp2", "fsdp", dp=2, tp=2, parallel=ep(2, zero_stage=2,
                                                                 sequence_parallel=True)),
        Case("ep2pp2-1f1b-m2-every2", "ddp_bucket", dp=2, pp=2, parallel=ep(2, **pp("1f1b", 2))),
        Case("ep2pp2-1f1b-m2-every2-muon", "ddp_bucket", dp=2, pp=2,
             parallel=ep(2, **pp("1f1b", 2))),
        Case("ep2pp2-bias-gpipe-m2", "ddp_naive", dp=2, pp=2, parallel=ep(2, **pp("gpipe", 2))),
        Case("ep2pp2-interleaved-v2-m2", "ddp_bucket", dp=2, pp=2,
             parallel=ep(2, **pp("interleaved", 2, 2)), n_layer=4),
        Case("ep2pp2-zb1p-m2-fsdp2", "fsdp", dp=2, pp=2, parallel=ep(2, **pp("zb1p", 2, zero_stage=2))),
        Case("ep2pp2-zbv-m2-fsdp1", "fsdp", dp=2, pp=2,
             parallel=ep(2, **pp("zbv", 2, zero_stage=1)), n_layer=4),
        Case("ep2cp2-ddp_bucket-accum2", "ddp_bucket", dp=2, cp=2, parallel=ep(2), accum=2),
        Case("ep4cp2-fsdp3", "fsdp", dp=2, cp=2, parallel=ep(4, zero_stage=3)),
        Case("ep2-hsdp2x2-fsdp2", "fsdp", dp=2, parallel=ep(2, **hsdp(2))),
        Case("ep2-hsdp2x2-fsdp3-offload-accum2", "fsdp", dp=2,
             parallel=ep(2, **hsdp(3, offload=True)), accum=2),
    ],
    8: [
        Case("ep4-dp2cp2tp2-sp-ddp_bucket", "ddp_bucket", dp=2, cp=2, tp=2,
             parallel=ep(4, sequence_parallel=True)),
        # HSDP: ep 2, expert-DP 4 (2 per replica group, x 2 groups), data-parallel 8 (the
        # fewest ranks where a replica group's shard size, 4, is not ep)
        distinct(Case("ep2-hsdp2x4-fsdp2", "fsdp", dp=4, parallel=ep(2, **hsdp(2)))),
        distinct(Case("ep2-hsdp2x4-fsdp3-offload-accum3", "fsdp", dp=4,
                      parallel=ep(2, **hsdp(3, offload=True)), accum=3)),
    ],
    # the launches of this worker alone (harness.EXPERTS_SESSIONS): ep 2 / expert-DP 3 or
    # ep 3 / expert-DP 2, out of 6 data-parallel ranks
    6: [
        distinct(Case("ep2-dp6-ddp_naive", "ddp_naive", dp=6, parallel=ep(2))),
        distinct(Case("ep3-dp6-ddp_naive-accum2", "ddp_naive", dp=6, parallel=ep(3), accum=2)),
        distinct(Case("ep3-dp6-ddp_bucket", "ddp_bucket", dp=6, parallel=ep(3))),
        distinct(Case("ep2-dp6-ddp_bucket-accum2", "ddp_bucket", dp=6, parallel=ep(2), accum=2)),
        distinct(Case("ep2-dp6-fsdp1", "fsdp", dp=6, parallel=ep(2, zero_stage=1))),
        distinct(Case("ep3-dp6-fsdp2-accum2", "fsdp", dp=6, parallel=ep(3, zero_stage=2), accum=2)),
        distinct(Case("ep2-dp6-fsdp3", "fsdp", dp=6, parallel=ep(2, zero_stage=3))),
        distinct(Case("ep3-dp6-fsdp3-offload", "fsdp", dp=6,
                      parallel=ep(3, zero_stage=3, offload=True))),
    ],
    12: [  # tp 2 beside them: 12 ranks (dp x cp must hold 6 for three distinct sizes)
        distinct(Case("ep3-dp6tp2-ddp_naive", "ddp_naive", dp=6, tp=2, parallel=ep(3))),
        distinct(Case("ep2-dp6tp2-sp-fsdp2", "fsdp", dp=6, tp=2,
                      parallel=ep(2, zero_stage=2, sequence_parallel=True))),
    ],
}


def trainer_of(case, replica=False):
    """The case's compute options, by name: bf16 / fp16 (the replica runs them too),
    recompute, compile (aot_eager: the dynamo capture without code generation)."""
    t = TRAINER
    for precision in ("bf16", "fp16"):
        if precision in case.name:
            t = replace(t, precision=precision, fp16_growth_interval=2)
    if "recompute" in case.name and not replica:
        t = replace(t, activation_checkpointing=True)
    if "compile" in case.name and not replica:
        t = replace(t, compile=True, compile_backend="aot_eager")
    if "muon" in case.name:  # each expert's slice a matrix (layout_worker.MUON: why fp32)
        t = replace(t, optimizer="muon", muon_ns_dtype="fp32")
    return t


def moe_keys(case):
    """The model's mixture-of-experts keys for a case (every other block in the
    `every2` cases: a pipeline stage without experts)."""
    keys = moe(moe_every=2) if "every2" in case.name else moe()
    if case.name in DISTINCT:
        keys = moe(**{**keys, "moe_experts": 6})
    if "bias" in case.name:  # large enough to change choices within STEPS steps
        keys = moe(**{**keys, "moe_bias_rate": 0.05})
    return moe(**{**keys, "moe_top_k": 1}) if "collapse" in case.name else keys


def gpt(case):
    config = GPTConfig(n_layer=case.n_layer, n_head=N_HEAD, n_embd=N_EMBD, vocab_size=VOCAB,
                       block_size=BLOCK, **moe_keys(case))
    torch.manual_seed(1234)
    return GPT(config)


def collapse(strategy, case):
    if "collapse" in case.name:
        for _, layer in strategy.expert_layers():
            layer.choice_bias = torch.tensor([10.0, 0.0, 0.0, 0.0], device=strategy.device)


def figures(strategy):
    f = expert_load(strategy)
    return [f["moe_aux_loss"], f["moe_z_loss"], f["moe_load_max"]]


_replicas = {}


def replica_run(case):
    key = (case.n_layer, case.accum, case.clip, tuple(sorted(moe_keys(case).items())),
           "collapse" in case.name, repr(trainer_of(case, replica=True)))
    if key not in _replicas:
        ref = parallelize(gpt(case), OneRank(), ParallelConfig(dp="single"))
        ref.configure_compute(trainer_of(case, replica=True))
        ref.configure_optimizer(trainer_of(case, replica=True))
        collapse(ref, case)
        steps = []
        for step in range(STEPS):
            x, y = global_batch(step, VOCAB)
            loss = ref.forward_backward(list(zip(x.chunk(case.accum), y.chunk(case.accum))))
            steps.append([loss, ref.clip_grad_norm_(case.max_norm)] + figures(ref))
            ref.optimizer_step(TRAINER.lr)
        x, y = global_batch(STEPS, VOCAB)
        params = {n: p.detach().clone() for n, p in ref.module.named_parameters()}
        _replicas[key] = (steps, ref.eval_loss(x, y), params)
    return _replicas[key]


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def check_case(case):
    p = case.parallel
    grid = ProcessGrid({"dp_replicate": case.replicate, "dp": case.dp, "pp": case.pp,
                        "cp": case.cp, "tp": case.tp}, torch.device("cpu"), ep=p.get("ep", 1))
    strategy = parallelize(gpt(case), grid, ParallelConfig(dp=case.dp_kind, tp=case.tp,
                                                           pp=case.pp, cp=case.cp, **p))
    strategy.configure_compute(trainer_of(case))
    strategy.configure_optimizer(trainer_of(case))
    collapse(strategy, case)
    ref_steps, ref_val, ref_state = replica_run(case)
    strategy.comm_stats()
    names = ["loss", "norm", "aux", "z", "load"]
    out = {**{f"{n}_rel_diff": 0.0 for n in names}, "replicated_equal": [], "all_to_all": [],
           "name": case.name, "ep": p.get("ep", 1), "ep_impl": p.get("ep_impl", "alltoall"),
           "precision": trainer_of(case).precision,
           "recompute": trainer_of(case).activation_checkpointing,
           "optimizer": type(strategy.optimizer).__name__}  # a muon case runs Muon
    per_rank = BATCH // grid.data_size
    mine = slice(grid.data_rank * per_rank, (grid.data_rank + 1) * per_rank)
    for step in range(STEPS):
        x, y = global_batch(step, VOCAB)
        strategy.reseed(step * 1009)
        loss = strategy.forward_backward(list(zip(x[mine].chunk(case.accum),
                                                  y[mine].chunk(case.accum))))
        got = [loss, strategy.clip_grad_norm_(case.max_norm)] + figures(strategy)
        strategy.optimizer_step(TRAINER.lr)
        sent = torch.tensor([float(strategy.comm_stats().get("comm_all_to_all_bytes", 0))])
        dist.all_reduce(sent)
        out["all_to_all"].append(sent.item())
        for n, a, b in zip(names, got, ref_steps[step]):
            out[f"{n}_rel_diff"] = max(out[f"{n}_rel_diff"], rel(a, b))
        out["replicated_equal"].append(replicated_equal(strategy, grid))
    out["replicated_equal"] = on_every_rank(out["replicated_equal"])
    x, y = global_batch(STEPS, VOCAB)
    out["eval_rel_diff"] = rel(strategy.eval_loss(x[mine], y[mine]), ref_val)
    state = strategy.state_dict()
    if grid.is_main:
        out["shapes_canonical"] = sorted(state) == sorted(ref_state) and all(
            tuple(state[n].shape) == tuple(t.shape) for n, t in ref_state.items())
        out["param_max_abs_diff"] = max((state[n] - t).abs().max().item()
                                        for n, t in ref_state.items())
    out["moe_blocks"] = sum(GPTConfig(**moe_keys(case)).has_experts(i) for i in range(case.n_layer))
    out.update(world=grid.world_size, accum=case.accum, top_k=moe_keys(case)["moe_top_k"],
               tokens=BATCH * BLOCK, n_embd=N_EMBD, experts=moe_keys(case)["moe_experts"],
               sizes={"ep": grid.ep_size, "expert_dp": grid.expert_grad_size,
                      "dp": grid.grad_size})
    return out


def compute():
    world = dist.get_world_size()
    only = os.environ.get("LAYOUT_ONLY")
    return {case.name: check_case(case) for case in CASES.get(world, [])
            if not only or only in case.name}


if __name__ == "__main__":  # the 6- and 12-rank sessions (harness.EXPERTS_SESSIONS)
    serve(compute)
