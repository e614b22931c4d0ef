"""Muon (trainer.optimizer=muon): each hidden matrix's momentum orthogonalized by a
Newton-Schulz iteration; AdamW (torch's) on everything else, as the references do.

The update is torch.optim.Muon's (torch/optim/_muon.py), op for op, so that one process
equals it bitwise on the same device:

    buf <- lerp(buf, g, 1 - momentum)              # an average of the gradients
    u   <- lerp(g, buf, momentum) if nesterov else buf
    O   <- NS(u)                                   # in trainer.muon_ns_dtype
    W   <- W (1 - lr wd) - lr ratio(rows, cols) O

NS normalizes u by its Frobenius norm, transposes a tall matrix to wide, and runs
ns_steps quintic iterations X <- a X + (b A + c A^2) X, A = X X^T. bf16 is PyTorch's
choice (fast); its rounding turns the last fp32 bits in which two layouts' gradients
differ into bf16 steps of the update, so layout parity is checked with fp32.

Stacked experts ([E, in, out], moe/experts.py) are E matrices: each slice is
orthogonalized alone, and its `ratio` reads it as the (out, in) matrix a Linear would hold.
"""

import math
from collections.abc import Mapping

import torch

from optimizers.adamw import build_adamw

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
EPS = 1e-7  # torch.optim.Muon's: the norm that NS divides by is at least this


def build(param_groups, tcfg, matrices=(), **kwargs):
    """Muon over `matrices` ({parameter: stored (in, out)}: model_plan.hidden_matrices'
    tensors), AdamW (kwargs: its kind) over the rest of `param_groups`."""
    taken = {id(p) for p in matrices}
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in taken]} for g in param_groups]
    muon = Muon([{"params": [p for p, in_out in matrices.items() if in_out == kind],
                  "in_out": kind} for kind in (False, True)
                 if any(in_out == kind for in_out in matrices.values())], tcfg) if matrices else None
    rest = [g for g in rest if g["params"]]
    return MuonAdamW(build_adamw(rest, tcfg, **kwargs) if rest else None, muon)


def orthogonalize(u, coefficients, steps, dtype):
    """torch.optim.Muon's _zeropower_via_newtonschulz, in `dtype` (a new tensor)."""
    a, b, c = coefficients
    x = u.to(dtype, copy=True)
    tall = u.size(0) > u.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=EPS))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def lr_ratio(adjust, rows, cols) -> float:
    """What the learning rate is multiplied by for a (rows, cols) = (out, in) matrix:
    Keller Jordan's sqrt(max(1, rows / cols)), or Moonshot's 0.2 sqrt(max(rows, cols)),
    which gives the update AdamW's RMS (so AdamW's lr and weight decay carry over)."""
    if adjust == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


class Muon(torch.optim.Optimizer):
    """Muon over whole matrices this rank holds. A group's "lr" is the schedule's (AdamW's,
    which the Strategy sets on every group); Muon's is that times muon_lr / lr."""

    def __init__(self, groups, tcfg):
        super().__init__(groups, dict(
            lr=tcfg.lr, lr_ratio=tcfg.muon_lr / tcfg.lr, weight_decay=tcfg.muon_weight_decay,
            momentum=tcfg.muon_momentum, nesterov=tcfg.muon_nesterov,
            ns_coefficients=tuple(tcfg.muon_ns_coefficients), ns_steps=tcfg.muon_ns_steps,
            adjust_lr=tcfg.muon_adjust_lr, ns_dtype=tcfg.muon_ns_dtype, in_out=False))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr = group["lr"] * group["lr_ratio"]
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, group, lr)

    def _update(self, p, grad, group, lr):
        state, m = self.state[p], group["momentum"]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(grad)
            state["step"] = torch.zeros((), dtype=torch.float32)
        state["step"] += 1  # as AdamW's: a snapshot tells a stepped state from a fresh one
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - m)
        u = grad.lerp(buf, m) if group["nesterov"] else buf
        steps, dtype = (group["ns_coefficients"], group["ns_steps"]), DTYPES[group["ns_dtype"]]
        if group["in_out"]:  # [E, in, out]: each expert's matrix, read as (out, in)
            update = torch.stack([orthogonalize(u[e], *steps, dtype) for e in range(u.size(0))])
            rows, cols = p.shape[2], p.shape[1]
        else:
            update, (rows, cols) = orthogonalize(u, *steps, dtype), p.shape
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(update, alpha=-lr * lr_ratio(group["adjust_lr"], rows, cols))


class MuonAdamW:
    """One optimizer to the Strategy: torch's AdamW on its groups, Muon on its own. The
    Strategy reads and sets `param_groups` (the lr), `state` (snapshots, state_bytes),
    `defaults` (AdamW's kind, parallel/finite.py) and calls step and zero_grad."""

    def __init__(self, adamw, muon):
        """Either None where this rank holds none of its parameters (muon: a pipeline stage
        without blocks)."""
        self.adamw, self.muon = adamw, muon
        self.parts = [o for o in (adamw, muon) if o is not None]
        # fused AdamW (a GPU): step_unless hands a found_inf flag instead of skipping step()
        self.defaults = adamw.defaults if adamw is not None else {}
        self.state = States(*self.parts)
        self.found_inf = None

    @property
    def param_groups(self):
        return [g for o in self.parts for g in o.param_groups]

    def state_fields(self, p) -> tuple:
        """The state tensors shaped like parameter `p` (parallel/placement.py)."""
        return ("momentum_buffer",) if self.state.owner(p) is self.muon else (
            "exp_avg", "exp_avg_sq")

    def step(self):
        found = self.found_inf
        if self.adamw is not None:
            if found is not None:  # fused AdamW skips inside its kernel on the flag
                self.adamw.found_inf = found
            try:
                self.adamw.step()
            finally:
                self.adamw.__dict__.pop("found_inf", None)
        # Muon has no kernel that takes the flag: read it (a device sync, only with fused)
        if self.muon is not None and (found is None or not bool(found)):
            self.muon.step()

    def zero_grad(self, set_to_none=True):
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)


class States(Mapping):
    """{parameter: its state}, each parameter's in the optimizer that steps it (a plain
    ChainMap would create an empty state in the first one: torch's are defaultdicts)."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers
        self._owner = {p: o for o in optimizers for g in o.param_groups for p in g["params"]}

    def owner(self, p):
        return self._owner[p]

    def __getitem__(self, p):
        return self._owner[p].state[p]

    def get(self, p, default=None):
        o = self._owner.get(p)
        return o.state[p] if o is not None and p in o.state else default

    def __iter__(self):
        return (p for o in self.optimizers for p in o.state)

    def __len__(self):
        return sum(len(o.state) for o in self.optimizers)
