"""Test-only worker for tensor parallelism, run under torchrun (gloo), 2 or 4 ranks.

    python -m torch.distributed.run --standalone --nproc_per_node=W tests/tp_worker.py

For each layout in CASES[W] (dp strategy, dp x tp, sequence parallelism,
vocabulary, accumulation, clipping) every rank builds the strategy by hand,
trains STEPS steps on fixed global batches and measures against a
single-process replica of the same run (same initial weights, same global
batch) that it trains itself:
- per-step loss and pre-clip gradient norm (relative differences);
- after every step, whether every tensor TP does not split is bitwise equal
  on all ranks of the TP group;
- the collectives of each step, by kind (pure TP layouts: exactly the
  textbook count, checked by tests/test_tp.py);
- the final canonical parameters (state_dict(), gathered) against the replica's.
Then the random streams under dropout (RNG): a digest of the generator state
at every Dropout module and at every attention call, per TP rank.

The worker only measures and reports (rank 0 prints `RESULT <json>`), so all
ranks always reach the same collectives and a wrong result cannot hang.
"""

import datetime
import hashlib
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dp_worker import OneRank  # noqa: E402  (this directory is the script's: on sys.path)
from model import GPT, GPTConfig  # noqa: E402
from parallel import build_strategy  # noqa: E402
from parallel.config import ParallelConfig  # noqa: E402
from parallel.grid import ProcessGrid  # noqa: E402
from parallel.single import Single  # noqa: E402
from trainer import TrainerConfig  # noqa: E402

N_LAYER, N_HEAD, N_EMBD, BLOCK, BATCH, STEPS = 2, 4, 32, 16, 8, 4

# (name, dp strategy, dp, tp, extra ParallelConfig, vocab, grad_accum, clip)
CASES = {
    2: [
        ("tp2", "single", 1, 2, {}, 64, 1, 1.0),
        ("tp2-vocab65-noclip", "single", 1, 2, {}, 65, 1, 0.0),
        ("tp2-sp-vocab65-accum2", "single", 1, 2, {"sequence_parallel": True}, 65, 2, 1.0),
    ],
    4: [
        ("tp4-vocab50", "single", 1, 4, {}, 50, 1, 1.0),
        ("tp4-sp-vocab65", "single", 1, 4, {"sequence_parallel": True}, 65, 1, 0.0),
        ("dp2tp2-ddp_naive-accum2", "ddp_naive", 2, 2, {}, 65, 2, 1.0),
        ("dp2tp2-ddp_bucket-tinycap-accum2", "ddp_bucket", 2, 2, {"bucket_cap_mb": 0.001}, 65, 2, 0.0),
        ("dp2tp2-ddp_bucket-ring", "ddp_bucket", 2, 2, {"allreduce": "ring"}, 50, 1, 1.0),
        ("dp2tp2-fsdp1-accum2-noclip", "fsdp", 2, 2, {"zero_stage": 1}, 65, 2, 0.0),
        ("dp2tp2-fsdp2-sp", "fsdp", 2, 2, {"zero_stage": 2, "sequence_parallel": True}, 50, 1, 1.0),
        ("dp2tp2-fsdp3", "fsdp", 2, 2, {"zero_stage": 3}, 65, 1, 1.0),
        ("dp2tp2-fsdp3-sp-accum2", "fsdp", 2, 2, {"zero_stage": 3, "sequence_parallel": True},
         65, 2, 0.0),
        ("dp2tp2-torch_ddp", "torch_ddp", 2, 2, {}, 50, 1, 1.0),
    ],
}


def global_batch(step, vocab):
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(vocab, (BATCH, BLOCK + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def gpt_config(vocab, dropout=0.0):
    return GPTConfig(n_layer=N_LAYER, n_head=N_HEAD, n_embd=N_EMBD, vocab_size=vocab,
                     block_size=BLOCK, dropout=dropout)


def replicated_equal(strategy, grid):
    """Are all tensors TP does not split bitwise equal across this TP group?"""
    values = [r.values().reshape(-1) for r in strategy.regions() if r.placement.tp_replicated]
    flat = torch.cat(values).detach().clone() if values else torch.zeros(0)
    everyone = [torch.empty_like(flat) for _ in range(grid.tp_size)]
    dist.all_gather(everyone, flat, group=grid.tp_group)
    return all(torch.equal(f, flat) for f in everyone)


def check_case(world, name, dp_kind, dp, tp, extra, vocab, accum, clip):
    grid = ProcessGrid(dp, 1, tp, torch.device("cpu"))
    tcfg = TrainerConfig(lr=3e-3, weight_decay=0.1)
    torch.manual_seed(1234)
    strategy = build_strategy(GPT(gpt_config(vocab)), grid, ParallelConfig(dp=dp_kind, tp=tp, **extra))
    strategy.configure_optimizer(tcfg)
    torch.manual_seed(1234)
    ref = Single(GPT(gpt_config(vocab)), OneRank(), ParallelConfig(dp="single"))
    ref.configure_optimizer(tcfg)
    strategy.comm_stats()  # drop start-up traffic (dp broadcasts)
    out = {"loss_rel_diff": 0.0, "norm_rel_diff": 0.0, "replicated_equal": [], "comm": [],
           "dp": dp, "tp": tp, "accum": accum, "vocab": vocab,
           "sequence_parallel": bool(extra.get("sequence_parallel"))}
    max_norm = clip if clip > 0 else float("inf")
    per_rank = BATCH // dp
    for step in range(STEPS):
        x, y = global_batch(step, vocab)
        mine = slice(grid.dp_rank * per_rank, (grid.dp_rank + 1) * per_rank)
        micro = list(zip(x[mine].chunk(accum), y[mine].chunk(accum)))
        strategy.reseed(step * 1009)
        loss = strategy.forward_backward(micro)
        norm = strategy.clip_grad_norm_(max_norm)
        strategy.optimizer_step(tcfg.lr)
        out["comm"].append(strategy.comm_stats())
        ref_loss = ref.forward_backward(list(zip(x.chunk(accum), y.chunk(accum))))
        ref_norm = ref.clip_grad_norm_(max_norm)
        ref.optimizer_step(tcfg.lr)
        out["loss_rel_diff"] = max(out["loss_rel_diff"], abs(loss - ref_loss) / abs(ref_loss))
        out["norm_rel_diff"] = max(out["norm_rel_diff"], abs(norm - ref_norm) / abs(ref_norm))
        out["replicated_equal"].append(replicated_equal(strategy, grid))
    state = strategy.state_dict()
    if grid.is_main:
        ref_state = dict(ref.module.named_parameters())
        out["shapes_canonical"] = all(tuple(state[n].shape) == tuple(p.shape)
                                      for n, p in ref_state.items())
        out["param_max_abs_diff"] = max((state[n] - p.detach()).abs().max().item()
                                        for n, p in ref_state.items())
    return out


def digest():
    return hashlib.sha1(torch.default_generator.get_state().numpy().tobytes()).hexdigest()[:12]


def check_random_streams(sequence_parallel):
    """Generator state at every dropout and attention call, and whether replicated
    parameters stay equal across TP ranks while training with dropout."""
    grid = ProcessGrid(1, 1, dist.get_world_size(), torch.device("cpu"))
    torch.manual_seed(7)
    model = GPT(gpt_config(64, dropout=0.1))
    strategy = build_strategy(model, grid, ParallelConfig(dp="single", tp=grid.tp_size,
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
    return {"dropout_same_across_tp": same("dropout"), "attention_same_across_tp": same("attention"),
            "replicated_equal": equal}


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    result = {"cases": {}, "random": {}}
    for case in CASES[world]:
        result["cases"][case[0]] = check_case(world, *case)
    for sp in (False, True):
        result["random"][f"sp={sp}"] = check_random_streams(sp)
    dist.barrier()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    code = 0
    try:
        main()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the teardown that sometimes aborts (DESIGN.md section 6)
