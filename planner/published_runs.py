"""Published training runs the step-time model is checked against (tests/test_published_runs.py,
docs/planner.md's table): each row is a run's shape, cluster and layout as this
product's config keys, and the figure its source publishes, with where it says so.

Every row is replayed by tests/test_published_runs.py and must be within 25%, except a
row whose `checked` says why not (shown in docs/planner.md all the same).

`published` is what the source gives: seconds per iteration ("s/iter"), TFLOP/s per GPU
("TFLOP/s/GPU") or model FLOPs utilisation ("MFU"); `published_seconds` turns the last
two into seconds per iteration with the source's own FLOP count, so every row compares
seconds. Where a figure is derived (a run's total time over its steps), `note` says how.

Layouts are the sources' own (tensor and pipeline degrees, micro-batch size, virtual
stages, recomputation) where they give them; `_megatron` says what Table 1 leaves out. Mapped onto this product's keys: Megatron's selective
recomputation is `activation_checkpointing=false` (it recomputes only the attention
scores, which the fused attention the model assumes never stores), its full
recomputation `activation_checkpointing=true`; a micro-batch of b sequences is
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
NANOGPT = "karpathy/nanoGPT README (reproducing GPT-2) and config/train_gpt2.py"

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
    {"name": "nanoGPT GPT-2 124M", "source": NANOGPT, "gpu": "A100-40GB", "gpus": 8,
     "gpus_per_node": 8, "precision": "bf16",
     "model": {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab": 50304, "block": 1024,
               "bias": False},
     "batch": 480, "layout": {"parallel.dp": "ddp_bucket", "trainer.grad_accum": 5,
                              "trainer.activation_checkpointing": False},
     "recompute": "none", "flash": True, "published": (4 * 86400 / 600000, "s/iter"),
     "checked": "no: a round figure for a whole run (evaluations and checkpoints included) that "
                "its own config comment puts at ~5 days, 25% more; nanoGPT's eager/early "
                "torch.compile kernels reach about half llm.c's speed on the same model, which "
                "one set of constants for fused kernels cannot be, and is not, fitted to",
     "note": "derived: \"about 4 days\" (README) / max_iters 600,000; 12 x 1024 tokens x 5 "
             "accumulation x 8 GPUs (config comment, which says ~5 days); torch.compile, DDP"},
]


def megatron_flops(row, recompute):
    """The source's FLOPs per iteration (Narayanan et al. Eq. 3; Korthikanti et al. Sec. 6):
    72 B s l h^2 (1 + s/6h + V/16lh), x 4/3 with full recomputation (96 instead of 72)."""
    m, B = row["model"], row["batch"]
    s, h, l, V = m["block"], m["n_embd"], m["n_layer"], m["vocab"]
    return (96 if recompute else 72) * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


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
