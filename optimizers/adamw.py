"""AdamW: torch.optim.AdamW with the trainer's hyperparameters (trainer.optimizer=adamw,
and Muon's companion for what is not a hidden matrix)."""

import torch


def build(param_groups, tcfg, matrices=(), **kwargs):
    """AdamW over every parameter of `param_groups` (torch.optim's [{"params": [...], ...}]);
    `matrices` (what Muon would take) are no different to it."""
    return build_adamw(param_groups, tcfg, **kwargs)


def build_adamw(param_groups, tcfg, **kwargs):
    """AdamW over `param_groups` with the trainer's hyperparameters, in the implementation
    `adamw_kind` picks for their device unless kwargs name one."""
    params = [p for g in param_groups for p in g["params"]]
    if params and not {"fused", "foreach"} & set(kwargs):
        kwargs.update(adamw_kind(params[0].device))
    return torch.optim.AdamW(param_groups, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2),
                             weight_decay=tcfg.weight_decay, **kwargs)


def adamw_kind(device) -> dict:
    """On a GPU, fused AdamW: one kernel, and a step whose gradients are not finite skips
    inside it on a flag nobody reads (parallel/finite.py). Elsewhere torch's default (foreach
    on the CPU: what CPU runs always computed)."""
    return {"fused": True} if device.type == "cuda" else {}
