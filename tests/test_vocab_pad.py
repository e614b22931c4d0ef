"""model.vocab_pad_to: the embedding and LM head padded to a multiple of it (issue 46).

A padded run is the unpadded one: the same per-step losses and pre-clip gradient norms
(rtol 1e-5) in one process (65 ids padded to 128), and through main.py (the embedded
corpus's 50 characters padded to 128) under every data-parallel strategy on 2 ranks,
tp=2 (rank 1 holds padding only), pp=2 and cp=2. The padded rows get -inf logits (never
sampled, never a gradient: they stay zero through AdamW's weight decay) and are in no
state, so a snapshot resumes across paddings both ways and mode=export writes the real
rows.
"""

import shutil

import pytest
import torch

from harness import TINY, assert_parity, read_metrics, run_job, run_metrics, save_then_resume
from checkpoint import hf_gpt2
from checkpoint.canonical import load_named_parameters
from checkpoint.export import export
from checkpoint.snapshot_reader import open_snapshot
from config import load_config
from model import GPT, GPTConfig

V, PADDED = 65, 128  # in process: 65 ids padded to 128
CORPUS_V = 50        # the embedded corpus's characters (main.py's runs): tp=2's rank 1 holds
                     # rows 64-127, padding only
PAD = ["model.vocab_pad_to=128"]
SHAPE = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=V)


def steps(grid, pad_to, n=4):
    """(losses, pre-clip norms, strategy) of n AdamW steps (weight decay 0.1) of the seed-0
    GPT on the same random batches, in this process."""
    from parallel.config import ParallelConfig
    from parallel.parallelize import parallelize
    from training.config import TrainerConfig
    strategy = parallelize(GPT(GPTConfig(**SHAPE, vocab_pad_to=pad_to), seed=0), grid,
                           ParallelConfig(dp="single"))
    strategy.configure_optimizer(TrainerConfig(weight_decay=0.1))
    gen = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(n):
        x, y = (torch.randint(V, (4, 16), generator=gen) for _ in range(2))
        losses.append(strategy.forward_backward([(x, y)]))
        norms.append(strategy.clip_grad_norm_(1.0))
        strategy.optimizer_step(3e-3)
    return losses, norms, strategy


def test_padded_model_trains_the_unpadded_one_and_its_padding_stays_zero(one_rank_grid):
    ref_loss, ref_norm, _ = steps(one_rank_grid, 1)
    loss, norm, strategy = steps(one_rank_grid, PADDED)
    assert_parity(ref_loss, loss)
    assert_parity(ref_norm, norm)
    weight = strategy.module.transformer.wte.weight
    assert weight.shape == (PADDED, 32)
    assert torch.count_nonzero(weight[V:]) == 0, "padded rows are not zero (drawn, or moved by a gradient)"
    state = strategy.state_dict()
    assert state["transformer.wte.weight"].shape == (V, 32)
    assert torch.equal(state["transformer.wte.weight"], weight[:V])


def test_padded_ids_are_never_sampled():
    model = GPT(GPTConfig(**SHAPE, vocab_pad_to=PADDED), seed=0).eval()
    logits, _ = model(torch.zeros(1, 4, dtype=torch.long))
    assert logits.shape[-1] == PADDED and torch.all(logits[..., V:] == float("-inf"))
    out = model.generate(torch.zeros(2, 1, dtype=torch.long), 300, temperature=2.0,
                         generator=torch.Generator().manual_seed(0))
    assert out.max().item() < V, f"sampled padded id {out.max().item()}"


@pytest.mark.parametrize("nproc,layout", [
    (1, ["parallel.dp=single"]),
    (2, ["parallel.dp=ddp_bucket"]),
    (2, ["parallel.dp=fsdp", "parallel.zero_stage=3"]),
    (2, ["parallel.dp=single", "parallel.tp=2"]),
    (2, ["parallel.dp=ddp_naive"]),
    (2, ["parallel.dp=fsdp", "parallel.zero_stage=1"]),
    (2, ["parallel.dp=torch_ddp"]),
    (2, ["parallel.dp=torch_fsdp"]),
    (2, ["parallel.dp=single", "parallel.pp=2", "parallel.microbatches=2"]),
    (2, ["parallel.dp=ddp_bucket", "parallel.cp=2"]),
], ids=["single", "ddp_bucket", "fsdp3", "tp2", "ddp_naive", "fsdp1", "torch_ddp", "torch_fsdp",
        "pp2", "cp2"])
def test_padded_run_matches_the_unpadded_one(tmp_path, nproc, layout):
    ref = run_metrics(tmp_path, 1, ["parallel.dp=single"])
    got = run_metrics(tmp_path, nproc, layout + PAD)
    assert_parity(ref, got)


@pytest.mark.parametrize("saved,resumed", [([], PAD), (PAD, [])], ids=["unpadded->padded",
                                                                       "padded->unpadded"])
def test_snapshot_resumes_across_paddings(tmp_path, saved, resumed):
    ref = run_metrics(tmp_path, 1, ["parallel.dp=single"])
    got = save_then_resume(tmp_path, (1, ["parallel.dp=single"] + saved),
                           (2, ["parallel.dp=fsdp", "parallel.zero_stage=3"] + resumed))
    assert_parity(ref[3:], got)


def test_export_of_a_padded_run_holds_the_real_rows(tmp_path):
    result = run_job(tmp_path / "job", 2, ["parallel.dp=single", "parallel.tp=2",
                                           "trainer.save_every=3"] + PAD)
    assert result.returncode == 0, result.stderr[-3000:]
    snapshot = tmp_path / "job" / "runs" / "default" / "snapshot"
    reader = open_snapshot(str(snapshot))
    assert reader.meta["gpt_config"]["vocab_pad_to"] == PADDED
    assert tuple(reader.shape("model/transformer.wte.weight")) == (CORPUS_V, 32)
    out = tmp_path / "hf"
    export(load_config(["mode=export", f"export.path={out}",
                        f"trainer.snapshot_path={snapshot}"], 1))
    tensors = hf_gpt2.read_folder(str(out))[1]
    assert tuple(tensors["transformer.wte.weight"].shape) == (CORPUS_V, 32)
    # the exported weights are the padded model's: the same logits on real ids
    model = GPT(GPTConfig(**reader.meta["gpt_config"])).eval()
    load_named_parameters(model, {k: hf_gpt2.from_hf(tensors, reader.meta["gpt_config"], "x")[k]
                                  for k in model.canonical_shapes()})
    assert torch.count_nonzero(model.transformer.wte.weight[CORPUS_V:]) == 0
    x = torch.randint(CORPUS_V, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(x)[0]
        unpadded = GPT(GPTConfig(**{**reader.meta["gpt_config"], "vocab_pad_to": 1}))
        load_named_parameters(unpadded, {n: reader.read_full(f"model/{n}")
                                         for n in unpadded.canonical_shapes()})
        assert torch.allclose(ours[..., :CORPUS_V], unpadded(x)[0], rtol=1e-5, atol=1e-6)
    shutil.rmtree(out)
