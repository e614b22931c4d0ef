"""The model plan: the one place that names the GPT's modules for parallelism.

model.py stays plain single-device code; every dimension in parallel/ asks
this plan where the pieces it works on are, never the module tree itself:

- the transformer blocks and their canonical name prefixes: pipeline chunks
  are runs of blocks, fsdp shards one unit per block, activation
  checkpointing recomputes blocks;
- the tied weight: the token embedding is also the LM head (one parameter,
  named once in the canonical state dict);
- each linear's tensor-parallel style (Megatron's column / row split), the
  vocabulary-parallel embedding, LM head and loss, the position embedding
  that sequence and context parallelism shard;
- the attention function that context parallelism replaces by its ring;
- the pieces a pipeline stage keeps: blocks, and the embeddings / the final
  LayerNorm and LM head on the first / last stage.

Another model is parallelized by writing its own plan with these names.
"""

from dataclasses import dataclass

import torch.nn as nn

TIED = "transformer.wte.weight"  # canonical name of the token embedding = LM head weight


@dataclass(frozen=True)
class TPLinear:
    """One linear of a block and how tensor parallelism splits it."""
    path: str        # inside the block
    style: str       # "column": output features split; "row": input features split
    fused: int = 1   # column: outputs are this many parts laid end to end (q | k | v),
                     # each split alike, so a rank keeps whole heads of each


# Megatron's pairing: column then row in attention (heads split) and in the MLP
TP_LINEARS = (TPLinear("attn.c_attn", "column", fused=3), TPLinear("attn.c_proj", "row"),
              TPLinear("mlp.c_fc", "column"), TPLinear("mlp.c_proj", "row"))

# a mixture-of-experts block's `mlp` (moe/layer.py): a router and stacked experts instead
EXPERT_WEIGHTS = ("experts.fc_weight", "experts.proj_weight", "experts.fc_bias",
                  "experts.proj_bias")  # inside the MoE; dim 0 indexes the experts


def tp_linears(block):
    """The TP_LINEARS this block has (a mixture-of-experts block has no mlp linears: its
    router and experts are replicated over TP, each rank routing its share of tokens)."""
    return [linear for linear in TP_LINEARS if moe_of(block) is None or not
            linear.path.startswith("mlp.")]


def moe_of(block):
    """The block's mixture-of-experts layer, or None for a dense block."""
    from moe.layer import MoE
    return block.mlp if isinstance(block.mlp, MoE) else None


def moe_layers(model):
    """[(canonical block index, MoE layer)] of the blocks this rank holds with experts."""
    return [(i, moe_of(block)) for i, block in blocks(model) if moe_of(block) is not None]


# module paths of the vocabulary pieces, for PyTorch's DTensor plan (parallel/reference)
TOKEN_EMBEDDING, LM_HEAD = "transformer.wte", "lm_head"


# ---------------------------------------------------------------- blocks

def blocks(model):
    """[(canonical block index, block)] this rank holds, in order: the GPT's ModuleList,
    or the ModuleDict a pipeline stage keeps (keyed by canonical index)."""
    h = model.transformer.h
    if isinstance(h, nn.ModuleDict):
        return [(int(key), block) for key, block in h.items()]
    return list(enumerate(h))


def block_prefix(i):
    """Canonical name prefix of block i's parameters."""
    return f"transformer.h.{i}."


def block_parameter_names(model):
    """[[canonical names of one block's parameters], ...], one list per block held."""
    return [[block_prefix(i) + n for n, _ in block.named_parameters()] for i, block in blocks(model)]


def hidden_matrices(model):
    """{canonical name: stored (in, out)} of the blocks' matrices this rank holds, which
    Muon orthogonalizes: attention, MLP and router weights (out, in) as nn.Linear holds
    them, and the stacked experts' weights [E, in, out] (moe/experts.py: each expert's
    slice is a matrix of its own). Biases, norms, embeddings and the head are not."""
    return {n: p.dim() == 3 for names, (_, block) in zip(block_parameter_names(model), blocks(model))
            for n, p in zip(names, block.parameters()) if p.dim() >= 2 and not n.endswith("bias")}


# ---------------------------------------------------------------- tensor parallelism

def swap_linear(block, path, layer):
    parent, _, attr = path.rpartition(".")
    setattr(block.get_submodule(parent), attr, layer)


def token_embedding(model):
    return model.transformer.wte


def set_vocab_parallel(model, embedding, lm_head, loss):
    """Install the vocabulary-parallel embedding, the LM head tied to it, and its loss."""
    model.transformer.wte = embedding
    model.lm_head = lm_head
    model.cross_entropy = loss


def set_attention(block, attend):
    """Replace a block's attention function (softmax(q k^T) v; model.causal_attention)."""
    block.attn.attend = attend


def position_embedding(model):
    return model.transformer.wpe


def set_position_embedding(model, module):
    model.transformer.wpe = module


def tie_lm_head(model):
    """Tie the LM head to the token embedding again (after something replaced either)."""
    model.lm_head.weight = model.transformer.wte.weight


# ---------------------------------------------------------------- pipeline parallelism

def keep_for_stage(model, keep_blocks, has_first, has_last):
    """Cut `model` in place to a pipeline rank's pieces: blocks `keep_blocks` (a
    ModuleDict keyed by canonical index), the embeddings if it runs the first chunk,
    the final LayerNorm, LM head and loss if it runs the last (the tied weight on both)."""
    t = model.transformer
    t.h = nn.ModuleDict({str(i): t.h[i] for i in sorted(keep_blocks)})
    if not has_first:
        del t["wpe"], t["drop"]
    if not has_last:
        del t["ln_f"], model.lm_head, model.cross_entropy
    if not (has_first or has_last):
        del t["wte"]


def chunk_prefixes(block_indices, first, last):
    """Canonical name prefixes of the parameters one pipeline chunk uses."""
    prefixes = [block_prefix(i) for i in block_indices]
    if first:
        prefixes += ["transformer.wte.", "transformer.wpe."]
    if last:
        prefixes += ["transformer.wte.", "transformer.ln_f."]
    return prefixes


def stage_modules(model, first, last):
    """{name: module} outside the blocks that a first / last chunk runs (for PyTorch's
    PipelineStage, which takes a stage's parameters from the module it is given)."""
    t = model.transformer
    return {**({"wte": t.wte, "wpe": t.wpe} if first else {}),
            **({"ln_f": t.ln_f, "lm_head": model.lm_head} if last else {})}
