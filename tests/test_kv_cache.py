"""The sampler's key/value cache (generation/kv_cache.py) against the plain model's
uncached `GPT.generate`: the same tokens from the same seed, and each step's logits to
fp32 tolerance (rtol 1e-5, atol 1e-5: the cached pass multiplies one row where the
uncached one multiplies the whole window), dense and mixture-of-experts, a padded
vocabulary, prompts shorter and longer than the context, text that outgrows it."""

import pytest
import torch

from generation import kv_cache
from model import GPT, GPTConfig, causal_attention

BLOCK = 16


def tiny(**model):
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=13, block_size=BLOCK,
                       vocab_pad_to=8, **model)  # 13 ids in 16 rows: 3 padded ones
    return GPT(config, seed=3).eval()


def uncached_logits(model, tokens, prompt_length):
    """Each step's last-position logits, as the uncached path computes them."""
    rows = []
    with torch.no_grad():
        for end in range(prompt_length, tokens.size(1)):
            logits, _ = model(tokens[:, :end][:, -BLOCK:])
            rows.append(logits[:, -1, :])
    return rows


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
@pytest.mark.parametrize("prompt_length", [3, BLOCK + 5], ids=["short", "long"])
def test_cached_sampling_is_the_uncached_one(experts, prompt_length):
    model = tiny(moe_experts=experts, moe_top_k=2)
    prompt = torch.randint(13, (2, prompt_length), generator=torch.Generator().manual_seed(1))
    n = 2 * BLOCK  # the short prompt's text outgrows the context halfway
    plain = model.generate(prompt, n, temperature=1.5, top_k=10,
                           generator=torch.Generator().manual_seed(7))
    seen, widths = [], []
    hook = model.transformer.h[0].register_forward_hook(lambda m, i, o: widths.append(i[0].size(1)))
    cached = kv_cache.generate(model, prompt, n, temperature=1.5, top_k=10,
                               generator=torch.Generator().manual_seed(7), seen=seen.append)
    hook.remove()
    differ = (cached != plain).any(0).nonzero().flatten().tolist()
    assert not differ, f"the tokens differ from position {differ[0]} on (the prompt: {prompt_length})"
    worst = 0.0
    for step, (got, want) in enumerate(zip(seen, uncached_logits(model, cached, prompt_length))):
        assert torch.isinf(got[:, 13:]).all() and torch.isfinite(got[:, :13]).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step}: {m}")
        worst = max(worst, (got[:, :13] - want[:, :13]).abs().max().item())
    print(f"largest logit difference {worst:.2e}")
    # the cache did the work: within the context one token a pass after the prompt, then
    # the whole window again each step (the positions moved)
    lengths = [min(prompt_length + s, BLOCK) if s == 0 or prompt_length + s > BLOCK else 1
               for s in range(n)]
    assert widths == lengths, widths
    assert all(block.attn.attend is causal_attention for block in model.transformer.h), \
        "the model's own attention is restored"


def test_the_benchmark_runs_at_a_tiny_size_and_its_results_render_as_committed(tmp_path, capsys):
    """`python -m bench.sampling` (docs/data.md's numbers) at a tiny size: both ways timed,
    the same tokens checked; each committed results.json renders into its results.md's rows."""
    import glob
    import json
    import os
    from bench import sampling
    from harness import REPO
    assert sampling.main(["--tokens", "4,20", "--rounds", "1", "--set", "model.n_layer=1",
                          "--set", "model.n_embd=32", "--set", "data.block_size=16",
                          "--out", str(tmp_path)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 20 |")]
    assert len(rows) == 2 and (tmp_path / "results.json").exists(), rows
    committed = glob.glob(os.path.join(REPO, "docs", "bench", "sampling-*", "results.json"))
    assert committed
    for path in committed:
        want = open(path.replace(".json", ".md")).read().splitlines()
        assert sampling.table(json.load(open(path))["seconds"]) == [
            line for line in want if line.startswith("|")], path
