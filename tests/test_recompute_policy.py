"""Selective activation checkpointing's policy and block choice, in process (issue 52,
section 2).

- `keep_matmuls` (parallel/checkpointing.py) keeps the fused attention kernels' outputs
  unless they draw dropout: CPU runs only `_scaled_dot_product_flash_attention_for_cpu`,
  and the layout tests run attention without dropout, so the guard is reached here only,
  by calling the policy with each kernel's arguments, positional and by keyword;
- `checkpoint_blocks(..., every=n)` recomputes the blocks whose *canonical* index is a
  multiple of n, on a pipeline stage too (its blocks keyed by canonical index);
- a MoE GPT under selective recompute, in a process where `torch._grouped_mm` was never
  probed, gives the gradients of the run without checkpointing (the probe once ran inside
  the selective caching mode and crashed the recompute).
"""

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import moe.experts as experts_module
from model import GPT, GPTConfig
from parallel import model_plan as plan
from parallel.checkpointing import checkpoint_blocks, keep_matmuls

aten = torch.ops.aten
ATTENTION = [name for name in ("_scaled_dot_product_flash_attention",
                               "_scaled_dot_product_efficient_attention",
                               "_scaled_dot_product_cudnn_attention",
                               "_scaled_dot_product_flash_attention_for_cpu")
             if hasattr(aten, name)]


def positional(op, dropout_p):
    """Arguments up to and including dropout_p, in the schema's order (placeholders for
    the others: the policy reads dropout_p only)."""
    names = [a.name for a in op._schema.arguments]
    return tuple(dropout_p if n == "dropout_p" else None for n in names[:names.index("dropout_p") + 1])


@pytest.mark.parametrize("name", ATTENTION)
def test_the_policy_keeps_fused_attention_only_without_dropout(name):
    """dropout_p 0 (or left to its default): MUST_SAVE; 0.1: PREFER_RECOMPUTE (saving it
    would shift the stream the recomputed dropouts draw from), whether dropout_p comes
    positionally or as a keyword."""
    op = getattr(aten, name).default
    q = torch.zeros(1, 1, 2, 4)
    assert keep_matmuls(None, op, q, q, q) == CheckpointPolicy.MUST_SAVE  # the default, 0
    for p, want in ((0.0, CheckpointPolicy.MUST_SAVE), (0.1, CheckpointPolicy.PREFER_RECOMPUTE)):
        args = positional(op, p)
        assert keep_matmuls(None, op, *args) == want, (name, "positional", p)
        assert keep_matmuls(None, op, *args[:3], dropout_p=p) == want, (name, "keyword", p)


def test_the_policy_keeps_matrix_products_and_recomputes_the_rest():
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        assert keep_matmuls(None, op) == CheckpointPolicy.MUST_SAVE, op
    for op in (aten.gelu.default, aten.native_layer_norm.default, aten.native_dropout.default,
               aten.add.Tensor):
        assert keep_matmuls(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op


def tiny(n_layer, **more):
    return GPTConfig(**{**dict(n_layer=n_layer, n_head=2, n_embd=16, vocab_size=20,
                               block_size=8), **more})


@pytest.mark.parametrize("keep,want", [
    (None, [0, 2, 4]),    # the GPT's ModuleList of 5 blocks
    ([3, 4, 5], [4]),     # a pipeline stage holding blocks 3-5: canonical 4, not its first
    ([2, 3], [2]),
], ids=["gpt", "stage-3-5", "stage-2-3"])
def test_every_second_block_is_recomputed_by_canonical_index(keep, want):
    """checkpoint_blocks(every=2) wraps exactly the blocks whose canonical index is even,
    and those (only those) run their forward again in backward."""
    torch.manual_seed(0)
    gpt = GPT(tiny(6 if keep else 5), seed=1)
    if keep:  # cut as the pipeline cuts a stage: a ModuleDict keyed by canonical index
        plan.keep_for_stage(gpt, keep, has_first=False, has_last=False)
    blocks = plan.blocks(gpt)
    assert [i for i, _ in blocks] == (keep or list(range(5)))
    calls = {i: 0 for i, _ in blocks}
    for i, block in blocks:  # counts every run of the block's own forward, recompute too
        block.attn.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    checkpoint_blocks(gpt, mode="selective", every=2)
    assert [i for i, b in blocks if getattr(b, "checkpointed", False)] == want
    h = torch.randn(2, 8, 16, requires_grad=True)
    for _, block in blocks:
        h = block(h)
    h.sum().backward()
    assert [i for i, n in calls.items() if n == 2] == want, calls
    assert all(n in (1, 2) for n in calls.values()), calls


def test_moe_gpt_under_selective_recompute_in_a_fresh_process_matches_no_recompute(monkeypatch):
    """A MoE GPT whose first forward probes torch._grouped_mm (`_GROUPED_OK` empty, as in
    a fresh process) inside a selectively recomputed block: the gradients equal the run
    without checkpointing (fp32, rtol 1e-5). The probe must run outside the step's
    dispatch modes, or the selective cache hands its output to the block's first product
    in the recompute."""
    monkeypatch.setattr(experts_module, "_GROUPED_OK", {})
    config = tiny(2, n_embd=32, moe_experts=4, moe_top_k=2, moe_hidden=48)
    x = torch.randint(20, (2, 8), generator=torch.Generator().manual_seed(4))
    grads = []
    for recompute in (True, False):  # the recomputed one first: it probes
        model = GPT(config, seed=3)
        if recompute:
            checkpoint_blocks(model, mode="selective")
        _, loss = model(x, x)
        if recompute:
            assert experts_module._GROUPED_OK == {("cpu", torch.float32): True}, \
                experts_module._GROUPED_OK  # probed in this forward, and the grouped path taken
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[1].items():
        atol = 1e-5 * max(g.abs().max().item(), 1e-3)
        torch.testing.assert_close(grads[0][name], g, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")
