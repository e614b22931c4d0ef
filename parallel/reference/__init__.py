"""PyTorch's own implementations, kept as references: every own strategy is measured
against one of them (parity and speed) in the same run, on the same model and data.

    torch_ddp.py   DistributedDataParallel          parallel.dp=torch_ddp
    torch_fsdp.py  FSDP2 fully_shard                parallel.dp=torch_fsdp
    torch_tp.py    DTensor parallelize_module       parallel.tp_impl=torch
    torch_pp.py    torch.distributed.pipelining     parallel.pp_impl=torch
    dtensor_state.py  what torch_fsdp and torch_tp share: state in full canonical tensors

May import: parallel/'s root files (model_plan), data_parallel/replicated.py (the
base they wrap), checkpoint/canonical.py, and torch. Nothing of ours imports them but
parallel/parallelize.py (through parallel/registry.py); what they refuse (each one
dimension alone, eager, reducing in fp32) is in parallel/rules.py.
"""

