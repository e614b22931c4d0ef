"""Every layout rule: what cannot run, when, and the one line that says so.

A rule is (topic, refused, message). The topic is a key, or strategies of
registry.STRATEGIES: then the rule binds only them. `refused` is a condition whose
parameters name the facts it reads (`Facts` below: `p` the `parallel:`
section, `tp` the grid's tp degree, `can` the chosen strategy's capabilities, ...); the
message's {fields} are filled from the same facts. parallel/layout.py walks the tables
in order and stops at the first rule that holds: KEYS on every mode, then GRID and
LAYOUT for a training run, in the order parallelize() applies the dimensions, before any
process group exists. The planner asks the same rules of every candidate layout.
docs/layout-rules.md shows them (scripts/layout_rules.py writes it; tests/test_docs.py
checks it is current).
"""

from dataclasses import dataclass, field
from typing import Callable

from parallel.facts import BACKENDS, DEGREES, MODEL_DIMS, Facts  # noqa: F401 (layout.py, tests)
from parallel.grid import uses_cuda
from parallel.pipeline_parallel.schedules import SCHEDULES
from parallel.registry import (CP_IMPLEMENTATIONS, DATA_PARALLEL, EP_IMPLEMENTATIONS, IMPLEMENTATIONS,
                               MOVED, STRATEGIES)


@dataclass(frozen=True)
class Rule:
    topic: str          # a key (section.key ...), or the strategies it binds
    refused: Callable   # (facts it names) -> true when the layout cannot run
    message: str        # one line; {fact} fields
    only: frozenset = field(init=False)  # the strategies it binds; empty: every one

    def __post_init__(self):
        names = set(self.topic.split())
        if not (names <= set(STRATEGIES) or "." in self.topic.split()[0]):  # a misspelt strategy
            raise ValueError(f"a rule is for a key or for strategies, not {self.topic!r}")
        object.__setattr__(self, "only", frozenset(names if names <= set(STRATEGIES) else ()))


KEYS = [  # the parallel: section's values, alone (every mode)
    Rule("parallel.dp", lambda p: p.dp in MOVED,
         "parallel.dp={p.dp} is now {moved}: PyTorch's reference implementations are chosen per "
         "dimension"),
    Rule("parallel.dp", lambda p: p.dp not in DATA_PARALLEL,
         "parallel.dp={p.dp!r} is not one of {data_parallel}"),
    Rule("parallel.tp_impl pp_impl",
         lambda p: p.tp_impl not in IMPLEMENTATIONS or p.pp_impl not in IMPLEMENTATIONS,
         "parallel.tp_impl and parallel.pp_impl must be one of {implementations}"),
    Rule("parallel.ep_impl", lambda p: p.ep_impl not in EP_IMPLEMENTATIONS,
         "parallel.ep_impl must be one of {ep_implementations}, got {p.ep_impl!r}"),
    Rule("parallel.cp_impl", lambda p: p.cp_impl not in CP_IMPLEMENTATIONS,
         "parallel.cp_impl must be one of {cp_implementations}, got {p.cp_impl!r}"),
    Rule("parallel.<degree>", lambda p: min(getattr(p, d) for d in DEGREES) < 1,
         "{degree_keys} must be >= 1"),
    Rule("parallel.reduce_dtype", lambda p: p.reduce_dtype not in ("fp32", "bf16"),
         "parallel.reduce_dtype must be fp32 or bf16, got {p.reduce_dtype!r}"),
    Rule("parallel.timeout_s", lambda p: not 0 < p.timeout_s < 10**7,
         "parallel.timeout_s must be > 0 and finite"),
    Rule("parallel.pp_schedule", lambda p: p.pp_schedule not in SCHEDULES,
         "parallel.pp_schedule must be {schedules}, got {p.pp_schedule!r}"),
    Rule("parallel.microbatches", lambda p: not p.microbatches >= 1,
         "parallel.microbatches must be >= 1, got {p.microbatches}"),
    Rule("parallel.pp_virtual_stages", lambda p: not p.pp_virtual_stages >= 1,
         "parallel.pp_virtual_stages must be >= 1, got {p.pp_virtual_stages}"),
    Rule("parallel.allreduce", lambda p: p.allreduce not in ("native", "ring"),
         "parallel.allreduce must be native or ring, got {p.allreduce!r}"),
    Rule("parallel.bucket_cap_mb", lambda p: not p.bucket_cap_mb > 0,
         "parallel.bucket_cap_mb must be > 0, got {p.bucket_cap_mb}"),
    Rule("parallel.zero_stage", lambda p: p.zero_stage not in (1, 2, 3),
         "parallel.zero_stage must be 1, 2 or 3, got {p.zero_stage}"),
]

GRID = [  # the grid: the world size over the model's degrees (layout.grid_sizes)
    Rule("parallel.<degree>", lambda world, model: world % model,
         "world size {world} is not divisible by {model_keys} = {model_values}: the grid is "
         "{dims}"),
    Rule("parallel.dp_replicate", lambda p, data: data % p.dp_replicate,
         "parallel.dp_replicate={p.dp_replicate} does not divide the data-parallel degree {data} "
         "(world size {world} / ({model_keys} = {model})): hybrid sharding makes "
         "parallel.dp_replicate groups of equal size"),
]

TENSOR = [  # tensor parallelism (tensor_parallel/)
    Rule("parallel.tp", lambda m, tp: m.n_head % tp,
         "model.n_head={m.n_head} is not divisible by parallel.tp={tp}: tensor parallelism splits "
         "attention by whole heads"),
    Rule("parallel.tp", lambda p, tp: p.sequence_parallel and tp == 1,
         "parallel.sequence_parallel=true needs parallel.tp > 1"),
    Rule("parallel.tp", lambda p, d, tp: p.sequence_parallel and d.block_size % tp,
         "data.block_size={d.block_size} is not divisible by parallel.tp={tp}: sequence "
         "parallelism splits every sequence into tp equal shards"),
]

CONTEXT = [  # context parallelism (context_parallel/)
    Rule("parallel.cp", lambda d, cp: cp > 1 and d.block_size % (2 * cp),
         "data.block_size={d.block_size} is not divisible by 2 x parallel.cp = {cp_chunks}: "
         "context parallelism cuts every sequence into 2 x cp equal chunks (the balanced causal "
         "split)"),
    Rule("parallel.cp", lambda p, cp, tp, cp_tokens: cp > 1 and p.sequence_parallel
         and cp_tokens % tp,
         "data.block_size / parallel.cp = {cp_tokens} is not divisible by parallel.tp={tp}: "
         "sequence parallelism splits each rank's part of the sequence into tp equal shards"),
]

PIPELINE = [  # pipeline parallelism (pipeline_parallel/)
    Rule("parallel.pp",
         lambda p, pp: pp == 1 and (p.microbatches != 1 or p.pp_virtual_stages != 1 or p.pp_layers),
         "parallel.microbatches, pp_virtual_stages and pp_layers are for pipeline parallelism "
         "(parallel.pp > 1); without it, use trainer.grad_accum for micro-batches"),
    Rule("parallel.pp", lambda p, fixed: fixed and p.pp_virtual_stages not in (1, fixed),
         "parallel.pp_virtual_stages={p.pp_virtual_stages} needs parallel.pp_schedule=interleaved "
         "({p.pp_schedule} always runs {fixed} chunks per rank)"),
    Rule("parallel.pp", lambda p, fixed: not fixed and p.pp_virtual_stages != 1
         and p.pp_schedule != "interleaved",
         "parallel.pp_virtual_stages={p.pp_virtual_stages} needs parallel.pp_schedule=interleaved"),
    Rule("parallel.pp", lambda p, pp: p.pp_schedule == "interleaved" and p.microbatches % pp,
         "parallel.pp_schedule=interleaved runs micro-batches in groups of parallel.pp={pp}: "
         "parallel.microbatches={p.microbatches} must be a multiple of it (Megatron's rule)"),
    Rule("parallel.pp", lambda m, chunks: m.n_layer < chunks,
         "model.n_layer={m.n_layer} cannot fill parallel.pp={pp} x {chunks_per_rank} chunks per "
         "rank = {chunks} pipeline chunks (more stages than layers)"),
    Rule("parallel.pp", lambda p, m, chunks: p.pp_layers and (
        len(p.pp_layers) != chunks or sum(p.pp_layers) != m.n_layer or min(p.pp_layers) < 1),
         "parallel.pp_layers={p.pp_layers} must give each of the {chunks} pipeline chunks at least "
         "one block, {m.n_layer} (model.n_layer) in all"),
    Rule("parallel.pp", lambda t, pp, split_backward: pp > 1 and split_backward
         and t.activation_checkpointing,
         "parallel.pp_schedule={p.pp_schedule} splits each backward in two (B, then W), which "
         "needs the graph between them; trainer.activation_checkpointing recomputes it: use one "
         "of them"),
    Rule("parallel.pp", lambda t, pp, split_backward: pp > 1 and split_backward and t.compile,
         "trainer.compile with parallel.pp_schedule={p.pp_schedule} is refused: a compiled "
         "block's backward is one autograd node, which the zero-bubble split (B, then W: "
         "pipeline_parallel/split_backward.py) cannot cut in two; use pp_schedule 1f1b or "
         "interleaved with compilation"),
]

DATA = [  # data parallelism: hybrid sharding, offload, each strategy (data_parallel/, reference/)
    Rule("single", lambda dp_replicate: dp_replicate > 1,
         "parallel.dp_replicate={dp_replicate} with parallel.dp={p.dp}: one process has no "
         "replicas to make; hybrid sharding needs parallel.dp=fsdp on several data-parallel ranks"),
    Rule("parallel.dp_replicate", lambda dp_replicate, can: dp_replicate > 1
         and "hybrid_shards" not in can,
         "parallel.dp_replicate={dp_replicate} with {what}: {what} holds whole replicas, so "
         "there is nothing to shard inside a replica group; hybrid sharding needs "
         "parallel.dp=fsdp (or torch_fsdp, PyTorch's reference)"),
    Rule("parallel.offload", lambda p, can: p.offload and "offloads" not in can,
         "parallel.offload=true with {what}: offloading moves a shard's master weights, "
         "gradient and optimizer state to host memory, and only parallel.dp=fsdp (ZeRO stages "
         "1-3; or torch_fsdp, PyTorch's reference) shards them"),
    # PyTorch's references measure one dimension alone
    Rule("torch_tp", lambda tp: tp == 1,
         "parallel.tp_impl=torch is PyTorch's tensor parallelism, the reference for parallel.tp: "
         "set parallel.tp > 1"),
    Rule("torch_tp", lambda p: p.sequence_parallel,
         "parallel.tp_impl=torch runs without sequence parallelism (the reference for plain TP)"),
    Rule("torch_tp", lambda pp: pp > 1,
         "parallel.tp_impl=torch does not run under pipeline parallelism: PyTorch's references "
         "measure pure data or tensor parallelism"),
    Rule("torch_tp", lambda m: m.vocab_pad_to > 1,
         "parallel.tp_impl=torch with model.vocab_pad_to={m.vocab_pad_to} is refused: PyTorch's "
         "reference does not mask a padded vocabulary's logits (use our parallel.tp)"),
    Rule("torch_pp", lambda pp, tp: pp == 1 or tp > 1,
         "parallel.pp_impl=torch is PyTorch's pipelining, the reference for parallel.pp: set "
         "parallel.pp > 1 and parallel.tp=1"),
    Rule("torch_tp torch_pp", lambda t: t.precision != "fp32" or t.activation_checkpointing,
         "{what} is PyTorch's reference for parallel.{dim} and runs in fp32 without activation "
         "checkpointing: use trainer.precision=fp32 and trainer.activation_checkpointing=false, "
         "or our parallel.{dim} (parallel.{dim}_impl=own)"),
    Rule("single torch_tp torch_pp", lambda dp: dp != 1,
         "{what} has no data-parallel dimension, but world size {world} / ({model_ranks}) = {dp}: "
         "use torchrun --nproc_per_node={world_per_dp} or a data-parallel strategy"),
    Rule("single", lambda grad_dims_beside_dp: grad_dims_beside_dp,
         "parallel.dp={p.dp} averages no gradients, but with {grad_dims_beside_dp} ranks see "
         "other tokens of the same parameters: use a data-parallel strategy (ddp_bucket, "
         "ddp_naive, fsdp)"),
    Rule("torch_tp torch_pp", lambda dims_beside_reference: dims_beside_reference,
         "{what} is PyTorch's reference for parallel.{dim} alone: it runs without "
         "{dims_beside_reference}"),
    Rule("torch_fsdp", lambda tp: tp > 1,
         "parallel.dp=torch_fsdp with parallel.tp > 1 is not supported: it is the reference for "
         "our ZeRO, and PyTorch composes FSDP2 with its own DTensor tensor parallelism, not with "
         "ours (use parallel.dp=fsdp)"),
    Rule("torch_ddp torch_fsdp", lambda pp: pp > 1,
         "parallel.dp={p.dp} does not run under pipeline parallelism: PyTorch's references "
         "measure pure data or tensor parallelism (use ddp_naive, ddp_bucket or fsdp)"),
    # compilation was verified for our strategies (issue 23), not for the references
    Rule("torch_ddp torch_fsdp torch_tp torch_pp", lambda t: t.compile,
         "trainer.compile=true is for our own strategies: {what} is PyTorch's reference and runs "
         "eager here (compiling it was not verified); use trainer.compile=false"),
    Rule("torch_ddp torch_fsdp torch_tp torch_pp", lambda p: p.reduce_dtype != "fp32",
         "parallel.reduce_dtype={p.reduce_dtype} applies to our strategies (ddp_naive, "
         "ddp_bucket, fsdp); {what} is PyTorch's reference and reduces in fp32"),
    # the ring's worker thread drives the gradient group's communicator while autograd
    # drives tp's, the pipeline's or cp's from the training thread: a documented NCCL
    # deadlock (gloo has no such rule); the ring runs whenever dp x cp > 1
    Rule("ddp_bucket", lambda p, t, dp, cp, model_parallel: p.allreduce == "ring"
         and dp * cp > 1 and model_parallel and uses_cuda(t.device),
         "parallel.dp=ddp_bucket with parallel.allreduce=ring and {model_parallel} is refused on "
         "CUDA: the ring's thread and the training thread would drive two NCCL communicators in "
         "an order that can differ between ranks (a deadlock); use parallel.allreduce=native, or "
         "parallel.dp=ddp_naive (its ring runs in the training thread)"),
    # Muon needs each whole matrix where it orthogonalizes: shards are not assembled yet
    Rule("fsdp torch_fsdp torch_tp", lambda t: t.optimizer == "muon",
         "trainer.optimizer=muon with {what} is not supported yet: Muon orthogonalizes whole "
         "matrices, and {what} holds shards of them (issue 56); use parallel.dp=ddp_bucket, "
         "ddp_naive or single, or trainer.optimizer=adamw"),
    Rule("parallel.tp", lambda t, tp: t.optimizer == "muon" and tp > 1,
         "trainer.optimizer=muon with parallel.tp={tp} is not supported yet: Muon orthogonalizes "
         "whole matrices, and tensor parallelism splits them (issue 56); use parallel.tp=1 or "
         "trainer.optimizer=adamw"),
    Rule("fsdp", lambda p, pp: pp > 1 and p.zero_stage == 3,
         "parallel.zero_stage=3 with parallel.pp > 1 is refused: ZeRO-3 would all-gather a "
         "stage's parameters again for every micro-batch's forward and backward (2M gathers a "
         "step); use zero_stage 1 or 2 with pipelines, as Megatron and DeepSpeed do"),
]

COMPILE = [  # compilation (compile.py; with a zero-bubble schedule: PIPELINE)
    Rule("trainer.compile", lambda t: t.compile and t.compile_backend not in BACKENDS,
         "trainer.compile_backend must be one of {backends}, got {t.compile_backend!r}"),
    Rule("trainer.compile", lambda t: t.compile and t.compile_scope not in ("block", "model"),
         "trainer.compile_scope must be block or model, got {t.compile_scope!r}"),
    Rule("trainer.compile", lambda t, can, world: t.compile and t.compile_scope == "model" and (
        "compiles_whole_model" not in can or world > 1 or t.activation_checkpointing),
         "trainer.compile_scope=model (the whole GPT in one graph, nanoGPT's way) runs with "
         "parallel.dp=single on one process without activation checkpointing only: our "
         "strategies hook into each block (fsdp's gathers, gradient hooks, pipeline stages, "
         "recompute), which must stay outside the compiled code; use trainer.compile_scope=block"),
]

BATCH = [  # the global batch
    Rule("trainer.batch_size", lambda t, per_rank: t.batch_size % per_rank,
         "trainer.batch_size={t.batch_size} (the global batch) must be divisible by dp degree "
         "{data} x trainer.grad_accum {t.grad_accum} x parallel.microbatches {p.microbatches} = "
         "{per_rank}"),
]

FT = [  # fault-tolerant replica groups (fault_tolerance/), checked with the config
    Rule("ft.enabled", lambda f, p: f.enabled and p.tp_impl == "torch",
         "ft.enabled with parallel.tp_impl=torch: PyTorch's DTensor TP reference cannot drop an "
         "uncommitted step; use the own tensor parallelism"),
    Rule("ft.enabled", lambda f, p: f.enabled and p.dp == "torch_fsdp",
         "ft.enabled with parallel.dp=torch_fsdp: PyTorch's FSDP reference holds DTensor "
         "gradients and state, which the sum across groups and a joining group's healing cannot "
         "take (and its gathers would run on torchft's thread); use parallel.dp=fsdp"),
    Rule("ft.enabled", lambda f, m: f.enabled and m.moe_experts and m.moe_bias_rate,
         "ft.enabled with model.moe_bias_rate > 0: each replica group would count its own "
         "share of the batch and move the choice biases apart; use moe_aux_loss_coef alone"),
    Rule("ft.enabled", lambda f, p: f.enabled and p.timeout_s <= f.timeout_s,
         "parallel.timeout_s={p.timeout_s:g} must be above ft.timeout_s={f.timeout_s:g} with "
         "ft.enabled: a group's own collectives queued behind an all-reduce across groups that "
         "hangs on a dead group would time out (and stop the group) before torchft drops the "
         "dead one"),
    Rule("ft.enabled", lambda f, t, per_share: f.enabled and t.batch_size % per_share,
         "trainer.batch_size={t.batch_size} must be divisible by ft.replicas * data-parallel ranks "
         "* trainer.grad_accum = {f.replicas} * {data} * {t.grad_accum} = {per_share}: each "
         "step's batch is cut into ft.replicas equal shares, each split over a group's "
         "data-parallel ranks and micro-steps"),
]

EXPERTS = [  # mixture of experts and expert parallelism (moe/, expert_parallel/)
    Rule("parallel.ep", lambda moe, ep: ep > 1 and not moe,
         "parallel.ep={ep} needs mixture-of-experts blocks: set model.moe_experts > 0"),
    Rule("parallel.ep", lambda m, moe, ep: moe and m.moe_experts % ep,
         "model.moe_experts={m.moe_experts} is not divisible by parallel.ep={ep}: each ep rank "
         "holds an equal run of whole experts"),
    Rule("parallel.ep", lambda ep, ep_ranks: ep_ranks % ep,
         "parallel.ep={ep} does not divide the data-parallel x context-parallel ranks of a "
         "replica group, {dp} x {cp} = {ep_ranks}: expert parallelism is carved out of them"),
    Rule("parallel.tp", lambda moe, d, tp, cp_tokens: moe and tp > 1 and cp_tokens % tp,
         "data.block_size / parallel.cp = {cp_tokens} is not divisible by parallel.tp={tp}: "
         "each TP rank routes its equal share of every sequence's tokens to the experts"),
    Rule("torch_tp torch_pp", lambda moe: moe,
         "{what} with model.moe_experts > 0 is refused: PyTorch's reference does not know the "
         "experts (use our parallel.{dim})"),
    Rule("torch_ddp torch_fsdp", lambda ep: ep > 1,
         "parallel.ep={ep} with parallel.dp={p.dp}: PyTorch's reference would average every "
         "gradient over all data-parallel ranks, each holding other experts; use ddp_naive, "
         "ddp_bucket or fsdp"),
    Rule("ddp_naive ddp_bucket", lambda p, ep: ep > 1 and p.allreduce == "ring",
         "parallel.allreduce=ring with parallel.ep={ep}: the ring runs over the whole "
         "data-parallel group, and experts average over their own; use parallel.allreduce=native"),
]

# training: the grid's sizes with the rest of the config, in the order parallelize() applies
LAYOUT = TENSOR + EXPERTS + CONTEXT + PIPELINE + DATA + COMPILE + BATCH + FT


def refusal(rules, facts) -> str:
    """The message of the first rule that holds, or ""."""
    for rule in rules:
        if rule.only and facts.strategy not in rule.only:
            continue
        code = rule.refused.__code__
        if rule.refused(*(facts[name] for name in code.co_varnames[:code.co_argcount])):
            return rule.message.format_map(facts)
    return ""
