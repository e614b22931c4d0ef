"""Published training runs the step-time model is checked against (tests/test_published_runs.py,
docs/published-runs.md's table): each row is a run's shape, cluster and layout as this
product's config keys, and the figure its source publishes, with where it says so.

Every row is replayed by tests/test_published_runs.py and must be within 25%, except a
row whose `checked` says why not (shown in docs/published-runs.md all the same).

`published` is what the source gives: seconds per iteration ("s/iter"), TFLOP/s per GPU
("TFLOP/s/GPU") or model FLOPs utilisation ("MFU"); `published_seconds` turns the last
two into seconds per iteration with the source's own FLOP count, so every row compares
seconds. Where a figure is derived (a run's total time over its steps), `note` says how.

Layouts are the sources' own (tensor and pipeline degrees, micro-batch size, virtual
stages, recomputation) where they give them; `_megatron` and `_mcore` say what their
tables leave out. A layout may set `plan.*` keys for what the source's system does and
this product does not (Megatron-Core's overlaps: `_mcore`). Mapped onto this product's
keys: Megatron's selective recomputation is `activation_checkpointing=false` (it
recomputes only the attention scores, which the fused attention the model assumes
never stores), its full recomputation `activation_checkpointing=true`; a micro-batch of b sequences is
`parallel.microbatches` = the pipeline's micro-batches (or `trainer.grad_accum` without
a pipeline); the pipeline schedule, where a source does not name it, is 1F1B
(Megatron's default without virtual stages).

May import: nothing of the project (config overrides only; planner.report replays them).
"""

NARAYANAN = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU "
             "Clusters Using Megatron-LM (SC21), Table 1")
KORTHIKANTI = ("Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer "
               "Models (MLSys 2023), Table 5 (shapes: Table 3)")
LLMC_124M = "karpathy/llm.c scripts/run_gpt2_124M.sh (header comment)"
LLMC_1558M = ("karpathy/llm.c discussion #677 (GPT-2 1558M on 8 x H100 in 24 hours) and "
              "scripts/run_gpt2_1558M.sh (-x 32000 steps)")
MCORE = ("NVIDIA/Megatron-LM README, Training Speed and Scalability (images/model_table.png, "
         "Megatron-Core r0.8.0 weak scaling on H100)")
LLMC_124M_H100 = ("KellerJordan/modded-nanogpt records/track_1_short/2024-10-13_llmc/README.md "
                  "(llm.c as of 2024-10-13 on 8 x H100, run as llm.c discussion #481 says)")
NANOGPT = ("karpathy/nanoGPT issue #110 (Expected iteration speed for the small 125M model) and "
           "README (reproducing GPT-2)")
PYTORCH_BLOG = ("PyTorch blog, Accelerating Large Language Models with Accelerated Transformers "
                "(2023-04-18; pytorch/pytorch.github.io _posts/2023-04-18-accelerating-large-"
                "language-models.md), nanoGPT commits b3c17c6c and 77e7e04c")


# nanoGPT is PyTorch (torch.compile, SDPA's flash kernel), and its kernels are slower than
# the fused ones of llm.c and Megatron that the efficiency model's constants describe. The
# one published measure of how much, on this model: Karpathy on llm.c ("Day 24", April
# 2024), "We're running ~7% faster than PyTorch nightly ... Compared to the current
# PyTorch stable release 2.3.0, llm.c is actually ~46% faster" (GPT-2 124M, both with
# mixed precision, torch.compile, flash attention and the padded vocabulary). nanoGPT's
# runs of 2023 used a PyTorch 2.0 nightly, older than either: the stable release's figure.
PYTORCH_KERNELS = 1.46


def _nanogpt_blog(vocab, seconds, what):
    """The blog's nanoGPT GPT-2 124M per-batch time on its 8 x A100 SXM4 80GB server:
    train.py's defaults at both commits (12 x 1024 tokens a GPU, no accumulation, bf16,
    torch.compile, dropout 0, no biases), SDPA's flash kernel."""
    return {"name": f"nanoGPT GPT-2 124M, {what}", "source": PYTORCH_BLOG, "gpu": "A100-80GB",
            "gpus": 8, "gpus_per_node": 8, "precision": "bf16",
            "model": {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab": vocab, "block": 1024,
                      "bias": False},
            "batch": 96, "layout": {"parallel.dp": "ddp_bucket", "trainer.grad_accum": 1,
                                    "trainer.activation_checkpointing": False,
                                    "plan.kernel_slowdown": PYTORCH_KERNELS},
            "recompute": "none", "flash": True, "published": (seconds, "s/iter"),
            "note": "\"flash_attention kernel: ~113ms\", \"flash_attention + padded vocab: "
                    "~87ms\" per batch; \"All code was run on an 8 x NVIDIA Corporation A100 "
                    "server with 80 GB HBM [A100 SXM4 80GB]\" (DDP over the 8 assumed: the "
                    "blog does not say; one GPU predicts the same, DDP's all-reduce hidden "
                    "behind the backward)"}

MEGATRON_SHAPE = {"vocab": 51200, "block": 2048}


def _megatron(params, heads, hidden, layers, tp, pp, gpus, batch, tflops):
    """A row of Narayanan et al.'s Table 1: 16-bit mixed precision on DGX A100 80GB (8 per
    node), full activation recomputation. The table gives no micro-batch size or schedule:
    micro-batch 1 and 1F1B assumed."""
    dp = gpus // (tp * pp)
    per_pipeline = batch // dp
    layout = {"parallel.tp": tp, "parallel.pp": pp, "parallel.dp": "ddp_bucket",
              "trainer.activation_checkpointing": True}
    layout.update({"parallel.microbatches": per_pipeline, "parallel.pp_schedule": "1f1b",
                   "trainer.grad_accum": 1} if pp > 1 else {"trainer.grad_accum": per_pipeline})
    return {"name": f"Megatron-LM {params}", "source": NARAYANAN, "gpu": "A100-80GB",
            "gpus": gpus, "gpus_per_node": 8, "precision": "bf16",
            "model": {"n_layer": layers, "n_head": heads, "n_embd": hidden, **MEGATRON_SHAPE,
                      "bias": True},
            "batch": batch, "layout": layout, "recompute": "full",
            "published": (tflops, "TFLOP/s/GPU"),
            "flash": False,
            "note": "16-bit mixed precision (A100: the same peak for fp16 and bf16)"}


def _korthikanti(size, heads, hidden, layers, tp, pp, batch, micro, V, seconds, selective):
    gpus = tp * pp
    layout = {"parallel.tp": tp, "parallel.pp": pp, "parallel.dp": "single",
              "parallel.sequence_parallel": selective,
              "trainer.activation_checkpointing": not selective}
    if pp > 1:
        layout.update({"parallel.microbatches": batch // micro, "trainer.grad_accum": 1,
                       "parallel.pp_schedule": "interleaved" if V > 1 else "1f1b"})
        if V > 1:
            layout["parallel.pp_virtual_stages"] = V
    else:
        layout["trainer.grad_accum"] = batch // micro
    return {"name": f"Megatron-LM {size} " + ("SP + selective" if selective else "full recompute"),
            "source": KORTHIKANTI, "gpu": "A100-80GB", "gpus": gpus, "gpus_per_node": 8,
            "precision": "bf16",
            "model": {"n_layer": layers, "n_head": heads, "n_embd": hidden, **MEGATRON_SHAPE,
                      "bias": True},
            "batch": batch, "layout": layout,
            "recompute": "selective (attention scores)" if selective else "full", "flash": False,
            "published": (seconds, "s/iter"),
            "note": f"micro-batch {micro}" + (f", {V} virtual stages (interleaved)" if V > 1 else "")
            + ("; sequence parallelism" if selective else "")}


def _mcore(params, layers, heads, hidden, tp, pp, gpus, batch, tflops):
    """A row of Megatron-Core's H100 weak-scaling table (r0.8.0): bf16 (41% MFU = 408.8 of
    989 TFLOP/s), vocabulary 131,072, 4,096 tokens, data parallel 48, the distributed
    optimizer (ZeRO-1), and what the README says it overlaps: `--tp-comm-overlap`
    (plan.tp_comm_overlap), `--overlap-grad-reduce` (as ours: behind the last backward)
    and `--overlap-param-gather` (plan.param_gather_overlap), the gather of its bf16
    parameter copy (plan.param_gather_bytes=2; Megatron reduces the gradients in fp32,
    as we do). The table gives no micro-batch size, schedule or recomputation:
    micro-batch 1 (the batch per pipeline is 4 x pp micro-batches in every row), 1F1B
    and none assumed."""
    per_pipeline = batch // 48
    layout = {"parallel.tp": tp, "parallel.pp": pp, "parallel.dp": "fsdp", "parallel.zero_stage": 1,
              "parallel.sequence_parallel": tp > 1, "trainer.activation_checkpointing": False,
              "plan.tp_comm_overlap": True, "plan.param_gather_overlap": True,
              "plan.param_gather_bytes": 2}
    layout.update({"parallel.microbatches": per_pipeline, "parallel.pp_schedule": "1f1b",
                   "trainer.grad_accum": 1} if pp > 1 else {"trainer.grad_accum": per_pipeline})
    return {"name": f"Megatron-Core {params}", "source": MCORE, "gpu": "H100-80GB", "gpus": gpus,
            "gpus_per_node": 8, "precision": "bf16",
            "model": {"n_layer": layers, "n_head": heads, "n_embd": hidden, "vocab": 131072,
                      "block": 4096, "bias": True},
            "batch": batch, "layout": layout, "recompute": "none", "flash": True,
            "published": (tflops, "TFLOP/s/GPU"), "flops": "megatron-core",
            "note": "micro-batch 1, 1F1B, no recomputation assumed; sequence parallelism with "
                    "TP (required by --tp-comm-overlap); Transformer Engine's fused attention"}


RUNS = [
    _megatron("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    _megatron("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    _megatron("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _megatron("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _megatron("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _megatron("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _megatron("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _megatron("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _megatron("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    _mcore("1.7B", 24, 16, 2048, 1, 1, 48, 192, 408.8),
    _mcore("7.1B", 30, 32, 4096, 2, 1, 96, 192, 465.9),
    _mcore("16B", 32, 48, 6144, 4, 1, 192, 192, 489.1),
    _mcore("32B", 48, 56, 7168, 8, 1, 384, 192, 459.6),
    _mcore("70B", 84, 64, 8192, 8, 2, 768, 384, 419.7),
    _mcore("119B", 92, 80, 10240, 8, 4, 1536, 768, 420.5),
    _mcore("177B", 96, 96, 12288, 8, 6, 2304, 1152, 432.8),
    _mcore("314B", 96, 128, 16384, 8, 8, 3072, 1536, 474.4),
    _mcore("462B", 112, 144, 18432, 8, 16, 6144, 3072, 459.9),
    _korthikanti("22B", 64, 6144, 48, 8, 1, 4, 4, 1, 1.42, False),
    _korthikanti("22B", 64, 6144, 48, 8, 1, 4, 4, 1, 1.10, True),
    _korthikanti("175B", 96, 12288, 96, 8, 8, 64, 1, 3, 18.13, False),
    _korthikanti("175B", 96, 12288, 96, 8, 8, 64, 1, 3, 13.75, True),
    _korthikanti("530B", 128, 20480, 105, 8, 35, 280, 1, 3, 49.05, False),
    _korthikanti("530B", 128, 20480, 105, 8, 35, 280, 1, 3, 37.83, True),
    _korthikanti("1T", 160, 25600, 128, 8, 64, 512, 1, 1, 94.42, False),
    _korthikanti("1T", 160, 25600, 128, 8, 64, 512, 1, 1, 71.49, True),
    {"name": "llm.c GPT-2 124M", "source": LLMC_124M, "gpu": "A100-80GB", "gpus": 8,
     "gpus_per_node": 8, "precision": "bf16",
     "model": {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab": 50304, "block": 1024,
               "bias": True},
     "batch": 512, "layout": {"parallel.dp": "fsdp", "parallel.zero_stage": 1,
                              "trainer.grad_accum": 1, "trainer.activation_checkpointing": False},
     "recompute": "none", "flash": True, "published": (0.300, "s/iter"),
     "note": "-b 64 x 8 GPUs = 524,288 tokens a step, ZeRO-1 (-z 1), no recomputation (-r 0): "
             "\"steps in ~300ms/iter\""},
    {"name": "llm.c GPT-2 1558M", "source": LLMC_1558M, "gpu": "H100-80GB", "gpus": 8,
     "gpus_per_node": 8, "precision": "bf16",
     "model": {"n_layer": 48, "n_head": 25, "n_embd": 1600, "vocab": 50304, "block": 1024,
               "bias": True},
     "batch": 1024, "layout": {"parallel.dp": "fsdp", "parallel.zero_stage": 1,
                               "trainer.grad_accum": 8, "trainer.activation_checkpointing": False},
     "recompute": "none", "flash": True, "published": (24 * 3600 / 32000, "s/iter"),
     "note": "derived: 24 hours / 32,000 steps; -b 16 x 8 GPUs x 8 accumulation = 1,048,576 "
             "tokens (-d), ZeRO-1, -r 0"},
    {"name": "llm.c GPT-2 124M (H100)", "source": LLMC_124M_H100, "gpu": "H100-80GB", "gpus": 8,
     "gpus_per_node": 8, "precision": "bf16",
     "model": {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab": 50304, "block": 1024,
               "bias": True},
     "batch": 512, "layout": {"parallel.dp": "fsdp", "parallel.zero_stage": 1,
                              "trainer.grad_accum": 1, "trainer.activation_checkpointing": False},
     "recompute": "none", "flash": True, "published": (0.140, "s/iter"),
     "note": "\"The mean per-step time was 140ms\"; 10.26B tokens at 524,288 a step (-b 64 x 8 "
             "GPUs, ZeRO-1 -z 1, as discussion #481 runs it); GELU recomputation (-r), if "
             "on, is one element-wise kernel more, not modelled"},
    {"name": "nanoGPT GPT-2 124M", "source": NANOGPT, "gpu": "A100-40GB", "gpus": 8,
     "gpus_per_node": 8, "precision": "bf16",
     "model": {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab": 50257, "block": 1024,
               "bias": False},
     "batch": 480, "layout": {"parallel.dp": "ddp_bucket", "trainer.grad_accum": 5,
                              "trainer.activation_checkpointing": False,
                              "plan.kernel_slowdown": PYTORCH_KERNELS},
     "recompute": "none", "flash": True, "published": (0.562, "s/iter"),
     "note": "nanoGPT issue #110 (8 x A100, train.py of 2023-02-02): \"iter 1631 ... time "
             "561.94ms\" to 567.31; 12 x 1024 tokens x 5 accumulation steps per GPU x 8 GPUs; "
             "GPT-2's vocabulary unpadded (model.py's vocab_size = 50257 until 2023-02-04); "
             "bf16, torch.compile, flash attention (SDPA), DDP; the README's \"about 4 days\" for "
             "600,000 iterations (0.576 s) agrees; 40 GB A100s assumed (the README's)"},
    _nanogpt_blog(50257, 0.113, "unpadded vocabulary"),
    _nanogpt_blog(50304, 0.087, "padded vocabulary"),
]


def megatron_flops(row, recompute):
    """The source's FLOPs per iteration (Narayanan et al. Eq. 3; Korthikanti et al. Sec. 6):
    72 B s l h^2 (1 + s/6h + V/16lh), x 4/3 with full recomputation (96 instead of 72);
    Megatron-Core's (megatron/training/training.py, num_floating_point_operations, which
    counts the LM head forward and backward): 72 B s l h^2 (1 + s/6h + V/12lh)."""
    m, B = row["model"], row["batch"]
    s, h, l, V = m["block"], m["n_embd"], m["n_layer"], m["vocab"]
    logits = 12 if row.get("flops") == "megatron-core" else 16
    return (96 if recompute else 72) * B * s * l * h * h * (1 + s / (6 * h) + V / (logits * l * h))


def published_seconds(row) -> float:
    value, unit = row["published"]
    if unit == "s/iter":
        return value
    if unit == "TFLOP/s/GPU":  # achieved FLOPs counting the recomputation (hardware FLOPs)
        return megatron_flops(row, row["recompute"] == "full") / (value * 1e12 * row["gpus"])
    raise ValueError(unit)


def overrides(row) -> list:
    """The command-line overrides that replay `row` with `mode=plan plan.search=false`."""
    m = row["model"]
    keys = {"mode": "plan", "plan.search": False, "plan.flash_attention": row["flash"], "plan.gpu": row["gpu"],
            "plan.gpus_per_node": row["gpus_per_node"],
            "plan.nodes": max(1, row["gpus"] // row["gpus_per_node"]),
            "model.n_layer": m["n_layer"], "model.n_head": m["n_head"], "model.n_embd": m["n_embd"],
            "model.bias": m["bias"], "plan.vocab_size": m["vocab"], "data.block_size": m["block"],
            "data.tokenizer": "gpt2", "trainer.batch_size": row["batch"],
            "trainer.precision": row["precision"], "parallel.tp": 1, "parallel.pp": 1,
            "parallel.sequence_parallel": False, **row["layout"]}
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in keys.items()]
