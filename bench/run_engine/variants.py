"""What the benchmark runs: layouts ("variants"), presets of them, and model sizes.

A variant is a name, a process count, threads per process and the overrides
that pick its strategy. Variants of strategies that are not merged yet stay
listed: bench.run skips them with a note when the config rejects their keys, so
the same command picks them up the day they land.

`ranks=0` means "the --nproc of this invocation" (2 by default), and `{nproc}`
in an override is replaced by it (a TP degree spanning every rank). The single
process gets as many threads as the others have ranks (2 ranks x 1 thread
against one process x 2 threads: the same cores).
"""

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Variant:
    name: str                # what --variants and the report call it
    overrides: tuple         # key=value for main.py
    ranks: int = 0           # processes; 0 = --nproc
    threads: int = 1         # OMP threads per process; 0 = --nproc (the single process)
    reference: str = ""      # the PyTorch implementation its time is compared with
    zero_stage: int = 0      # textbook figures: 0 = replicated (DDP), 1/2/3 = ZeRO stage
    tensor_parallel: bool = False  # textbook figures: pure TP over all ranks (activation traffic)
    note: str = ""
    unavailable: str = ""    # why it cannot run here at all: skipped with this reason, never launched


VARIANTS = [
    Variant("single", ("parallel.dp=single",), ranks=1, threads=0,
            note="one process, as many threads as the others have ranks"),
    Variant("single_1t", ("parallel.dp=single",), ranks=1, threads=1,
            note="one process, one thread"),
    Variant("torch_ddp", ("parallel.dp=torch_ddp",), note="PyTorch DDP (reference)"),
    Variant("ddp_naive", ("parallel.dp=ddp_naive",), reference="torch_ddp",
            note="one all-reduce per parameter"),
    Variant("ddp_bucket", ("parallel.dp=ddp_bucket", "parallel.allreduce=native"),
            reference="torch_ddp", note="buckets, torch's all-reduce"),
    Variant("ddp_bucket_ring", ("parallel.dp=ddp_bucket", "parallel.allreduce=ring"),
            reference="torch_ddp", note="buckets, our ring all-reduce"),
    Variant("torch_fsdp", ("parallel.dp=torch_fsdp",), zero_stage=3,
            note="PyTorch FSDP2 fully_shard (reference)"),
    Variant("fsdp1", ("parallel.dp=fsdp", "parallel.zero_stage=1"), reference="torch_fsdp",
            zero_stage=1, note="ZeRO-1: optimizer state sharded"),
    Variant("fsdp2", ("parallel.dp=fsdp", "parallel.zero_stage=2"), reference="torch_fsdp",
            zero_stage=2, note="ZeRO-2: + gradients"),
    Variant("fsdp3", ("parallel.dp=fsdp", "parallel.zero_stage=3"), reference="torch_fsdp",
            zero_stage=3, note="ZeRO-3: + parameters"),
    Variant("fsdp3_noprefetch", ("parallel.dp=fsdp", "parallel.zero_stage=3",
                                 "parallel.prefetch=false"), reference="torch_fsdp",
            zero_stage=3, note="ZeRO-3 without prefetching the next unit"),
    Variant("torch_tp", ("parallel.tp_impl=torch", "parallel.dp=single", "parallel.tp={nproc}"),
            tensor_parallel=True,
            note="PyTorch DTensor TP: parallelize_module, colwise/rowwise, loss_parallel (reference)"),
    Variant("tp", ("parallel.dp=single", "parallel.tp={nproc}"), reference="torch_tp",
            tensor_parallel=True, note="own TP: Megatron f/g, vocabulary-parallel embedding and loss"),
    Variant("tp_sp", ("parallel.dp=single", "parallel.tp={nproc}", "parallel.sequence_parallel=true"),
            reference="torch_tp", tensor_parallel=True,
            note="own TP + sequence parallelism (all-gather / reduce-scatter)"),
]


def pipeline_variants():
    """Own and torch.distributed.pipelining schedules on the same split (pp = --nproc, M = 4),
    and own GPipe / 1F1B at M = 2, 4, 8 for activation memory."""
    out = []
    for schedule, extra in (("gpipe", ()), ("1f1b", ()),
                            ("interleaved", ("parallel.pp_virtual_stages=2",)),
                            ("zb1p", ()), ("zbv", ())):
        common = ("parallel.pp={nproc}", f"parallel.pp_schedule={schedule}",
                  "parallel.microbatches=4") + extra
        out.append(Variant(f"torch_pp_{schedule}", ("parallel.pp_impl=torch", "parallel.dp=single") + common,
                           note=f"torch.distributed.pipelining {schedule} (reference)"))
        out.append(Variant(f"pp_{schedule}", ("parallel.dp=single",) + common,
                           reference=f"torch_pp_{schedule}", note=f"own {schedule}"))
    for schedule in ("gpipe", "1f1b"):
        for m in (2, 4, 8):
            out.append(Variant(f"pp_{schedule}_m{m}", (
                "parallel.dp=single", "parallel.pp={nproc}", f"parallel.pp_schedule={schedule}",
                f"parallel.microbatches={m}"), note=f"own {schedule}, {m} micro-batches"))
    return out


VARIANTS += pipeline_variants()


def precision_variants():
    """trainer.precision, parallel.reduce_dtype and trainer.activation_checkpointing, each
    against the same layout without it (its `reference`); run with
    `--set trainer.measure_activations=true` for the activation memory table."""
    bf16, ckpt = "trainer.precision=bf16", "trainer.activation_checkpointing=true"
    ddp = ("parallel.dp=ddp_bucket", "parallel.allreduce=native")
    fsdp3 = ("parallel.dp=fsdp", "parallel.zero_stage=3")
    pp = ("parallel.dp=single", "parallel.pp={nproc}", "parallel.pp_schedule=1f1b",
          "parallel.microbatches=4")
    return [
        Variant("single_bf16", ("parallel.dp=single", bf16), ranks=1, threads=0, reference="single",
                note="one process, bf16 autocast"),
        Variant("single_ckpt", ("parallel.dp=single", ckpt), ranks=1, threads=0, reference="single",
                note="one process, every block recomputed in backward"),
        Variant("single_sac", ("parallel.dp=single", ckpt, "trainer.activation_checkpointing_mode=selective"),
                ranks=1, threads=0, reference="single",
                note="one process, selective: matmul outputs kept, the rest recomputed"),
        Variant("ddp_bucket_bf16", ddp + (bf16,), reference="ddp_bucket",
                note="bf16 autocast, fp32 gradient all-reduce"),
        Variant("ddp_bucket_reduce_bf16", ddp + ("parallel.reduce_dtype=bf16",),
                reference="ddp_bucket", note="fp32 compute, bf16 gradient all-reduce"),
        Variant("ddp_bucket_bf16_reduce_bf16", ddp + (bf16, "parallel.reduce_dtype=bf16"),
                reference="ddp_bucket", note="bf16 autocast and bf16 gradient all-reduce"),
        Variant("ddp_bucket_fp16", ddp + ("trainer.precision=fp16",), reference="ddp_bucket",
                note="fp16 autocast with the dynamic loss scaler"),
        Variant("fsdp3_ckpt", fsdp3 + (ckpt,), reference="fsdp3", zero_stage=3,
                note="ZeRO-3, every block recomputed in backward"),
        Variant("pp_1f1b_ckpt", pp + (ckpt,), reference="pp_1f1b",
                note="own 1F1B (M=4), every block recomputed in backward"),
    ]


VARIANTS += precision_variants()

# Found by running it (torch 2.13, CPU, gloo), so the cp preset's report says why the
# PyTorch comparison is missing instead of silently leaving it out.
TORCH_CP_ON_CPU = (
    "torch.distributed.tensor.experimental.context_parallel does not run on CPU: its ring "
    "exists only for the CUDA SDPA kernels (flash, efficient, cudnn), and CPU's SDPA "
    "dispatches to aten._scaled_dot_product_flash_attention_for_cpu, which fails with "
    "'NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default "
    "does not have a sharding strategy registered.' (the math backend instead fails with "
    "'aten.add.Tensor got mixed torch.Tensor and DTensor'). The reference cp2 is measured "
    "against instead is cp2_allgather (parallel.cp_impl=allgather): every rank all-gathers "
    "the keys and values, Llama 3's way")


def context_variants():
    """Own context parallelism (parallel.cp=2, the ring) against the all-gather reference
    (`cp2_allgather`, its reference: PyTorch's context_parallel cannot run here, see
    `torch_cp`'s `unavailable`), and beside them `ddp_bucket`, the same ranks splitting the
    batch instead. Run with `--model long --set trainer.measure_activations=true`."""
    cp2 = ("parallel.dp=ddp_bucket", "parallel.allreduce=native", "parallel.cp=2")
    return [
        Variant("cp2_allgather", cp2 + ("parallel.cp_impl=allgather",),
                note="the reference: all-gather keys and values (Llama 3)"),
        Variant("cp2", cp2, reference="cp2_allgather",
                note="own context parallelism: zigzag split, ring attention; gradients over dp x cp"),
        Variant("torch_cp", (), unavailable=TORCH_CP_ON_CPU,
                note="PyTorch context_parallel (reference)"),
    ]


VARIANTS += context_variants()



def compile_variants():
    """trainer.compile=true (inductor, per block) against the same layout eager, its
    `reference`; and for single the whole GPT in one graph (nanoGPT's torch.compile(model)),
    the bound per-block compilation is measured against (`--preset compile_scope`)."""
    by_name = {v.name: v for v in VARIANTS}
    out = []
    for base in ("single", "ddp_bucket", "fsdp3", "tp", "pp_1f1b"):
        v = by_name[base]
        out.append(Variant(f"{base}_compiled", v.overrides + ("trainer.compile=true",), v.ranks,
                           v.threads, reference=base, zero_stage=v.zero_stage,
                           tensor_parallel=v.tensor_parallel,
                           note=f"{base}, every block torch.compile'd (inductor)"))
    out.append(Variant("single_compiled_model", ("parallel.dp=single", "trainer.compile=true",
                                                 "trainer.compile_scope=model"),
                       ranks=1, threads=0, reference="single",
                       note="one process, the whole GPT compiled in one graph (nanoGPT's way)"))
    # one thread: on a busy machine two OpenMP threads stall each other (bench/README.md),
    # in eager kernels and inductor's alike; one thread keeps the comparison readable
    for scope, what in (("block", "every block torch.compile'd"), ("model", "the whole GPT in one graph")):
        out.append(Variant(f"single_1t_compiled{'_model' if scope == 'model' else ''}",
                           ("parallel.dp=single", "trainer.compile=true",
                            f"trainer.compile_scope={scope}"),
                           ranks=1, threads=1, reference="single_1t",
                           note=f"one process, one thread, {what}"))
    return out


VARIANTS += compile_variants()



def hybrid_variants():
    """Hybrid sharding and offload on 4 ranks, each against PyTorch's FSDP2 doing the same:
    own ZeRO-3 in 2 replica groups of 2 (`parallel.dp_replicate=2`) against FSDP2 on a 2-D
    replicate x shard mesh, and own ZeRO-3 with its shard's state in host memory
    (`parallel.offload=true`) against FSDP2 with CPUOffloadPolicy."""
    fsdp3, hsdp, off = ("parallel.dp=fsdp", "parallel.zero_stage=3"), ("parallel.dp_replicate=2",), \
        ("parallel.offload=true",)
    return [
        Variant("torch_hsdp", ("parallel.dp=torch_fsdp",) + hsdp, ranks=4, zero_stage=3,
                note="PyTorch FSDP2, 2-D mesh: 2 replica groups x 2 shards (reference)"),
        Variant("hsdp3", fsdp3 + hsdp, ranks=4, reference="torch_hsdp", zero_stage=3,
                note="own ZeRO-3 in 2 replica groups of 2: gradient shards all-reduced across"),
        Variant("torch_fsdp_offload", ("parallel.dp=torch_fsdp",) + off, ranks=4, zero_stage=3,
                note="PyTorch FSDP2 with CPUOffloadPolicy (reference)"),
        Variant("fsdp3_offload", fsdp3 + off, ranks=4, reference="torch_fsdp_offload",
                zero_stage=3, note="own ZeRO-3, shard, gradient and AdamW state on the host"),
    ]


VARIANTS += hybrid_variants()


def expert_variants():
    """Expert parallelism over every rank (parallel.ep = --nproc, carved out of dp) on a
    mixture-of-experts model (`--model moe`), its tokens sent to their experts' ranks by
    all-to-all (`ep`), against the all-gather reference (`ep_allgather`: every rank gathers
    every token, computes its experts, reduce-scatters the outputs) and the same model with
    every expert on every rank (`ep1`)."""
    ep = ("parallel.dp=ddp_bucket", "parallel.allreduce=native", "parallel.ep={nproc}")
    return [
        Variant("ep1", ("parallel.dp=ddp_bucket", "parallel.allreduce=native", "parallel.ep=1"),
                note="every expert on every rank; expert gradients all-reduced"),
        Variant("ep_allgather", ep + ("parallel.ep_impl=allgather",),
                note="the reference: all-gather every token, reduce-scatter the outputs"),
        Variant("ep", ep + ("parallel.ep_impl=alltoall",), reference="ep_allgather",
                note="own expert parallelism: tokens all-to-all to their experts"),
    ]


EXPERT_VARIANTS = expert_variants()
VARIANTS += EXPERT_VARIANTS


def muon_variants():
    """Muon (trainer.optimizer=muon, Newton-Schulz in PyTorch's bf16) beside AdamW's run of
    the same layout: what orthogonalizing every hidden matrix adds to a step. Layouts that
    shard matrices (fsdp, tp) refuse Muon for now: their variants say so."""
    muon = "trainer.optimizer=muon"
    out = [Variant("single_muon", ("parallel.dp=single", muon), ranks=1, threads=0,
                   reference="single", note="one process, Muon on the blocks' matrices")]
    for base in ("ddp_bucket", "fsdp1", "fsdp3", "tp"):
        v = BY_NAME[base]
        out.append(replace(v, name=f"{base}_muon", overrides=v.overrides + (muon,),
                           reference=base, note=f"{base} with Muon"))
    return out

BY_NAME = {v.name: v for v in VARIANTS}
MUON_VARIANTS = muon_variants()
VARIANTS += MUON_VARIANTS
BY_NAME.update((v.name, v) for v in MUON_VARIANTS)

# each preset starts with `single`: every ratio "vs single" needs it in the same round
PRESETS = {
    "ddp": ["single", "torch_ddp", "ddp_naive", "ddp_bucket", "ddp_bucket_ring"],
    "fsdp": ["single", "torch_ddp", "torch_fsdp", "fsdp1", "fsdp2", "fsdp3", "fsdp3_noprefetch"],
    "tp": ["single", "torch_tp", "tp", "tp_sp"],
    "pp": ["single", "torch_pp_gpipe", "pp_gpipe", "torch_pp_1f1b", "pp_1f1b",
           "torch_pp_interleaved", "pp_interleaved", "torch_pp_zb1p", "pp_zb1p",
           "torch_pp_zbv", "pp_zbv"],
    # the zero-bubble schedules against own 1F1B / interleaved and PyTorch's zero bubble
    "pp_zb": ["single", "pp_1f1b", "pp_interleaved", "torch_pp_zb1p", "pp_zb1p",
              "torch_pp_zbv", "pp_zbv"],
    # with --set trainer.measure_activations=true: what each schedule holds on stage 0
    "pp_zb_memory": ["single", "pp_gpipe", "pp_1f1b", "pp_interleaved", "pp_zb1p", "pp_zbv"],
    "pp_memory": ["single", "pp_gpipe_m2", "pp_gpipe_m4", "pp_gpipe_m8",
                  "pp_1f1b_m2", "pp_1f1b_m4", "pp_1f1b_m8"],
    # single_1t too: at 2048 tokens single's two threads stall each other under load
    "cp": ["single", "single_1t", "ddp_bucket", "cp2_allgather", "cp2", "torch_cp"],
    "precision": ["single", "single_bf16", "single_ckpt", "ddp_bucket", "ddp_bucket_bf16",
                  "ddp_bucket_reduce_bf16", "ddp_bucket_bf16_reduce_bf16", "ddp_bucket_fp16",
                  "fsdp3", "fsdp3_ckpt", "pp_1f1b", "pp_1f1b_ckpt"],
    # none / full / selective recompute (with --set trainer.measure_activations=true)
    "recompute": ["single", "single_ckpt", "single_sac"],
    # each compiled layout beside itself eager (run with the default model)
    "compile": ["single", "single_compiled", "single_1t", "single_1t_compiled", "ddp_bucket",
                "ddp_bucket_compiled", "fsdp3", "fsdp3_compiled", "tp", "tp_compiled", "pp_1f1b",
                "pp_1f1b_compiled"],
    # per-block against whole-model compilation (run with --model baby, nanoGPT's config)
    "compile_scope": ["single", "single_compiled", "single_compiled_model", "single_1t",
                      "single_1t_compiled", "single_1t_compiled_model"],
    # hybrid sharding and offload against FSDP2's, on 4 ranks (run with --nproc 4)
    "hsdp": ["single", "torch_hsdp", "hsdp3", "torch_fsdp_offload", "fsdp3_offload"],
    # expert parallelism against experts on every rank and the all-gather (run with --model moe)
    "ep": ["single", "ep1", "ep_allgather", "ep"],
    # Muon's extra step time over AdamW, layout by layout (docs/optimizers.md)
    "muon": ["single", "single_muon", "ddp_bucket", "ddp_bucket_muon", "fsdp1", "fsdp1_muon",
             "fsdp3", "fsdp3_muon", "tp", "tp_muon"],
    # (compiled variants only on request: each job pays inductor's start-up, tens of seconds;
    # the expert variants need a mixture-of-experts model: --preset ep --model moe)
    "all": [v.name for v in VARIANTS if v.name != "single_1t" and "compiled" not in v.name
            and v not in EXPERT_VARIANTS and v not in MUON_VARIANTS],
}

# the same model, data and GLOBAL batch for every variant
MODELS = {
    # the default benchmark model: ~3.2M parameters, 4 layers x 256, 128 tokens, global batch 16
    "default": ["model.n_layer=4", "model.n_head=4", "model.n_embd=256",
                "data.block_size=128", "trainer.batch_size=16"],
    # many small parameters: per-parameter collectives (ddp_naive) pay their latency 12x
    "thin12": ["model.n_layer=12", "model.n_head=4", "model.n_embd=64",
               "data.block_size=128", "trainer.batch_size=16"],
    # long sequences, where context parallelism matters: attention is most of the work
    # (2 layers x 128 wide, 2048 tokens, global batch 2); about half a second a step here
    "long": ["model.n_layer=2", "model.n_head=4", "model.n_embd=128",
             "data.block_size=2048", "trainer.batch_size=2"],
    # nanoGPT's "baby GPT" (config/train_shakespeare_char.py with its CPU settings): 4 layers,
    # 4 heads, 128 wide, 64 tokens, batch 12, no biases; nanoGPT compiles it by default
    "baby": ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.bias=false",
             "data.block_size=64", "trainer.batch_size=12"],
    # wide blocks, where matmuls dominate: does inductor gain anything on this CPU? (2 layers x
    # 512, 256 tokens, batch 8: ~6.3M parameters in the blocks)
    "wide": ["model.n_layer=2", "model.n_head=8", "model.n_embd=512", "data.block_size=256",
             "trainer.batch_size=8"],
    # mixture of experts (bench --preset ep): the default's shape but 4 layers x 128 wide, every
    # block's MLP 8 experts (each the dense MLP's size), each token to its top 2; ~4.5M parameters
    "moe": ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "data.block_size=128",
            "trainer.batch_size=16", "model.moe_experts=8", "model.moe_top_k=2"],
    # for tests and smoke runs: seconds per job
    "tiny": ["model.n_layer=2", "model.n_head=2", "model.n_embd=32",
             "data.block_size=16", "trainer.batch_size=4"],
}


def pick(names: str, preset: str):
    """Variants from a comma list (wins) or a preset; unknown names are an error."""
    chosen = [n.strip() for n in names.split(",") if n.strip()] if names else PRESETS[preset]
    unknown = [n for n in chosen if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in dict.fromkeys(chosen)]  # keep order, drop repeats
