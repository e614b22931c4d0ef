"""The experts: E two-layer MLPs (GELU, as the dense block's), stored as stacked tensors
(E, ...) so that expert parallelism keeps a run of whole experts by cutting dim 0, and
computed grouped: the tokens arrive sorted by expert, and each layer is one grouped
matrix product over all experts (`torch._grouped_mm`) where this device and dtype run it,
else one product per expert -- never one per token."""

import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

_GROUPED_OK = {}  # (device type, dtype) -> whether torch._grouped_mm runs there (probed once)


class Experts(nn.Module):
    def __init__(self, num_experts, n_embd, hidden, bias=True):
        super().__init__()
        self.fc_weight = nn.Parameter(torch.empty(num_experts, n_embd, hidden))
        self.proj_weight = nn.Parameter(torch.empty(num_experts, hidden, n_embd))
        self.fc_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.proj_bias = nn.Parameter(torch.empty(num_experts, n_embd)) if bias else None

    def before_compile(self):
        """Called by parallel/compile.py before this module's block is compiled: probe the
        grouped product in bf16 now, eagerly, since a traced forward can only read the
        probe's answer (see grouped_runs); and make the per-expert loop run eagerly between
        the compiled pieces (per_expert_mm). Here, not at import: torch.compiler.disable
        imports dynamo, which a run without compilation never needs."""
        global per_expert_mm
        if self.fc_weight.device.type != "meta":
            grouped_probe(self.fc_weight.device, torch.bfloat16)
        if not getattr(per_expert_mm, "_torchdynamo_disable", False):
            per_expert_mm = torch.compiler.disable(per_expert_mm)

    def before_training(self, device, dtype):
        """Called by parallel/parallelize.py once the run's device and compute dtype are
        known: the grouped product is probed now, before any step, so that no step's
        checkpoint or dispatch mode can see the probe (_outside_the_step stays the guard
        for a module used without parallelize)."""
        grouped_probe(device, dtype)

    @staticmethod
    def init_rule(kind, n_layer):
        """GPT-2's init, as for the dense MLP: weights N(0, 0.02), the output projection's
        scaled by 1/sqrt(2 n_layer); biases 0."""
        if kind.endswith("bias"):
            return ("fill", 0.0)
        return ("normal", 0.02 / math.sqrt(2 * n_layer) if kind == "proj_weight" else 0.02)

    def forward(self, x, counts):
        """x: (n, C) tokens sorted by expert; counts: (E,) long, how many rows each of this
        module's experts gets (they sum to n)."""
        h = grouped_mm(x, self.fc_weight, counts)
        if self.fc_bias is not None:
            h = h + self.fc_bias.to(h.dtype).repeat_interleave(counts, dim=0, output_size=x.size(0))
        y = grouped_mm(F.gelu(h), self.proj_weight, counts)
        if self.proj_bias is not None:
            y = y + self.proj_bias.to(y.dtype).repeat_interleave(counts, dim=0, output_size=x.size(0))
        return y


def grouped_mm(x, w, counts):
    """rows of x times their expert's matrix: x (n, a) sorted by expert, w (E, a, b)."""
    dtype = compute_dtype(x)
    x, w = x.to(dtype), w.to(dtype)
    if grouped_runs(x, w):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        y = torch._grouped_mm(x.contiguous(), w, offs=offsets)
        if y.requires_grad:  # its backward refuses a gradient with zero strides (an expand)
            y.register_hook(lambda g: g.contiguous())
        return y
    return per_expert_mm(x, w, counts)  # a global, looked up now: the eager one under compile


def per_expert_mm(x, w, counts):
    """The grouped product without torch._grouped_mm: one product per expert. Eager under
    trainer.compile (Experts.before_compile): traced, each step's counts (host-side sizes)
    would be new constants of the graph, a recompilation a step until dynamo's limit stops
    the run."""
    sizes = counts.tolist()
    return torch.cat([part @ w[e] for e, part in enumerate(x.split(sizes))]) if sizes else x


def compute_dtype(x):
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def grouped_runs(x, w):
    """Whether torch._grouped_mm computes these: it exists, rows are 16-byte aligned, and
    a tiny forward and backward ran on this device and dtype (probed once; a CPU build,
    or a GPU older than the kernel's, raises)."""
    if not hasattr(torch, "_grouped_mm") or any((s * x.element_size()) % 16 for s in w.shape[1:]):
        return False
    if torch.compiler.is_compiling():
        # traced on fake tensors, whose rule for the grouped product takes bf16 only (torch
        # 2.13): another dtype would fail the trace, print a long error and leave the block
        # eager. And no probe can run while tracing: Experts.before_compile ran it
        return x.dtype == torch.bfloat16 and _GROUPED_OK.get((x.device.type, x.dtype), False)
    return grouped_probe(x.device, x.dtype)


def grouped_probe(device, dtype):
    """Whether torch._grouped_mm runs on this device type and dtype (probed once)."""
    key = (device.type, dtype)
    if key not in _GROUPED_OK:
        try:  # apart from the step it runs in: see _outside_the_step
            with _outside_the_step():
                _GROUPED_OK[key] = _probe(device, dtype)
        except (RuntimeError, NotImplementedError):
            _GROUPED_OK[key] = False
    return _GROUPED_OK[key]


@contextmanager
def _outside_the_step():
    """The probe runs once, inside whatever forward first needs it, and must leave no trace
    there: its own autograd graph (full recompute's checkpoint counts what a forward
    saves) and no dispatch mode of the step's (selective recompute's caching mode would
    store the probe's output and hand it to the block's first product in the recompute,
    which does not probe again)."""
    with _disable_current_modes(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        yield


def _probe(device, dtype):
    """A tiny torch._grouped_mm, forward and backward: True, or it raises."""
    with torch.enable_grad():
        a = torch.ones(4, 16, device=device, dtype=dtype, requires_grad=True)
        b = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        out = torch._grouped_mm(a, b, offs=torch.tensor([2, 4], dtype=torch.int32, device=device))
        out.backward(torch.ones_like(out))
    return True
