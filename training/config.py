"""TrainerConfig: a leaf, importing nothing, so config.py and the planner read it without
the loop."""

from dataclasses import dataclass, field
from typing import List


@dataclass
class TrainerConfig:
    """The `trainer:` section of gpt2_train_cfg.yaml."""
    max_steps: int = 300        # optimizer steps to train (raise it to continue a finished run)
    batch_size: int = 32        # GLOBAL sequences per optimizer step, fixed whatever the layout
    grad_accum: int = 1         # micro-steps per optimizer step on each data-parallel rank
    lr: float = 2e-3            # peak learning rate (AdamW)
    min_lr: float = 2e-4        # the cosine decay ends here, at max_steps
    warmup_steps: int = 20      # linear warm-up steps
    weight_decay: float = 0.1   # AdamW weight decay, on matrices only (not biases or norms)
    beta1: float = 0.9          # AdamW beta1
    beta2: float = 0.95         # AdamW beta2
    grad_clip: float = 1.0      # max global gradient norm; 0 = no clipping
    optimizer: str = "adamw"    # adamw | muon (Muon on the blocks' matrices, AdamW on the rest:
                                # docs/optimizers.md)
    muon_lr: float = 0.02       # Muon's peak learning rate; it follows lr's warm-up and decay
    muon_momentum: float = 0.95  # Muon's momentum (an average: buf = m buf + (1 - m) grad)
    muon_nesterov: bool = True  # Muon orthogonalizes grad + m (buf - grad) instead of buf
    muon_ns_steps: int = 5      # Newton-Schulz iterations per matrix and step
    muon_ns_coefficients: List[float] = field(  # the quintic Newton-Schulz iteration's
        default_factory=lambda: [3.4445, -4.775, 2.0315])  # (a, b, c), Keller Jordan's
    muon_weight_decay: float = 0.1  # Muon's decoupled weight decay (times its learning rate)
    muon_adjust_lr: str = "original"  # original (x sqrt(max(1, rows / cols))) | match_rms_adamw
                                # (x 0.2 sqrt(max(rows, cols)): AdamW's update RMS, Moonshot's)
    muon_ns_dtype: str = "bf16"  # bf16 (PyTorch's Muon) | fp32 (layouts equal one process to
                                 # fp32 tolerance; on a CPU much faster than bf16)
    eval_every: int = 50        # val loss every N optimizer steps and at the end; 0 = never
    eval_batches: int = 4       # global batches of val data per evaluation
    log_every: int = 10         # a metrics.jsonl record and a console line every N steps
    save_every: int = 50        # snapshot every N steps (and always at the end); 0 = only at the end
    seed: int = 1337            # initial weights, data order, dropout
    run_dir: str = "runs/default"  # metrics.jsonl, config.yaml, wandb files, the snapshot by default
    snapshot_path: str = ""     # snapshot directory, any fsspec URL ("" = <run_dir>/snapshot);
                                # resumed from when present
    keep_snapshots: int = 1     # the newest K snapshots survive each write
    resume_step: int = -1       # -1 = resume from the newest snapshot; S = go back to kept step S
    device: str = "auto"        # auto (cuda if available) | cpu | cuda; a rank's GPU is its LOCAL_RANK
    measure_activations: bool = False  # log activation_peak_mb, the bytes autograd saves for
                                       # backward (a hook per saved tensor)
    precision: str = "fp32"     # fp32 | bf16 | fp16 (autocast; weights, gradients, AdamW state
                                # stay fp32; fp16 adds a dynamic loss scaler) | auto (bf16 on a
                                # GPU that has it, else fp32; mode=plan, dryrun: plan.gpu's)
    fp16_init_scale: float = 65536.0  # fp16: the loss scaler's first scale (halved on overflow)
    fp16_growth_interval: int = 2000  # fp16: steps without overflow before the scale doubles
    max_skipped_steps: int = 5  # fp32/bf16: non-finite gradients skip the step on every
                                # rank; this many in a row stop the run
    activation_checkpointing: bool = False  # recompute blocks in backward: less memory, more compute
    activation_checkpointing_mode: str = "full"  # full | selective (matmul outputs kept, the rest recomputed)
    activation_checkpointing_every: int = 1  # recompute blocks 0, n, 2n, ... (1: all)
    snapshot_async: bool = False  # write snapshots in the background from a host copy
                                  # (false: every rank waits)
    compile: bool = False       # torch.compile each transformer block after parallelizing (parallel/compile.py)
    compile_backend: str = "inductor"  # inductor | aot_eager (no code generation: the tests) | eager
    compile_scope: str = "block"  # block | model (the whole GPT in one graph: one process, no checkpointing)
    deterministic: bool = False  # deterministic kernels (torch.use_deterministic_algorithms): bitwise-repeatable GPU runs, slower
    profile_from: int = 0       # first optimizer step torch.profiler records (0 = off); traces in <run_dir>/profile/
    profile_steps: int = 2      # how many steps from profile_from it records: one Chrome trace per rank
    memory_snapshot: bool = False  # CUDA only: a torch.cuda.memory snapshot per rank of the profiled steps
