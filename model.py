"""A plain, single-device GPT-2 (after nanoGPT), with no parallel code in it.

Parallel strategies in `parallel/` transform this model from the outside
(wrap it, shard its parameters, swap its linears, split its blocks), so the
model stays the single source of truth for what one step computes.

A few details matter to the parallel code:
- attention derives its head count and sequence length from its projection's
  output, so tensor parallelism can hand it a column-split `c_attn` holding
  only the local heads (and, under sequence parallelism, a sequence shard
  that c_attn gathers);
- the token embedding and the LM head share one weight (`lm_head.weight is
  transformer.wte.weight`), so the canonical state dict names it once, as
  `transformer.wte.weight`; with `vocab_pad_to`, that tensor is its first vocab_size
  rows (`canonical_shapes`): the padded rows are zeros that no state holds, and the
  LM head gives them -inf logits (`LMHead`);
- the loss is a module (`cross_entropy`) that tensor parallelism can swap for
  its vocabulary-parallel one, and forward is `embed`, the blocks, `head`:
  pipeline stages run those pieces on different ranks;
- attention's softmax(q k^T) v is one function, `causal_attention`, held by
  each attention layer (`attend`), so context parallelism can hand it its
  ring attention over a sequence split across ranks;
- every parameter's initial value is drawn from a stream of its own, keyed by
  (seed, canonical name) (`initial_value`), so a rank that holds a slice or a
  shard of a parameter can make exactly that part's values with the model built
  on the meta device (no rank builds the whole model: parallel/initial.py).
"""

import hashlib
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe.experts import Experts
from moe.layer import MoE


@contextmanager
def shapes_only():
    """Modules built inside hold shapes, no values: the meta device, without nn modules'
    default init (their constructors' reset_parameters draw weights that the meta device
    does not keep, an Embedding's normal_ through torch's Python reference, some 70 ms
    each). What a run trains from is GPT.initial_value's, drawn where each rank
    materializes its share."""
    import torch.nn.init as init
    names = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")
    saved = {name: getattr(init, name) for name in names}
    for name in names:
        setattr(init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, function in saved.items():
            setattr(init, name, function)


@dataclass
class ModelConfig:
    """The `model:` section of gpt2_train_cfg.yaml."""
    n_layer: int = 4           # transformer blocks
    n_head: int = 4            # attention heads; must divide n_embd (and parallel.tp must divide it)
    n_embd: int = 128          # width of the residual stream
    dropout: float = 0.0       # dropout probability; 0 keeps runs bit-comparable across layouts
    bias: bool = True          # biases in Linear and LayerNorm, as in GPT-2
    init_from: str = ""        # a Hugging Face GPT-2 folder (config.json + model.safetensors) to
                               # start from; its shape must match; ignored when resuming
    moe_experts: int = 0       # mixture of experts (moe/): experts per MoE block, a router and
                               # experts in place of its MLP; 0 = dense
    moe_top_k: int = 2         # experts each token goes to
    moe_every: int = 1         # every n-th block carries experts (1: all; 2: blocks 1, 3, ...)
    moe_hidden: int = 0        # an expert's hidden width; 0 = 4 * n_embd (the dense MLP's)
    moe_renormalize: bool = True  # the k chosen weights rescaled to sum to 1 (moe/router.py)
    moe_aux_loss_coef: float = 0.01  # the balance loss's weight in the training loss
    moe_z_loss_coef: float = 0.001   # the router z-loss's weight (ST-MoE); 0 = off
    moe_bias_rate: float = 0.0  # DeepSeek-V3's loss-free balancing: per-expert choice biases
                                # move this much a step towards balance; 0 = off
    vocab_pad_to: int = 1       # vocabulary rows padded to a multiple of this (64: GPT-2's 50257
                                # -> 50304, docs/data.md); 1 = none

    def has_experts(self, block_index):
        """Whether block `block_index` is a mixture-of-experts block."""
        return self.moe_experts > 0 and (block_index + 1) % self.moe_every == 0


@dataclass
class GPTConfig(ModelConfig):
    """The model section plus what the data decides (vocabulary, context)."""
    vocab_size: int = 0
    block_size: int = 0

    @property
    def padded_vocab_size(self):
        """Rows of the embedding and LM head: vocab_size rounded up to a multiple of vocab_pad_to."""
        return -(-self.vocab_size // self.vocab_pad_to) * self.vocab_pad_to


def causal_attention(q, k, v, dropout_p):
    """softmax(q k^T / sqrt(d), causal) v for (B, heads, T, d) tensors."""
    # is_causal applies the mask; a float mask would be *added* (the tutorial's bug)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.head_dim = config.n_embd // config.n_head
        # q, k and v for all heads in one matmul: output is [q | k | v]
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout
        self.attend = causal_attention  # a function, not a module: no parameters, no hooks

    def forward(self, x):
        qkv = self.c_attn(x)
        B, T, _ = qkv.size()  # T: the whole sequence, even if x is a sequence shard
        q, k, v = qkv.chunk(3, dim=-1)
        n_head = q.size(-1) // self.head_dim  # local heads under tensor parallelism
        q, k, v = (t.view(B, T, n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.attend(q, k, v, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, n_head * self.head_dim)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)); in a
    mixture-of-experts block, `mlp` is a router and experts (moe/layer.py)."""

    def __init__(self, config: GPTConfig, experts=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MoE(config) if experts else MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LMHead(nn.Linear):
    """The LM head over a padded vocabulary: the logits of the padded ids (>= vocab_size)
    are -inf, so they take no probability, are never sampled and give their rows no
    gradient (tensor parallelism's head and loss mask their own padding)."""

    def __init__(self, n_embd, vocab_size, padded_vocab_size):
        super().__init__(n_embd, padded_vocab_size, bias=False)
        self.vocab_size = vocab_size

    def forward(self, x):
        logits = super().forward(x)
        if self.out_features > self.vocab_size:  # in place: the product's output is not saved
            logits[..., self.vocab_size:] = float("-inf")
        return logits


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, seed=None):
        """seed: of the initial weights (initial_value); None: drawn from torch's default
        generator (torch.manual_seed(s) then GPT(...) is reproducible). Built under
        `shapes_only()` (the meta device) it holds shapes only, no values."""
        super().__init__()
        assert config.vocab_size > 0 and config.block_size > 0
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, config.has_experts(i)) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = LMHead(config.n_embd, config.vocab_size, config.padded_vocab_size)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        self.cross_entropy = nn.CrossEntropyLoss()  # mean over tokens

        if self.lm_head.weight.device.type != "meta":  # on the meta device: nothing to draw
            self.init_weights(int(torch.randint(2**62, (), device="cpu")) if seed is None else seed)

    # ------------------------------------------------ initial weights, one parameter at a time

    def init_rule(self, name):
        """How parameter `name` starts (GPT-2's init): ("normal", std), or ("fill", value).
        N(0, 0.02) for linear and embedding weights, residual projections (c_proj)
        scaled by 1/sqrt(2 * n_layer); biases 0; LayerNorm weights 1."""
        path, _, kind = name.rpartition(".")
        module = self.get_submodule(path)
        if isinstance(module, Experts):
            return module.init_rule(kind, self.config.n_layer)
        if isinstance(module, nn.LayerNorm):
            return ("fill", 1.0 if kind == "weight" else 0.0)
        if kind == "bias":
            return ("fill", 0.0)
        std = 0.02 / math.sqrt(2 * self.config.n_layer) if path.endswith("c_proj") else 0.02
        return ("normal", std)

    @staticmethod
    def initial_value(name, shape, rule, seed):
        """The whole canonical tensor `name` at the start, on the CPU, from its own stream:
        a generator seeded by (seed, name), so its values do not depend on which other
        parameters exist or in which order anyone draws them."""
        if rule[0] == "fill":  # drawn on the host whatever the device: the same values everywhere
            return torch.full(tuple(shape), float(rule[1]), device="cpu")
        digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
        return torch.empty(tuple(shape), device="cpu").normal_(0.0, rule[1], generator=gen)

    def canonical_shapes(self):
        """{name: shape} of the state snapshots, state_dict and the export hold: each
        parameter's, but the tied weight's real rows only (a padded vocabulary's rows
        belong to no token: they stay zero)."""
        shapes = {name: tuple(p.shape) for name, p in self.named_parameters()}
        shapes["transformer.wte.weight"] = (self.config.vocab_size, self.config.n_embd)
        return shapes

    @torch.no_grad()
    def init_weights(self, seed):
        """Every parameter to initial_value(seed) (what a sharded run materializes too);
        a padded vocabulary's rows to zeros."""
        for name, shape in self.canonical_shapes().items():
            box = tuple(slice(0, n) for n in shape)  # all of it, or a padded vocabulary's real rows
            self.get_parameter(name).zero_()[box].copy_(
                self.initial_value(name, shape, self.init_rule(name), seed))

    def num_params(self):
        """Parameters of the canonical model (a padded vocabulary's rows not counted)."""
        return sum(math.prod(shape) for shape in self.canonical_shapes().values())

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.head(x, targets)

    def embed(self, idx, start=0):
        """start: the position of idx's first token (the sampler's cache feeds one token at
        a time, after the ones it holds: generation/kv_cache.py)."""
        _, T = idx.size()
        assert start + T <= self.config.block_size, \
            f"sequence of {start + T} > block_size {self.config.block_size}"
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))

    def head(self, x, targets=None):
        """(logits, mean loss over tokens or None)."""
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        return logits, self.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def optim_groups(self, weight_decay):
        """AdamW parameter groups by name: matrices decay, biases and norms don't (the
        experts' biases are (E, width): named `..._bias`)."""
        params = dict(self.named_parameters())  # the tied weight appears once
        decay = [n for n, p in params.items() if p.dim() >= 2 and not n.endswith("bias")]
        no_decay = [n for n in params if n not in set(decay)]
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Extend `idx` (B, T) by sampling max_new_tokens tokens, one at a time, each from
        the whole context again (generation/kv_cache.py keeps what it computed instead)."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            idx_next = pick_next(logits[:, -1, :], temperature, top_k, generator)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def pick_next(logits, temperature=1.0, top_k=None, generator=None):
    """(B, 1) next tokens drawn from (B, vocab) last-position logits: scaled by the
    temperature, cut to the top_k most likely (None: all)."""
    logits = logits / max(temperature, 1e-6)
    if top_k:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("inf")
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
