"""What `parallel:` can choose, by name: each strategy as "module:Class" with what it can do.

Nothing here is imported until chosen (`load`, which parallelize() calls), so the code that
checks a config (parallel/rules.py, the planner) reads names and capabilities without
importing a strategy: configuration stays a leaf, and a rank pays for importing
torch.distributed.fsdp or .pipelining (~0.9 s) only when it runs PyTorch's reference.

A new data-parallel strategy: one file in data_parallel/, one line in STRATEGIES; what
it refuses: its rows in parallel/rules.py.
"""

import importlib

CAPABILITIES = {  # what a strategy may declare; the rules and parallelize() read it here
    "compiles_whole_model": "no hooks inside the model: trainer.compile_scope=model may compile "
                            "its whole forward",
    "hybrid_shards": "shards inside parallel.dp_replicate replica groups and averages across "
                     "them (HSDP, data_parallel/hybrid.py)",
    "offloads": "parallel.offload puts its optimizer's shard in host memory (offload.py)",
    "parallelizes_tp_itself": "applies tensor parallelism itself, so parallelize() skips ours",
}

STRATEGIES = {  # name: ("module:Class", its capabilities)
    # ours: single (one rank, the parity reference), ddp_naive (an all-reduce per parameter
    # after backward), ddp_bucket (buckets during backward), fsdp (ZeRO 1/2/3)
    "single": ("parallel.data_parallel.single:Single", {"compiles_whole_model"}),
    "ddp_naive": ("parallel.data_parallel.naive:DDPNaive", set()),
    "ddp_bucket": ("parallel.data_parallel.bucket:DDPBucket", set()),
    "fsdp": ("parallel.data_parallel.fsdp:FSDP", {"hybrid_shards", "offloads"}),
    # PyTorch's, the references ours are measured against: DDP, FSDP2, DTensor TP, pipelining
    "torch_ddp": ("parallel.reference.torch_ddp:TorchDDP", set()),
    "torch_fsdp": ("parallel.reference.torch_fsdp:TorchFSDP", {"hybrid_shards", "offloads"}),
    "torch_tp": ("parallel.reference.torch_tp:TorchTP", {"parallelizes_tp_itself"}),
    "torch_pp": ("parallel.reference.torch_pp:TorchPP", set()),
}
TORCH_REFERENCES = {"tp": "torch_tp", "pp": "torch_pp"}  # parallel.<dim>_impl=torch runs these
DATA_PARALLEL = [s for s in STRATEGIES if s not in TORCH_REFERENCES.values()]  # parallel.dp
IMPLEMENTATIONS = ("own", "torch")  # parallel.tp_impl, parallel.pp_impl
MOVED = {"torch_tp": "parallel.tp_impl=torch", "torch_pp": "parallel.pp_impl=torch"}  # were dp
EP_IMPLEMENTATIONS = {  # parallel.ep_impl: how tokens reach the ranks of their experts
    "alltoall": "parallel.expert_parallel.dispatch:AllToAllExchange",  # ours
    "allgather": "parallel.expert_parallel.allgather:AllGatherExchange",  # the reference
}
CP_IMPLEMENTATIONS = {  # parallel.cp_impl: the attention each block's becomes
    "ring": "parallel.context_parallel.ring_attention:ring_attention",  # ours: K, V travel a ring
    "allgather": "parallel.context_parallel.allgather_attention:allgather_attention",  # reference
}


def strategy_name(p) -> str:
    """The strategy a `parallel:` section asks for: a dimension's reference, or parallel.dp."""
    return next((s for dim, s in TORCH_REFERENCES.items() if getattr(p, f"{dim}_impl") == "torch"),
                p.dp)


def capabilities(p) -> set:
    return STRATEGIES[strategy_name(p)][1]


def strategy_class(p):
    return load(STRATEGIES[strategy_name(p)][0])


def load(where):
    """"module:attribute", imported now."""
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module), name)
