"""Model FLOPs utilisation: the share of the devices' peak the training step achieves.

    flops per token = 6 N + 12 L C T    (PaLM, appendix B; nanoGPT's estimate_mfu)

N is the parameter count a token is multiplied by without the position embedding
(the token embedding counts: it is also the LM head's matmul), 6N the forward (2N)
and backward (4N) matmul FLOPs per token, 12 L C T the attention scores and weighted
sums (L layers, width C, context T). MFU = that x tokens/s / (peak x devices).
A mixture-of-experts block (model.moe_experts = E > 0) counts its active parameters:
the router (C x E) and k = model.moe_top_k of its E experts (each 2 C H weights, plus
H + C biases), not the E experts its memory holds (`active_params`).
Recomputation (activation checkpointing) is not counted: it is model FLOPs,
not hardware FLOPs, so checkpointing shows as a lower MFU.

Peaks are dense (no sparsity) tensor-core figures from the vendors' data
sheets, by precision: bf16 and fp16 use the 16-bit tensor peak, fp32 the
plain fp32 peak (torch does not use TF32 for matmuls by default). A device
not in the table, and every CPU, gets no MFU at all -- never a made-up one.
"""

import re

# (model name in torch.cuda.get_device_name(), {precision: peak FLOP/s}). A name matches
# as whole words ("A100" in "NVIDIA A100-SXM4-80GB", not in "RTX A1000"); the first match
# wins, so more specific names come first; {} = a variant whose peak we do not list
PEAKS = [
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    ("H100 NVL", {}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),      # SXM
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "fp32": 75e12}),    # HGX B200 (GB200's differ)
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    ("A10G", {}),  # AWS's A10 variant: no published tensor peak we trust -> no MFU
    ("A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
    ("L40", {}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}),
    ("RTX 4090", {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12}),
    ("RTX 3090 Ti", {}),
    ("RTX 3090", {"bf16": 71e12, "fp16": 71e12, "fp32": 35.6e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),                      # no bf16 tensor cores
    ("T4", {"fp16": 65e12, "fp32": 8.1e12}),
]


def flops_per_token(gpt_config: dict) -> float:
    """Training FLOPs per token of a GPT of this shape (a gpt_config dict)."""
    C, L, T = (gpt_config[k] for k in ("n_embd", "n_layer", "block_size"))
    return 6 * active_params(gpt_config) + 12 * L * C * T


def active_params(gpt_config: dict) -> int:
    """Parameters one token's forward multiplies by (wpe left out): every dense block's, and
    in a mixture-of-experts block (block i when moe_experts > 0 and (i+1) % moe_every == 0,
    model.ModelConfig.has_experts) its attention, LayerNorms, router and k of its experts."""
    C, L, V = (gpt_config[k] for k in ("n_embd", "n_layer", "vocab_size"))
    bias = gpt_config.get("bias", True)
    E, k = gpt_config.get("moe_experts", 0), gpt_config.get("moe_top_k", 2)
    H = gpt_config.get("moe_hidden", 0) or 4 * C
    moe_blocks = L // gpt_config.get("moe_every", 1) if E else 0
    shared = 4 * C * C + (8 * C if bias else 2 * C)   # attention's 2 matrices, 2 LayerNorms (+ biases)
    mlp = 8 * C * C + (5 * C if bias else 0)           # the dense MLP's 2 matrices (+ biases)
    expert = 2 * C * H + (H + C if bias else 0)        # one expert's
    blocks = L * shared + (L - moe_blocks) * mlp + moe_blocks * (C * E + k * expert)
    return V * C + blocks + (2 * C if bias else C)     # + final LayerNorm


def peak_flops(device_name: str, precision: str):
    """Peak FLOP/s of one device of this name in this precision, or None if unknown."""
    for name, peaks in PEAKS:
        if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w])", device_name):
            return peaks.get(precision)
    return None


def device_peak(device, precision: str):
    """Peak FLOP/s of a torch.device, or None (every CPU; unknown GPUs)."""
    if device.type != "cuda":
        return None
    import torch
    return peak_flops(torch.cuda.get_device_name(device), precision)


def mfu(flops_token: float, tokens_per_s: float, peak: float, devices: int):
    return flops_token * tokens_per_s / (peak * devices)
