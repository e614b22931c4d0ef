"""The parameters a rank holds, from the real model and tensor-parallel code on the meta
device (no memory, no process group): what every per-rank byte count starts from.

`census(shape, tp, ep)` builds the GPT with model.py on the meta device (mixture-of-experts
blocks included: a router and all E experts each) and applies
parallel/tensor_parallel/apply.py's split as TP rank 0 would (every TP rank holds the
same sizes: a vocabulary tp does not divide is padded), so the planner counts exactly
the tensors a run allocates, in the order the strategies see them. Expert parallelism
(ep > 1) keeps E / ep of each block's stacked experts (parallel/expert_parallel/apply.py:
dim 0 cut, `expert`); the routers and experts are replicated over TP, their gradients
partial sums over it.
"""

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace


@dataclass(frozen=True)
class Param:
    name: str         # canonical name (model_plan's; the tied embedding once)
    numel: int        # elements on one TP rank (its slice, vocabulary padding included; its experts)
    group: int        # AdamW group of GPT.optim_groups: 0 decayed (matrices), 1 not
    replicated: bool  # the same on every TP rank (LayerNorms, row biases, wpe, routers, experts)
    expert: bool = False   # a run of E / ep experts (ep > 1): sharded and averaged over their own group
    partial: bool = False  # its gradient is a partial sum over TP, summed after the data-parallel sync


def moe_param(name) -> bool:
    """A mixture-of-experts block's router or experts."""
    return ".mlp.router." in name or ".mlp.experts." in name


@lru_cache(maxsize=None)
def census(shape, tp, ep=1):
    """shape: Workload.shape (n_layer, n_head, n_embd, vocab_size, block_size, bias, and the
    experts' E, k, every, hidden). Returns the tuple of Params in GPT.named_parameters()
    order under tensor parallelism tp and expert parallelism ep."""
    import torch

    from model import GPT, GPTConfig, shapes_only
    from parallel import model_plan as plan
    from parallel.comm import CommCounter
    from parallel.tensor_parallel.apply import apply_tensor_parallel
    n_layer, n_head, n_embd, vocab, block, bias, *more = shape
    experts, top_k, every, hidden, kv_heads, ffn, gated, untied = \
        tuple(more) + (0, 2, 1, 0, 0, 0, False, False)[len(more):]
    with shapes_only():
        model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, bias=bias,
                              vocab_size=vocab, block_size=block, moe_experts=experts,
                              moe_top_k=top_k, moe_every=every, moe_hidden=hidden))
    groups = {n: g for g, grp in enumerate(model.optim_groups(0.0)) for n in grp["params"]}
    placements = None
    if tp > 1:
        grid = SimpleNamespace(tp_group=None, tp_size=tp, tp_rank=0, device=torch.device("meta"))
        tp_cfg = SimpleNamespace(sequence_parallel=False)
        placements, _ = apply_tensor_parallel(model, grid, tp_cfg, CommCounter())
    out = []
    for n, p in model.named_parameters():
        cut = ep > 1 and moe_param(n) and n.endswith(plan.EXPERT_WEIGHTS)
        replicated = bool(placements and placements[n].tp_replicated)
        out.append(Param(n, p.numel() // ep if cut else p.numel(), groups[n], replicated, cut,
                         tp > 1 and moe_param(n)))
    if kv_heads or ffn or gated or untied:
        out = foreign_block(out, n_head, n_embd, vocab, tp, kv_heads, ffn or 4 * n_embd, gated,
                            untied)
    return tuple(out)


def foreign_block(params, n_head, C, vocab, tp, kv_heads, H, gated, untied):
    """GPT-2's census resized to another system's block (plan.kv_heads, ffn_hidden,
    gated_ffn, untied_head; no model here builds it, so the sizes are counted, not
    allocated): q|k|v of C + 2 x K/V heads' width, the MLP's first product H (2 H gated:
    gate and up fused) and its second H x C, split over TP as GPT-2's; an untied LM head
    (vocabulary-parallel under TP) after the final LayerNorm (the last stage's)."""
    kv = 2 * (kv_heads or n_head) * (C // n_head)
    fc = H * (2 if gated else 1)
    size = {".attn.c_attn.weight": C * (C + kv) // tp, ".attn.c_attn.bias": (C + kv) // tp,
            ".mlp.c_fc.weight": C * fc // tp, ".mlp.c_fc.bias": fc // tp,
            ".mlp.c_proj.weight": H * C // tp}
    out = []
    for q in params:
        end = next((e for e in size if q.name.endswith(e)), None)
        out.append(Param(q.name, size[end], q.group, q.replicated) if end else q)
    if untied:
        out.append(Param("transformer.ln_f.lm_head.weight", -(-vocab // tp) * C, 0, False))
    return out
