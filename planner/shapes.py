"""The layout and the workload every prediction is about, and the sizes all counts use.

A `Layout` is one way to run, as the config keys a run takes; a `Workload` is what the
layout does not change (the model, the global batch, precision). `micro_rows` (the
sequences of one micro-batch) and `act_bytes` (one element of an activation) are the
units in which memory.py, traffic.py and step_time.py count, with `F32` for everything
kept in fp32 (master weights, gradients, AdamW state, the residual stream).

May import: nothing of the project; every other planner module imports this one.
"""

from dataclasses import dataclass

F32 = 4


@dataclass(frozen=True)
class Layout:
    """One way to run: the config keys a run takes (`keys()`)."""
    dp_kind: str = "single"   # parallel.dp: single | ddp_bucket | fsdp
    zero_stage: int = 0       # 1-3 for fsdp
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    sp: bool = False          # parallel.sequence_parallel
    schedule: str = "1f1b"    # parallel.pp_schedule (pp > 1)
    V: int = 1                # parallel.pp_virtual_stages (interleaved), zbv: 2
    M: int = 1                # parallel.microbatches
    grad_accum: int = 1       # trainer.grad_accum
    ckpt: bool = False        # trainer.activation_checkpointing
    R: int = 1                # parallel.dp_replicate: replica groups of dp / R ranks (HSDP)
    offload: bool = False     # parallel.offload
    ep: int = 1               # parallel.ep: experts split over ep of a replica group's dp x cp ranks
    ckpt_mode: str = "full"   # trainer.activation_checkpointing_mode: full | selective
    ckpt_every: int = 1       # trainer.activation_checkpointing_every

    def recompute(self, block: int) -> str:
        """How block `block` (canonical index) is recomputed: "" (not), full or selective."""
        return self.ckpt_mode if self.ckpt and block % self.ckpt_every == 0 else ""

    @property
    def shards(self) -> int:
        """The ranks ZeRO shards over: a replica group's dp ranks x cp (grid.shard_size)."""
        return self.dp // self.R * self.cp

    def keys(self) -> dict:
        out = {"parallel.dp": self.dp_kind, "parallel.tp": self.tp, "parallel.pp": self.pp,
               "parallel.cp": self.cp, "parallel.sequence_parallel": self.sp}
        if self.dp_kind == "fsdp":
            out["parallel.zero_stage"] = self.zero_stage
        if self.R > 1:
            out["parallel.dp_replicate"] = self.R
        if self.offload:
            out["parallel.offload"] = True
        if self.ep > 1:
            out["parallel.ep"] = self.ep
        if self.pp > 1:
            out.update({"parallel.pp_schedule": self.schedule, "parallel.microbatches": self.M})
            if self.schedule == "interleaved":
                out["parallel.pp_virtual_stages"] = self.V
        out.update({"trainer.grad_accum": self.grad_accum,
                    "trainer.activation_checkpointing": self.ckpt})
        if self.ckpt and (self.ckpt_mode, self.ckpt_every) != ("full", 1):
            out.update({"trainer.activation_checkpointing_mode": self.ckpt_mode,
                        "trainer.activation_checkpointing_every": self.ckpt_every})
        return out

    def name(self) -> str:
        dp = self.dp_kind + (str(self.zero_stage) if self.dp_kind == "fsdp" else "") \
            + (" offload" if self.offload else "")
        groups = f"{self.R}x{self.dp // self.R}" if self.R > 1 else str(self.dp)  # HSDP: R x shards
        parts = [f"dp{groups}", f"tp{self.tp}" + ("sp" if self.sp else ""), f"pp{self.pp}",
                 f"cp{self.cp}", f"ep{self.ep}"]
        text = " ".join(p for p in parts if p[2:] not in ("1", "1sp") or p.startswith("dp")) \
            + " " + dp
        if self.pp > 1:
            text += f" {self.schedule}" + (f" V{self.V}" if self.schedule == "interleaved" else "") \
                + f" M{self.M}"
        if self.grad_accum > 1:
            text += f" ga{self.grad_accum}"
        if self.ckpt:
            text += f" ckpt {self.ckpt_mode}" + (f" every{self.ckpt_every}" if self.ckpt_every > 1 else "")
        return text


@dataclass(frozen=True)
class Workload:
    """What the layout does not change: the model, the global batch, precision."""
    n_layer: int
    n_head: int
    n_embd: int
    vocab: int
    block: int            # tokens per sequence
    batch: int            # global batch, sequences per optimizer step
    precision: str = "fp32"
    bias: bool = True
    experts: int = 0      # model.moe_experts (0: dense)
    top_k: int = 2        # model.moe_top_k
    every: int = 1        # model.moe_every
    hidden: int = 0       # model.moe_hidden (0: 4 x n_embd)
    vocab_pad_to: int = 1  # model.vocab_pad_to: the LM head computes padded_vocab logits
    # Another system's block, for replaying its runs (plan.kv_heads, plan.ffn_hidden,
    # plan.gated_ffn, plan.untied_head; model.py trains none of them): grouped-query
    # attention's K/V heads (0: n_head), the MLP's hidden width (0: 4 n_embd), a gated MLP
    # (SwiGLU: three matrices, the first two fused), an LM head of its own (not the embedding)
    kv_heads: int = 0
    ffn_hidden: int = 0
    gated: bool = False
    untied: bool = False
    # The model's own dtype, what compute reads (plan.param_gather_bytes): 4 = this
    # product's fp32 parameters under autocast (the residual stream and LayerNorms in
    # fp32); 2 = a bf16 model (FSDP's param_dtype, Megatron's bf16 parameters beside fp32
    # master weights): residual stream, LayerNorm inputs and ZeRO-3's gathered units in bf16
    model_bytes: int = 4
    # the loss's kernel (plan.loss_kernel): "eager" = autocast's fp32 cross-entropy, the
    # log-softmax saved in fp32 and an fp32 gradient (this product); "fused" = one kernel
    # keeping the logits in their dtype and writing their gradient in it (flash-attn's
    # CrossEntropyLoss, Megatron's and llm.c's fused loss)
    loss: str = "eager"

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and LM head (model.GPTConfig.padded_vocab_size)."""
        return -(-self.vocab // self.vocab_pad_to) * self.vocab_pad_to

    @property
    def shape(self):  # the model census builds: the padded rows are parameters it allocates
        return (self.n_layer, self.n_head, self.n_embd, self.padded_vocab, self.block, self.bias,
                self.experts, self.top_k, self.every, self.hidden, self.kv_heads, self.ffn_hidden,
                self.gated, self.untied)

    @property
    def foreign(self) -> bool:
        """A block model.py does not build (plan.kv_heads, ffn_hidden, gated_ffn, untied_head)."""
        return bool(self.kv_heads or self.ffn_hidden or self.gated or self.untied)

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values): K/V heads x head size."""
        return (self.kv_heads or self.n_head) * (self.n_embd // self.n_head)

    @property
    def ffn(self) -> int:
        """The MLP's hidden width."""
        return self.ffn_hidden or 4 * self.n_embd

    @property
    def fc_out(self) -> int:
        """Outputs of the MLP's first product: H, or 2 H gated (gate and up, fused)."""
        return self.ffn * (2 if self.gated else 1)

    def flops_per_token(self) -> float:
        """Training FLOPs a token (telemetry/mfu.py's 6 N + 12 L C T; the N of this block)."""
        from telemetry.mfu import flops_per_token
        if not self.foreign:
            return flops_per_token(self.gpt_config())
        C, L, T, H = self.n_embd, self.n_layer, self.block, self.ffn
        matrices = C * (C + 2 * self.kv_width) + C * C + C * H * (3 if self.gated else 2)
        biases = (C + 2 * self.kv_width) + C + self.fc_out + C + 4 * C if self.bias else 2 * C
        final = 2 * C if self.bias else C
        return 6 * (self.vocab * C + L * (matrices + biases) + final) + 12 * L * C * T

    def gpt_config(self) -> dict:
        """model.py's GPTConfig fields of this workload (telemetry/mfu.py's input)."""
        return {"n_layer": self.n_layer, "n_head": self.n_head, "n_embd": self.n_embd,
                "vocab_size": self.vocab, "block_size": self.block, "bias": self.bias,
                "moe_experts": self.experts, "moe_top_k": self.top_k, "moe_every": self.every,
                "moe_hidden": self.hidden}

    def has_experts(self, block) -> bool:
        """Whether block `block` is a mixture-of-experts block (ModelConfig.has_experts)."""
        return self.experts > 0 and (block + 1) % self.every == 0

    @property
    def expert_hidden(self) -> int:
        return self.hidden or 4 * self.n_embd


# ------------------------------------------------------------------ sizes of one micro-batch

def micro_rows(w: Workload, L: Layout) -> int:
    """Sequences of one micro-batch (one pipeline micro-batch, or one accumulation step)."""
    return w.batch // (L.dp * L.grad_accum * L.M)


def act_bytes(w):
    """Bytes of one element TP's collectives and saved matmul outputs carry."""
    return F32 if w.precision == "fp32" else 2


def res_bytes(w):
    """Bytes of one element of the residual stream (and the LayerNorms' inputs): fp32
    under autocast over fp32 parameters (this product), the compute dtype in a bf16 model."""
    return act_bytes(w) if w.model_bytes == 2 else F32


def logit_bytes(w):
    """Bytes a logit keeps for the loss's backward, and its gradient: fp32 from autocast's
    cross-entropy (eager), the logits' own dtype from a fused loss kernel."""
    return F32 if w.loss == "eager" else act_bytes(w)
