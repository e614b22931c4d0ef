"""Initial weights, read like a snapshot: every rank makes only the values it holds.

main.py builds the GPT on the meta device (shapes, no memory), and tensor, context
and pipeline parallelism cut that meta model as they cut a real one. The strategy
then allocates what this rank holds (a replica: its TP slice of its pipeline stage;
fsdp: its flat shard, and for stages 1-2 the gathered units) and fills it through
the code that loads a snapshot (placement.load_regions, model only), from a reader
of canonical boxes (`read_box`, `read_full` of "model/<name>"):

- `InitialWeights`: GPT.initial_value of each parameter, drawn whole on the CPU one
  at a time from its own (seed, name) stream, of which the rank copies its box; the
  last one is kept while the next box is of it. A rank's setup peak is its own share
  plus one full parameter, and the values are the same whatever the layout;
- `GivenWeights`: canonical tensors already in memory (model.init_from's Hugging Face
  weights; a model handed to parallelize() with values, as the tests build theirs).

`to_meta` and `allocate` move a module's parameters between the meta device and
real memory while keeping each Parameter object (torch.utils.swap_tensors): the tied
embedding, the pipeline's per-chunk lists and hooks keep naming the same one.
"""

import torch
import torch.nn as nn
from torch.utils import swap_tensors

MODEL = "model/"


class InitialWeights:
    def __init__(self, model, seed):
        """model: the canonical GPT (built on the meta device, or with values); seed:
        trainer.seed."""
        self.model_class = type(model)
        self.specs = {n: (shape, model.init_rule(n)) for n, shape in model.canonical_shapes().items()}
        self.seed = seed
        self._last = (None, None)  # (name, whole tensor): one parameter at a time

    def read_full(self, key):
        name = key[len(MODEL):]
        if self._last[0] != name:
            self._last = (None, None)  # let the previous one go before drawing the next
            shape, rule = self.specs[name]
            self._last = (name, self.model_class.initial_value(name, shape, rule, self.seed))
        return self._last[1]

    def read_box(self, key, box):
        return self.read_full(key)[tuple(slice(a, b) for a, b in box)]


class GivenWeights:
    def __init__(self, state):
        """state: {canonical name: full tensor}."""
        self.state = state

    def read_full(self, key):
        return self.state[key[len(MODEL):]]

    def read_box(self, key, box):
        return self.read_full(key)[tuple(slice(a, b) for a, b in box)]


@torch.no_grad()
def to_meta(module):
    """Move a module with values to the meta device; returns its values as GivenWeights
    (canonical names: call it before any dimension cuts the module)."""
    state = {}
    for name, p in module.named_parameters():
        state[name] = p.detach()  # keeps the old storage alive after the swap
        swap_tensors(p, nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad))
    return GivenWeights(state)


@torch.no_grad()
def allocate(module, device):
    """Every meta parameter of `module` becomes zeros on `device` (the same Parameter
    objects). Zeros, not garbage: padding that no canonical box covers (a padded
    vocabulary's rows) must hold zeros."""
    for p in module.parameters():
        if p.device.type == "meta":
            swap_tensors(p, nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device),
                                         p.requires_grad))


@torch.no_grad()
def swap_in(param, view):
    """`param` (meta or not) becomes a Parameter over `view` (of fsdp's flat unit), with a
    version counter of its own, as `param.data = view` gives: stage 3 gathers into the
    unit again before backward, which must not look like an in-place change of the
    parameters autograd saved. (`.data =` cannot leave the meta device: swap first.)"""
    if param.device != view.device:
        swap_tensors(param, nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device),
                                         param.requires_grad))
    param.data = view
