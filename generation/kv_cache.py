"""Sampling with a key/value cache: each new token costs one token's forward pass, not the
whole context's (model.GPT.generate, the plain model's own, runs the context again).

The model stays model.py's plain GPT and its weights are used as they are: the sampler
runs the model's own pieces (`embed` at the token's position, each block, `head`) and
hands each attention layer, for the length of one `generate`, an attention function of
its own (`attend`, the hook context parallelism's ring uses too). That function keeps
the layer's keys and values: the first pass over the prompt attends through the layer's
own function (causal), and each later pass's single query attends to every key kept,
its own included (the causal mask of a last row). Everything else (layer norms, the
projections, the MLP or the mixture of experts, which routes each token alone, the LM
head and its padded vocabulary's -inf) is the model's code.

Context limit: positions are learned absolute embeddings, so once the text outgrows
`block_size` the uncached path's window moves and every kept key belongs to a position
it no longer has. From there each token recomputes the last block_size tokens, as the
uncached path does (the same logits, no speed-up); up to block_size tokens, one token's
pass each. Only the last position goes through the LM head.
"""

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from model import pick_next


class LayerCache:
    """One attention layer's keys and values (B, heads, T, head_dim) so far."""

    def __init__(self, causal):
        self.causal = causal  # the layer's own attention function
        self.k = self.v = None

    def attend(self, q, k, v, dropout_p):
        if self.k is None:  # the prompt (or the window after the context is full): causal
            self.k, self.v = k, v
            return self.causal(q, k, v, dropout_p)
        assert q.size(2) == 1, "after the first pass the cache takes one token at a time"
        self.k, self.v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)
        # the newest token's query sees every earlier key and its own: no mask to apply
        return F.scaled_dot_product_attention(q, self.k, self.v, dropout_p=dropout_p)


@contextmanager
def cached_attention(blocks):
    """Each block's attention through a fresh LayerCache; the model's own after."""
    saved = [block.attn.attend for block in blocks]
    caches = [LayerCache(attend) for attend in saved]
    for block, cache in zip(blocks, caches):
        block.attn.attend = cache.attend
    try:
        yield caches
    finally:
        for block, attend in zip(blocks, saved):
            block.attn.attend = attend


def last_logits(model, idx, start):
    """(B, vocab) logits of the token after idx, whose first token sits at `start`."""
    x = model.embed(idx, start)
    for block in model.transformer.h:
        x = block(x)
    logits, _ = model.head(x[:, -1:, :])
    return logits[:, -1, :]


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None,
             seen=None):
    """model.generate's tokens for the same arguments (the same generator draws), from a
    cache. seen: called with each step's (B, vocab) logits (the tests compare them)."""
    block_size, blocks = model.config.block_size, model.transformer.h
    with cached_attention(blocks) as caches:
        for step in range(max_new_tokens):
            T = idx.size(1)
            if step == 0 or T > block_size:  # a first pass: the prompt, or a moved window
                for cache in caches:
                    cache.k = cache.v = None
                logits = last_logits(model, idx[:, -block_size:], 0)
            else:  # one token, at its position after the T - 1 the cache holds
                logits = last_logits(model, idx[:, -1:], T - 1)
            if seen is not None:
                seen(logits)
            idx = torch.cat((idx, pick_next(logits, temperature, top_k, generator)), dim=1)
    return idx
