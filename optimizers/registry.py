"""`trainer.optimizer`'s names, each as "module:function" building it; importing nothing,
so the config checks read the names without importing torch.optim.

A new optimizer: one file in optimizers/ with build(param_groups, tcfg, matrices=(),
**kwargs) and one line here; its keys in training/config.py, checked in `refusal`.
"""

OPTIMIZERS = {
    "adamw": "optimizers.adamw:build",  # torch.optim.AdamW on every parameter (the default)
    "muon": "optimizers.muon:build",    # Muon on the blocks' matrices, AdamW on the rest
}
ADJUST_LR = ("original", "match_rms_adamw")  # trainer.muon_adjust_lr, torch.optim.Muon's names
NS_DTYPES = ("bf16", "fp32")  # trainer.muon_ns_dtype


def refusal(t) -> str:
    """The one line that refuses the trainer section `t`'s optimizer keys, or ""."""
    if t.optimizer not in OPTIMIZERS:
        return f"trainer.optimizer must be one of {', '.join(OPTIMIZERS)}, got {t.optimizer!r}"
    if t.optimizer != "muon":
        return ""
    checks = [
        (t.muon_lr > 0, f"trainer.muon_lr must be > 0, got {t.muon_lr}"),
        (0 <= t.muon_momentum < 1, f"trainer.muon_momentum must be in [0, 1), got {t.muon_momentum}"),
        (1 <= t.muon_ns_steps < 100,
         f"trainer.muon_ns_steps must be in [1, 100), got {t.muon_ns_steps}"),
        (len(t.muon_ns_coefficients) == 3,
         f"trainer.muon_ns_coefficients must be three numbers (a, b, c), got "
         f"{list(t.muon_ns_coefficients)}"),
        (t.muon_weight_decay >= 0,
         f"trainer.muon_weight_decay must be >= 0, got {t.muon_weight_decay}"),
        (t.muon_adjust_lr in ADJUST_LR,
         f"trainer.muon_adjust_lr must be {' or '.join(ADJUST_LR)}, got {t.muon_adjust_lr!r}"),
        (t.muon_ns_dtype in NS_DTYPES,
         f"trainer.muon_ns_dtype must be {' or '.join(NS_DTYPES)}, got {t.muon_ns_dtype!r}"),
    ]
    return next((message for ok, message in checks if not ok), "")


def builder(name):
    """The build function of optimizer `name`, imported now."""
    import importlib
    module, _, function = OPTIMIZERS[name].partition(":")
    return getattr(importlib.import_module(module), function)
