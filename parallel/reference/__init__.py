"""PyTorch's own implementations, kept as references: every own strategy is measured
against one of them (parity and speed) in the same run, on the same model and data.

    torch_ddp.py   DistributedDataParallel          parallel.dp=torch_ddp
    torch_fsdp.py  FSDP2 fully_shard                parallel.dp=torch_fsdp
    torch_tp.py    DTensor parallelize_module       parallel.tp_impl=torch
    torch_pp.py    torch.distributed.pipelining     parallel.pp_impl=torch

May import: parallel/'s root files (model_plan), data_parallel/replicated.py (the
base they wrap) and data_parallel/single.py (its one-rank message), each other (this
file's shared refusals, torch_ddp's), checkpoint/canonical.py, and torch. Nothing of
ours imports them except parallel/parallelize.py.
"""


def refuse_own_options(cfg, what):
    """What every reference refuses: our gradient collectives' dtype option, and
    compilation (issue 23 compiles our own strategies; the references stay the eager
    PyTorch baseline they are measured as, and were not verified compiled)."""
    if cfg.trainer.compile:
        return (f"trainer.compile=true is for our own strategies: {what} is PyTorch's reference "
                "and runs eager here (compiling it was not verified); use trainer.compile=false")
    if cfg.parallel.reduce_dtype != "fp32":
        return (f"parallel.reduce_dtype={cfg.parallel.reduce_dtype} applies to our strategies "
                f"(ddp_naive, ddp_bucket, fsdp); {what} is PyTorch's reference and reduces in fp32")
    return ""


def refuse_model_parallel_reference(cfg, sizes, dim):
    """torch_tp and torch_pp: PyTorch's TP / pipelining alone (no data parallelism),
    in fp32, without activation checkpointing."""
    from parallel.data_parallel.single import no_data_parallel_dimension
    p, t = cfg.parallel, cfg.trainer
    what = f"parallel.{dim}_impl=torch"
    if t.precision != "fp32" or t.activation_checkpointing:
        return (f"{what} is PyTorch's reference for parallel.{dim} and runs in fp32 without "
                "activation checkpointing: use trainer.precision=fp32 and "
                f"trainer.activation_checkpointing=false, or our parallel.{dim} "
                f"(parallel.{dim}_impl=own)")
    if sizes["dp"] != 1:
        return no_data_parallel_dimension(what, sizes)
    others = [f"parallel.{d}={n}" for d, n in sizes.items() if d not in ("dp", dim) and n > 1]
    if others:  # any other dimension, present or future: the reference measures its own alone
        return (f"{what} is PyTorch's reference for parallel.{dim} alone: it runs without "
                f"{', '.join(others)}")
    return refuse_own_options(cfg, what)
