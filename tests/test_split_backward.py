"""The zero-bubble schedules' split backward (parallel/pipeline_parallel/split_backward.py),
in process: B (the input's gradient) then W (the weights') gives exactly the gradients
of one plain backward, computes no weight gradient in B, fires each parameter's
post-accumulate hook once, in W (data-parallel sync keys on it), and not at all for a
`quiet` parameter (zbv's tied weight in the LM head's W: pipeline.py)."""

import collections

import torch

from model import GPT, GPTConfig
from parallel.pipeline_parallel.split_backward import backward_input, backward_weight


def two_chunk_run(split, quiet_head=False):
    """A 2-block GPT cut in two chunks (embedding + block 0 | block 1 + head), backward
    through both: plainly, or B of both then W of both. Returns (grads, hook counts
    after B, hook counts at the end)."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    x, y = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    fired = collections.Counter()
    for n, p in gpt.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: fired.update([n]))
    embedded = gpt.embed(x)
    seam = embedded.detach().requires_grad_() if split else embedded
    middle = gpt.transformer.h[0](seam)
    middle_in = middle.detach().requires_grad_()
    loss = gpt.head(gpt.transformer.h[1](middle_in), y)[1]
    params = list(gpt.parameters())
    if not split:
        loss.backward()
        middle.backward(middle_in.grad)
        return {n: p.grad.clone() for n, p in gpt.named_parameters()}, None, fired
    grad_middle, head_w = backward_input(loss, None, middle_in, params)
    grad_seam, first_w = backward_input(middle, grad_middle, seam, params)
    first_w.then = (embedded, grad_seam)
    after_b = collections.Counter(fired)
    no_grad_after_b = all(p.grad is None for p in params)
    backward_weight(head_w, quiet=[gpt.transformer.wte.weight] if quiet_head else ())
    backward_weight(first_w)
    assert no_grad_after_b, "B accumulated a weight gradient"
    return {n: p.grad.clone() for n, p in gpt.named_parameters()}, after_b, fired


def test_split_backward_gives_the_plain_gradients_and_fires_each_hook_once_in_w():
    plain, _, _ = two_chunk_run(split=False)
    split, after_b, fired = two_chunk_run(split=True)
    assert not after_b, f"hooks fired during B: {dict(after_b)}"
    assert set(split) == set(plain)
    for n in plain:
        assert torch.allclose(split[n], plain[n], rtol=1e-6, atol=1e-7), n
    # the tied embedding / LM head weight is used by both chunks: once per W that uses it
    assert fired == {n: 2 if n == "transformer.wte.weight" else 1 for n in plain}, dict(fired)


def test_quiet_parameter_gets_its_gradient_without_its_hook():
    plain, _, _ = two_chunk_run(split=False)
    split, _, fired = two_chunk_run(split=True, quiet_head=True)
    assert torch.allclose(split["transformer.wte.weight"], plain["transformer.wte.weight"],
                          rtol=1e-6, atol=1e-7)
    assert fired["transformer.wte.weight"] == 1, "the quiet LM-head gradient fired the hook"
