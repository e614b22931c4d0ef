"""Model FLOPs utilisation: the share of the devices' peak the training step achieves.

    flops per token = 6 N + 12 L C T    (PaLM, appendix B; nanoGPT's estimate_mfu)

N is the parameter count without the position embedding (the token embedding
counts: it is also the LM head's matmul), 6N the forward (2N) and backward
(4N) matmul FLOPs per token, 12 L C T the attention scores and weighted sums
(L layers, width C, context T). MFU = that x tokens/s / (peak x devices).
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
    C, L, T, V = (gpt_config[k] for k in ("n_embd", "n_layer", "block_size", "vocab_size"))
    bias = gpt_config.get("bias", True)
    per_block = 12 * C * C + (13 * C if bias else 2 * C)  # 4 matrices, 2 LayerNorms (+ biases)
    n = V * C + L * per_block + (2 * C if bias else C)     # + final LayerNorm; wpe left out
    return 6 * n + 12 * L * C * T


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
