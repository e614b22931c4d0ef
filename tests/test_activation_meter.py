"""telemetry/activation_meter.py counts what autograd saves for backward, and frees it after."""

import torch

from telemetry.activation_meter import ActivationMeter
from model import GPT, GPTConfig


def peak_for(batch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=20, block_size=16))
    x = torch.randint(0, 20, (batch, 16))
    meter = ActivationMeter()
    with meter:
        _, loss = model(x, x)
        held = meter.current
        loss.backward()
    del loss
    return meter, held


def test_peak_scales_with_the_batch_and_is_released_by_backward():
    one, held_one = peak_for(4)
    two, held_two = peak_for(8)
    assert one.peak_bytes == held_one > 0
    assert 1.9 < two.peak_bytes / one.peak_bytes <= 2.0  # activations, not parameters
    assert one.current < one.peak_bytes / 20  # only the live input ids remain
