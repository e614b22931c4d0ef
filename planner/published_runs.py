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
            "recompute": "none", "flash": True, "kernels": "compiled", "published": (seconds, "s/iter"),
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
            "flash": False, "kernels": "fused",
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
            "kernels": "fused",
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
            "batch": batch, "layout": layout, "recompute": "none", "flash": True, "kernels": "fused",
            "published": (tflops, "TFLOP/s/GPU"), "flops": "megatron-core",
            "note": "micro-batch 1, 1F1B, no recomputation assumed; sequence parallelism with "
                    "TP (required by --tp-comm-overlap); Transformer Engine's fused attention"}


# ------------------------------------------------------------------ other stacks (issue 53)

LLM_FOUNDRY = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md (MPT training benchmarks "
               "on the MosaicML platform; tables as of commit 5e85bd62d, 2024-01-06, rows measured "
               "2023-06 to 2024-01), model shapes: scripts/train/yamls/pretrain/mpt-*.yaml")
MPT_SHAPES = {"125m": (12, 12, 768), "350m": (24, 16, 1024), "760m": (24, 12, 1536),
              "1b": (24, 16, 2048), "3b": (32, 20, 2560), "7b": (32, 32, 4096),
              "13b": (40, 40, 5120), "30b": (48, 56, 7168), "70b": (80, 64, 8192)}


def _mpt(size, seq, gpus, gpu, micro, accum, batch, tokens_per_s, shard, ckpt, mp):
    """A row of llm-foundry's MPT throughput tables: Composer on PyTorch FSDP (FULL_SHARD =
    ZeRO-3, SHARD_GRAD_OP = ZeRO-2), amp bf16, FlashAttention (attn_impl: flash), flash-
    attn's fused CrossEntropyLoss (MPT's default loss_fn, llmfoundry/models/mpt), no
    tensor or pipeline parallelism; the MPT benchmark shape is GPT-2's (learned positions,
    biases, tied embedding, 4 x MLP with GELU; NumParams agrees to 0.01%) with vocabulary
    50,368. `mp`: FSDP mixed precision, PURE (bf16 parameters gathered and bf16 gradients
    reduced) or DEFAULT (Composer's: bf16 parameters, fp32 reduction). The A100 clusters:
    "1600 Gbps node-node interconnect (RoCE)", 8 x 200 Gb/s a node; the H100 one's network
    is not stated (8 x 400 Gb/s assumed, the H100 preset)."""
    layers, heads, width = MPT_SHAPES[size]
    layout = {"parallel.dp": "fsdp", "parallel.zero_stage": {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}[shard],
              "trainer.grad_accum": accum, "trainer.activation_checkpointing": ckpt,
              "plan.param_gather_bytes": 2, "plan.grad_reduce_bytes": 2 if mp == "PURE" else 4,
              "plan.loss_kernel": "fused"}
    return {"name": f"llm-foundry MPT-{size} {seq} ({gpus} x {gpu.split('-')[0]}"
                    + (" 40GB" if gpu == "A100-40GB" else "") + ")",
            "source": LLM_FOUNDRY, "stack": "llm-foundry", "gpu": gpu, "gpus": gpus,
            "gpus_per_node": 8, "precision": "bf16",
            "model": {"n_layer": layers, "n_head": heads, "n_embd": width, "vocab": 50368,
                      "block": seq, "bias": True},
            "batch": batch, "layout": layout, "recompute": "full" if ckpt else "none", "flash": True,
            "kernels": "eager",
            "published": (tokens_per_s, "tokens/s"), "ran": True,
            "note": f"micro-batch {micro} x {accum} accumulation x {gpus} GPUs = {batch} sequences; "
                    f"{shard}, mixed precision {mp}, activation checkpointing {ckpt}",
            "cannot": "PyTorch eager (no torch.compile); FSDP's limit_all_gathers and prefetch "
                      "(gathers assumed hidden behind compute); low-precision LayerNorm; the torch "
                      "and flash-attn versions of each run are not stated"}


BLOOM = ("bigscience-workshop/bigscience train/tr11-176B-ml/README.md (\"Important checkpoints\": "
         "iteration 85376, 2022-06) and tr11-176B-ml.slurm: Megatron-DeepSpeed with DeepSpeed's "
         "BF16_Optimizer, PyTorch 1.11, 48 nodes of 8 A100 80GB, 4 x 100 Gb/s Omni-Path a node")
MTNLG = ("Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B "
         "(arXiv 2201.11990; NVIDIA/Microsoft blog 2021-10-11, quoted in r/mlscaling q5wsww): "
         "\"batch size 1920 on 280, 350, and 420 DGX A100 servers ... iteration time of 60.1, "
         "50.2, and 44.4 seconds\"; 8-way tensor and 35-way pipeline parallelism (cli99/"
         "llm-analysis examples/megatron-turing-nlg)")


def _mtnlg(nodes, seconds):
    """MT-NLG 530B (105 x 20480, 128 heads, 2048 tokens) on Selene's DGX A100 80GB nodes
    (8 x 200 Gb/s HDR each), DeepSpeed's pipeline engine and ZeRO-1 with Megatron's tensor
    parallelism, batch 1920. Not in the excerpt read: micro-batch, schedule, recomputation
    and vocabulary: micro-batch 1, 1F1B, full recomputation and GPT-2's BPE padded to 51,200
    assumed (Narayanan et al.'s, the same kernels and tokenizer)."""
    gpus = nodes * 8
    dp = gpus // 280
    return {"name": f"MT-NLG 530B ({nodes} nodes)", "source": MTNLG, "stack": "DeepSpeed",
            "gpu": "A100-80GB", "gpus": gpus, "gpus_per_node": 8, "precision": "bf16",
            "model": {"n_layer": 105, "n_head": 128, "n_embd": 20480, "vocab": 51200,
                      "block": 2048, "bias": True},
            "batch": 1920, "layout": {"parallel.tp": 8, "parallel.pp": 35, "parallel.dp": "fsdp",
                                      "parallel.zero_stage": 1, "parallel.microbatches": 1920 // dp,
                                      "parallel.pp_schedule": "1f1b", "trainer.grad_accum": 1,
                                      "trainer.activation_checkpointing": True,
                                      "plan.param_gather_bytes": 2},
            "recompute": "full", "flash": False, "kernels": "fused", "published": (seconds, "s/iter"),
            "ran": True,
            "note": f"{gpus} GPUs: tp 8 x pp 35 x dp {dp}; micro-batch 1 assumed",
            "cannot": "micro-batch, schedule and recomputation not in the excerpt read (assumed); "
                      "DeepSpeed's pipeline engine's own schedule"}


TORCHTITAN = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (2024-12: torch "
              "1963fc8 2024-12-23, torchtitan 9dec370 2024-12-26; train_configs/llama3_8b.toml and "
              "torchtitan/parallelisms/parallelize_llama.py of that date)")


def _torchtitan(gpus, tps, memory_gib, compiled):
    """torchtitan's Llama 3.1 8B, FSDP (FSDP2: bf16 parameters gathered, fp32 gradient
    reduction), the loss F.cross_entropy on fp32 logits outside the compiled blocks
    (torch.compile compiles each block), local batch 2 of 8,192 tokens, selective activation checkpointing
    ('op': every other matmul's output recomputed), on Grand Teton hosts of 8 H100 96GB
    HBM2e (2.4 TB/s) at a 500 W power limit, 400 Gb/s RDMA a GPU. Llama 3.1 8B: 32 x 4096,
    32 heads, 8 K/V heads, SwiGLU 14,336, vocabulary 128,256, untied head, RMSNorm, RoPE."""
    return {"name": f"torchtitan Llama 3.1 8B FSDP{' + compile' if compiled else ''} ({gpus} x H100)",
            "source": TORCHTITAN, "stack": "torchtitan", "gpu": "H100-80GB", "gpus": gpus,
            "gpus_per_node": 8, "precision": "bf16",
            "model": {"n_layer": 32, "n_head": 32, "n_embd": 4096, "vocab": 128256, "block": 8192,
                      "bias": False},
            "arch": {"plan.kv_heads": 8, "plan.ffn_hidden": 14336, "plan.gated_ffn": True,
                     "plan.untied_head": True},
            "batch": 2 * gpus,
            "layout": {"parallel.dp": "fsdp", "parallel.zero_stage": 3, "trainer.grad_accum": 1,
                       "trainer.activation_checkpointing": True,
                       "trainer.activation_checkpointing_every": 2,
                       "plan.gpu_memory_gb": 96, "plan.hbm_gbps": 2400,
                       "plan.param_gather_bytes": 2, "plan.loss_kernel": "eager"},
            "recompute": "op-level selective (as full on every 2nd block)", "flash": True,
            "kernels": "compiled" if compiled else "eager",
            "published": (tps, "tokens/s/GPU"), "ran": True, "memory_gb": memory_gib * 2**30 / 1e9,
            "note": f"Table {1 if gpus == 8 else 3}: {tps:,} TPS/GPU, {memory_gib} GiB; local batch "
                    f"2, global {2 * gpus}; " + ("torch.compile" if compiled else "eager"),
            "cannot": "op-level selective checkpointing (every other matmul recomputed) replayed as "
                      "every 2nd block fully recomputed (the same share of the forward's matmuls "
                      "again, plus their attention); the 500 W power limit (its peak is \"between "
                      "SXM and NVL\", unknown: the SXM peak assumed); RoPE and RMSNorm priced as "
                      "GPT-2's learned positions (33.5M parameters more) and LayerNorm"}


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
     "recompute": "none", "flash": True, "kernels": "fused", "published": (0.300, "s/iter"),
     "note": "-b 64 x 8 GPUs = 524,288 tokens a step, ZeRO-1 (-z 1), no recomputation (-r 0): "
             "\"steps in ~300ms/iter\""},
    {"name": "llm.c GPT-2 1558M", "source": LLMC_1558M, "gpu": "H100-80GB", "gpus": 8,
     "gpus_per_node": 8, "precision": "bf16",
     "model": {"n_layer": 48, "n_head": 25, "n_embd": 1600, "vocab": 50304, "block": 1024,
               "bias": True},
     "batch": 1024, "layout": {"parallel.dp": "fsdp", "parallel.zero_stage": 1,
                               "trainer.grad_accum": 8, "trainer.activation_checkpointing": False},
     "recompute": "none", "flash": True, "kernels": "fused",
     "published": (24 * 3600 / 32000, "s/iter"),
     "note": "derived: 24 hours / 32,000 steps; -b 16 x 8 GPUs x 8 accumulation = 1,048,576 "
             "tokens (-d), ZeRO-1, -r 0"},
    {"name": "llm.c GPT-2 124M (H100)", "source": LLMC_124M_H100, "gpu": "H100-80GB", "gpus": 8,
     "gpus_per_node": 8, "precision": "bf16",
     "model": {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab": 50304, "block": 1024,
               "bias": True},
     "batch": 512, "layout": {"parallel.dp": "fsdp", "parallel.zero_stage": 1,
                              "trainer.grad_accum": 1, "trainer.activation_checkpointing": False},
     "recompute": "none", "flash": True, "kernels": "fused", "published": (0.140, "s/iter"),
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
     "recompute": "none", "flash": True, "kernels": "compiled", "published": (0.562, "s/iter"),
     "note": "nanoGPT issue #110 (8 x A100, train.py of 2023-02-02): \"iter 1631 ... time "
             "561.94ms\" to 567.31; 12 x 1024 tokens x 5 accumulation steps per GPU x 8 GPUs; "
             "GPT-2's vocabulary unpadded (model.py's vocab_size = 50257 until 2023-02-04); "
             "bf16, torch.compile, flash attention (SDPA), DDP; the README's \"about 4 days\" for "
             "600,000 iterations (0.576 s) agrees; 40 GB A100s assumed (the README's)"},
    _nanogpt_blog(50257, 0.113, "unpadded vocabulary"),
    _nanogpt_blog(50304, 0.087, "padded vocabulary"),
    # llm-foundry (Composer + PyTorch FSDP), MPT: A100 80GB, one node
    _mpt("125m", 2048, 8, "A100-80GB", 32, 2, 512, 1133901, "FULL_SHARD", False, "DEFAULT"),
    _mpt("1b", 2048, 8, "A100-80GB", 14, 4, 448, 164109, "FULL_SHARD", False, "DEFAULT"),
    _mpt("7b", 2048, 8, "A100-80GB", 6, 2, 96, 37130, "FULL_SHARD", False, "DEFAULT"),
    _mpt("13b", 2048, 8, "A100-80GB", 2, 3, 48, 18097, "FULL_SHARD", False, "DEFAULT"),
    _mpt("30b", 2048, 8, "A100-80GB", 3, 21, 504, 7330, "FULL_SHARD", True, "DEFAULT"),
    _mpt("7b", 65536, 8, "A100-80GB", 1, 2, 16, 8108, "FULL_SHARD", True, "DEFAULT"),
    _mpt("70b", 2048, 64, "A100-80GB", 8, 4, 2048, 26274, "FULL_SHARD", True, "PURE"),
    # A100 40GB
    _mpt("125m", 2048, 128, "A100-40GB", 26, 1, 3328, 15863837, "FULL_SHARD", False, "PURE"),
    _mpt("1b", 2048, 8, "A100-40GB", 8, 8, 512, 154171, "FULL_SHARD", False, "PURE"),
    _mpt("3b", 2048, 64, "A100-40GB", 6, 1, 384, 623167, "FULL_SHARD", False, "PURE"),
    _mpt("7b", 2048, 128, "A100-40GB", 18, 1, 2304, 463749, "FULL_SHARD", True, "PURE"),
    _mpt("13b", 2048, 16, "A100-40GB", 10, 1, 160, 31900, "FULL_SHARD", True, "PURE"),
    # H100 80GB
    _mpt("760m", 2048, 8, "H100-80GB", 24, 2, 384, 505177, "FULL_SHARD", False, "DEFAULT"),
    _mpt("1b", 2048, 8, "H100-80GB", 14, 1, 112, 363645, "FULL_SHARD", False, "DEFAULT"),
    _mpt("7b", 2048, 8, "H100-80GB", 6, 1, 48, 85144, "FULL_SHARD", False, "DEFAULT"),
    _mpt("7b", 65536, 8, "H100-80GB", 1, 2, 16, 15654, "FULL_SHARD", True, "DEFAULT"),
    _mpt("13b", 2048, 128, "H100-80GB", 16, 1, 2048, 650264, "FULL_SHARD", True, "DEFAULT"),
    _mpt("3b", 2048, 512, "H100-80GB", 8, 1, 4096, 11092218, "SHARD_GRAD_OP", False, "DEFAULT"),
    _mpt("70b", 2048, 512, "H100-80GB", 8, 1, 4096, 515636, "FULL_SHARD", True, "DEFAULT"),
    # DeepSpeed (Megatron-DeepSpeed): BLOOM, MT-NLG
    {"name": "BLOOM 176B", "source": BLOOM, "stack": "DeepSpeed", "gpu": "A100-80GB", "gpus": 384,
     "gpus_per_node": 8, "precision": "bf16", "network": (4, 12.5),
     "model": {"n_layer": 70, "n_head": 112, "n_embd": 14336, "vocab": 250880, "block": 2048,
               "bias": True},
     "batch": 2048, "layout": {"parallel.tp": 4, "parallel.pp": 12, "parallel.dp": "fsdp",
                               "parallel.zero_stage": 1, "parallel.microbatches": 128,
                               "parallel.pp_schedule": "1f1b", "trainer.grad_accum": 1,
                               "trainer.activation_checkpointing": True,
                               "plan.param_gather_bytes": 2},
     "recompute": "full", "flash": False, "kernels": "fused", "published": (104.70, "s/iter"),
     "ran": True,
     "memory_gb": 60,
     "note": "\"elapsed time per iteration (s): 104.70 ... TFLOPs: 149.77\" at GBS 2048; TP 4, "
             "PP 12, DP 8, micro-batch 2 (128 a pipeline), --checkpoint-activations, bf16, "
             "vocabulary padded to 250,880; \"one copy of the model takes 48 GPUs (using 60 GB "
             "of memory on each GPU)\" (bigscience.notion.site BigScience-176B-Model)",
     "cannot": "ALiBi and the embedding LayerNorm; the embedding counted as a pipeline layer "
               "('type:transformer|embedding': 5 blocks on the first and last stage); "
               "CUDA_LAUNCH_BLOCKING=1; dropout 0.1; DeepSpeed's 1F1B engine"},
    _mtnlg(280, 60.1),
    _mtnlg(350, 50.2),
    _mtnlg(420, 44.4),
    # torchtitan (PyTorch FSDP2, eager and torch.compile), Llama 3.1 8B
    _torchtitan(8, 5762, 82.4, False),
    _torchtitan(8, 6667, 77.0, True),
    _torchtitan(128, 5605, 67.0, False),
    _torchtitan(128, 6514, 62.0, True),
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
    if unit == "tokens/s":  # the whole cluster's tokens a second
        return row["batch"] * row["model"]["block"] / value
    if unit == "tokens/s/GPU":
        return row["batch"] * row["model"]["block"] / (value * row["gpus"])
    if unit == "TFLOP/s/GPU":  # achieved FLOPs counting the recomputation (hardware FLOPs)
        return megatron_flops(row, row["recompute"] == "full") / (value * 1e12 * row["gpus"])
    raise ValueError(unit)


def network_keys(row) -> dict:
    """A row's network where it is not the preset's: (network cards a node, GB/s each)."""
    if "network" not in row:
        return {}
    nics, gbps = row["network"]
    return {"plan.nics_per_node": nics, "plan.inter_node_gbps": gbps}


def overrides(row) -> list:
    """The command-line overrides that replay `row` with `mode=plan plan.search=false`."""
    m = row["model"]
    keys = {"mode": "plan", "plan.search": False, "plan.flash_attention": row["flash"],
            "plan.stack": row["kernels"], "plan.gpu": row["gpu"],
            "plan.gpus_per_node": row["gpus_per_node"],
            "plan.nodes": max(1, row["gpus"] // row["gpus_per_node"]),
            "model.n_layer": m["n_layer"], "model.n_head": m["n_head"], "model.n_embd": m["n_embd"],
            "model.bias": m["bias"], "plan.vocab_size": m["vocab"], "data.block_size": m["block"],
            "data.tokenizer": "gpt2", "trainer.batch_size": row["batch"],
            "trainer.precision": row["precision"], "parallel.tp": 1, "parallel.pp": 1,
            "parallel.sequence_parallel": False, **network_keys(row), **row.get("arch", {}),
            **row["layout"]}
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in keys.items()]
