"""Mixture-of-experts units in process, against definitions written out by hand (issue 52,
section 2: faults in code the layout parity tests' single-process replica shares, which
parity therefore cannot see).

- the router: the weights are the unbiased softmax probabilities of the experts the
  biased scores chose; its product runs in fp32 under bf16 autocast;
- the MoE block (router, sort, grouped experts, combine) against a loop over tokens and
  their k experts, forward and every gradient, on the grouped path (torch._grouped_mm)
  and on the per-expert loop, with an expert that gets no token, under a gradient that
  is not contiguous;
- DeepSeek-V3's choice biases through the Strategy: moved against the counts after a
  healthy step, bitwise unchanged after a skipped one;
- fp16's loss scale reaching the block losses under accumulation.

Each was shown red by hand against a planted fault (docs/testing-experts.md).
"""

import pytest
import torch
import torch.nn.functional as F

import moe.experts as experts_module
import moe.layer as moe_layer
from model import GPT, GPTConfig
from moe.experts import Experts
from moe.layer import MoE
from moe.router import route

E, K, C, HIDDEN = 4, 2, 16, 24  # 16 and 24 fp32 floats: rows 16-byte aligned (_grouped_mm)
EMPTY = 1  # an expert in the middle that no token chooses (its choice bias -10)
BIASES = torch.tensor([0.0, -10.0, 0.06, -0.03])


def close(got, want, msg=None):
    """fp32: rtol 1e-5, atol 1e-5 x the reference's largest magnitude (a sum of products
    that cancels to near 0 keeps only the rounding of its terms)."""
    atol = 1e-5 * max(want.abs().max().item(), 1e-3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=msg)


def block_config(**more):
    return GPTConfig(**{**dict(n_layer=1, n_head=2, n_embd=C, vocab_size=20, block_size=8,
                                moe_experts=E, moe_top_k=K, moe_hidden=HIDDEN,
                                moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0), **more})


# ---------------------------------------------------------------- the router

@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "raw"])
def test_router_weights_are_the_unbiased_probabilities_of_the_biased_choice(renormalize):
    """With choice biases the experts are the top k of softmax + bias, and the weights the
    softmax probabilities of those experts (renormalized or not): the biases move the
    choice only, never the weights (DeepSeek-V3)."""
    torch.manual_seed(2)
    B, T = 3, 8
    logits = torch.randn(B, T, E)
    bias = torch.tensor([0.3, -0.2, 0.1, -0.4])
    r = route(logits, K, renormalize, bias=bias)
    probs = logits.softmax(-1)
    chosen = (probs + bias).topk(K, -1).indices
    assert torch.equal(r.experts, chosen.reshape(-1, K))
    assert not torch.equal(chosen, probs.topk(K, -1).indices), "the biases must change choices"
    want = probs.gather(-1, chosen)
    if renormalize:
        want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(r.weights, want.reshape(-1, K), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-in", "bf16-in"])
def test_the_router_product_runs_in_fp32_under_bf16_autocast(dtype, monkeypatch):
    """Under bf16 autocast the logits the block hands route() are fp32, and equal the fp32
    product of the token and the router's weight (a bf16 product cast up afterwards
    is ~1e-2 off)."""
    torch.manual_seed(0)
    layer = MoE(block_config())
    for p in layer.parameters():
        p.data.normal_()
    seen = []
    real_route = moe_layer.route

    def spy(logits, *args, **kwargs):
        seen.append(logits)
        return real_route(logits, *args, **kwargs)
    monkeypatch.setattr(moe_layer, "route", spy)
    x = torch.randn(2, 8, C).to(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    (logits,) = seen
    assert logits.dtype == torch.float32, logits.dtype
    want = (x.float().reshape(-1, C) @ layer.router.weight.detach().t()).view(2, 8, E)
    torch.testing.assert_close(logits.detach(), want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- the block by hand

def by_hand(layer, x, renormalize):
    """The block's output for x (B, T, C), one token and one chosen expert at a time, from
    copies of its parameters: (output, {name: leaf})."""
    leaves = {"router": layer.router.weight, "fc_weight": layer.experts.fc_weight,
              "fc_bias": layer.experts.fc_bias, "proj_weight": layer.experts.proj_weight,
              "proj_bias": layer.experts.proj_bias, "x": x}
    leaves = {n: t.detach().clone().requires_grad_() for n, t in leaves.items()}
    W, fw, fb, pw, pb = (leaves[n] for n in ("router", "fc_weight", "fc_bias", "proj_weight",
                                             "proj_bias"))
    tokens = leaves["x"].reshape(-1, C)
    rows, chosen = [], set()
    for n in range(tokens.size(0)):
        probs = F.softmax(tokens[n] @ W.t(), -1)
        score = (probs + layer.choice_bias).tolist()
        top = sorted(range(E), key=lambda e: -score[e])[:K]
        chosen.update(top)
        w = [probs[e] for e in top]
        if renormalize:
            w = [v / sum(w) for v in w]
        rows.append(sum(v * (F.gelu(tokens[n] @ fw[e] + fb[e]) @ pw[e] + pb[e])
                        for v, e in zip(w, top)))
    assert chosen == set(range(E)) - {EMPTY}, chosen  # one expert empty, the others not
    return torch.stack(rows).view(x.shape), leaves


def use_path(path, monkeypatch, w):
    """Force the per-expert loop, or check the grouped product runs here. Returns the
    count of torch._grouped_mm calls made from then on."""
    if path == "loop":
        monkeypatch.setattr(experts_module, "grouped_runs", lambda x, w: False)
    elif not experts_module.grouped_runs(torch.zeros(1, w.size(1)), w):
        pytest.skip("torch._grouped_mm does not run on this build's CPU in fp32")
    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "raw"])
@pytest.mark.parametrize("path", ["grouped", "loop"])
def test_moe_block_equals_a_loop_over_tokens_and_their_experts(path, renormalize, monkeypatch):
    """Output and the gradients of the router, every expert parameter and the input equal
    the by-hand loop (fp32, `close`), with an expert that gets no token, under two
    gradients that are not contiguous: y.sum()'s (an expanded one) and a permuted one."""
    torch.manual_seed(0)
    layer = MoE(block_config(moe_renormalize=renormalize))
    for p in layer.parameters():
        p.data.normal_(0, 0.5)
    layer.choice_bias = BIASES.clone()
    calls = use_path(path, monkeypatch, layer.experts.fc_weight)
    x = torch.randn(2, 8, C, requires_grad=True)
    ref, leaves = by_hand(layer, x, renormalize)
    y = layer(x)
    assert len(calls) == (2 if path == "grouped" else 0)
    close(y, ref)
    ours = {"router": layer.router.weight, "fc_weight": layer.experts.fc_weight,
            "fc_bias": layer.experts.fc_bias, "proj_weight": layer.experts.proj_weight,
            "proj_bias": layer.experts.proj_bias, "x": x}
    permuted = torch.randn(C, 8, 2).permute(2, 1, 0)  # (2, 8, C), not contiguous
    for how in ("sum", "permuted"):
        for t in list(ours.values()) + list(leaves.values()):
            t.grad = None
        if how == "sum":
            layer(x).sum().backward()
            ref.sum().backward(retain_graph=True)
        else:
            layer(x).backward(permuted)
            ref.backward(permuted, retain_graph=True)
        for name, t in ours.items():
            close(t.grad, leaves[name].grad, msg=lambda m: f"{how} {name}: {m}")
        assert not layer.experts.fc_weight.grad[EMPTY].any()  # the empty expert learns nothing


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("path", ["grouped", "loop"])
def test_experts_take_an_expanded_gradient(path, bias, monkeypatch):
    """The experts' output under y.sum(): its gradient has zero strides, which
    _grouped_mm's backward refuses unless made contiguous; gradients as by hand."""
    torch.manual_seed(1)
    experts = Experts(E, C, HIDDEN, bias)
    for p in experts.parameters():
        p.data.normal_()
    use_path(path, monkeypatch, experts.fc_weight)
    counts = torch.tensor([5, 0, 3, 4])
    x = torch.randn(12, C, requires_grad=True)
    experts(x, counts).sum().backward()
    params = [experts.fc_weight, experts.proj_weight] + (
        [experts.fc_bias, experts.proj_bias] if bias else [])
    refs = [p.detach().clone().requires_grad_() for p in params]
    xr = x.detach().clone().requires_grad_()
    which = torch.repeat_interleave(torch.arange(E), counts).tolist()
    total = 0
    for t, e in enumerate(which):
        h = xr[t] @ refs[0][e] + (refs[2][e] if bias else 0)
        total = total + (F.gelu(h) @ refs[1][e] + (refs[3][e] if bias else 0)).sum()
    total.backward()
    for got, want in zip([x] + params, [xr] + refs):
        close(got.grad, want.grad)


# ---------------------------------------------------------------- through the Strategy

def strategy_of(config, **trainer):
    from dp_worker import OneRank
    from parallel.config import ParallelConfig
    from parallel.parallelize import parallelize
    from training.config import TrainerConfig
    strategy = parallelize(GPT(config, seed=3), OneRank(), ParallelConfig(dp="single"))
    t = TrainerConfig(lr=1e-3, **trainer)
    strategy.configure_compute(t)
    strategy.configure_optimizer(t)
    return strategy


def batch(seed, rows=6):
    x = torch.randint(20, (rows, 9), generator=torch.Generator().manual_seed(seed))
    return x[:, :-1], x[:, 1:]


def test_choice_biases_move_after_a_healthy_step_and_stay_after_a_skipped_one():
    """DeepSeek-V3's biases through Strategy.optimizer_step: after a step with finite
    gradients each block's bias moves by rate x sign(mean count - count) (an over-loaded
    expert's down, an under-loaded one's up); after a step whose gradients hold a NaN
    (skipped), the biases are bitwise those before it."""
    rate = 0.125
    strategy = strategy_of(block_config(n_layer=2, moe_top_k=1, moe_bias_rate=rate))
    layers = strategy.expert_layers()
    for step, poison in ((0, False), (1, True), (2, False)):
        x, y = batch(step)
        strategy.forward_backward([(x, y)])
        counts = torch.stack([layer.stats["counts"] for _, layer in layers]).double()
        move = rate * torch.sign(counts.mean(1, keepdim=True) - counts).float()
        assert (move > 0).any() and (move < 0).any(), counts  # some over-, some under-loaded
        if poison:
            strategy.grads()[0].view(-1)[0] = float("nan")
        before = torch.stack([layer.choice_bias.clone() for _, layer in layers])
        strategy.clip_grad_norm_(1.0)
        strategy.optimizer_step(1e-3)
        after = torch.stack([layer.choice_bias.clone() for _, layer in layers])
        if poison:
            assert torch.equal(after, before), (step, after - before)
        else:
            assert torch.equal(after - before, move), (step, counts, after - before)


def test_fp16_loss_scale_reaches_the_block_losses_under_accumulation():
    """fp16 with a loss scale of 2^10 and 3 micro-batches: after unscaling, the router's
    gradient (main loss + balance and z-losses) is that of the same step at loss scale 1
    (a power of two: the scaled backward differs only where fp16 rounds small values).
    The block losses' backward must carry the scale as the main loss's does."""
    grads = {}
    config = block_config(n_layer=2, moe_aux_loss_coef=0.5, moe_z_loss_coef=0.25)
    x, y = batch(7, rows=6)
    for scale in (1024.0, 1.0):
        strategy = strategy_of(config, precision="fp16", fp16_init_scale=scale)
        assert strategy.precision.loss_scale == scale
        strategy.forward_backward(list(zip(x.chunk(3), y.chunk(3))))
        strategy.precision.unscale_and_check(strategy.grads())
        assert not strategy.precision.skip_step
        grads[scale] = torch.cat([layer.router.weight.grad.flatten()
                                  for _, layer in strategy.expert_layers()])
    close(grads[1024.0], grads[1.0])


# ---------------------------------------------------------------- under trainer.compile

def test_a_compiled_moe_block_compiles_no_more_after_its_first_micro_batches():
    """Under trainer.compile, what changes with every micro-batch stays out of the graphs:
    the per-expert loop's counts (fp32 experts take it; Experts.before_compile) and the
    layer's per-step statistics (MoELayer.before_compile). Traced, either is a new graph
    each micro-batch, and past dynamo's limit of 8 a failed run (grad_accum=10 did). 12
    micro-batches of one step, routed differently: no compilation after the first two."""
    import torch._dynamo as dynamo
    from parallel.compile import compile_model
    dynamo.reset()
    torch.manual_seed(0)
    model = GPT(block_config(n_layer=2, moe_experts=4, moe_top_k=2))
    events = compile_model(model, "eager")
    events.listen()
    try:
        seen = []
        for seed in range(12):  # the statistics are popped once a step: never here
            x = torch.randint(0, 20, (4, 8), generator=torch.Generator().manual_seed(seed))
            model(x, x)[1].backward()
            seen.append(events.counts())
        print(seen[1], seen[-1])
        assert seen[1]["compile_frames"] >= 1 and seen[-1] == seen[1], (seen[1], seen[-1])
    finally:
        dynamo.reset()
