"""Where each canonical tensor lives on this rank: the one description that
snapshots, state_dict() gathering and the global gradient norm read (state_bytes
is measured instead: the bytes this rank's parameters, gradients and optimizer
state really occupy; the benchmark's per-rank parameter split reads placements).

Two layers, one per kind of sharding:

- `Placement` (one per parameter, made by tensor parallelism, or the identity
  without it): which part of the canonical (single-device) tensor this rank's
  *local* parameter holds. The local tensor is the canonical one cut along
  `dim` into `pieces` (canonical start, local start, length) -- a column-
  parallel `c_attn` holds three pieces, the q, k and v rows of its heads --
  plus, for a padded vocabulary, rows that belong to no canonical tensor.
  It also says whether the tensor is the same on every TP rank (replicated),
  whether, under sequence parallelism, each TP rank holds only a partial
  sum of its gradient, and whether it is one of the two pipeline stages'
  copies of the tied embedding (the first stage's copy is the one counted).
- `Region` (made by the data-parallel strategy): a flat range of one local
  parameter that this rank holds, where it sits in the tensor the optimizer
  steps on, and which replica writes it to snapshots. A replicated strategy
  has one region per parameter; `fsdp` has the parts of its flat shard.

`Region.canonical_parts()` turns a region into canonical boxes (see
checkpoint/boxes.py), each with the flat positions of its elements in the
region; everything that reads or writes canonical state goes through it.
"""

import zlib
from dataclasses import dataclass

import torch

from checkpoint.boxes import box_shape, first_and_end, flat_range_boxes, is_run, strides


@dataclass(frozen=True)
class Placement:
    name: str                  # canonical name, as GPT.named_parameters() says it
    shape: tuple               # canonical (single-device) shape
    local_shape: tuple         # what this rank's module holds
    dim: int = None            # the dimension TP cuts; None = the whole tensor
    pieces: tuple = ()         # ((canonical start, local start, length), ...) along dim
    tp_replicated: bool = False  # the same tensor on every TP rank
    partial_grad: bool = False   # sequence parallelism: gradients are partial sums over TP
    tied: str = None             # pipeline: "first"/"last" stage's copy of the tied embedding
    expert: bool = False         # expert parallelism: a run of experts, averaged over the
                                 # expert-data-parallel group (grid.expert_grad_group)

    def counted_in_norm(self, tp_rank):
        """Whether this rank's copy counts in the global gradient norm: of identical
        copies, TP rank 0's, and the first pipeline stage's of the tied embedding."""
        return (not self.tp_replicated or tp_rank == 0) and self.tied != "last"

    @staticmethod
    def whole(name, shape, tp_replicated=False, partial_grad=False):
        shape = tuple(shape)
        return Placement(name, shape, shape, tp_replicated=tp_replicated, partial_grad=partial_grad)

    @staticmethod
    def leading_rows(name, shape, local_shape):
        """The canonical tensor `shape` is the local one's first rows, the rest pad it (a
        padded vocabulary, model.vocab_pad_to); whole when the shapes agree."""
        shape, local_shape = tuple(shape), tuple(local_shape)
        if shape == local_shape:
            return Placement.whole(name, shape)
        return Placement(name, shape, local_shape, 0, ((0, 0, shape[0]),))

    def canonical_boxes(self, local_box):
        """Cut a box of the local tensor into [(canonical box, local sub-box)]; rows of
        padding (in no piece) are dropped."""
        if self.dim is None:
            return [(local_box, local_box)]
        out, (lo, hi) = [], local_box[self.dim]
        for canon_start, local_start, length in self.pieces:
            a, b = max(lo, local_start), min(hi, local_start + length)
            if a < b:
                sub = local_box[:self.dim] + ((a, b),) + local_box[self.dim + 1:]
                move = canon_start - local_start
                canon = local_box[:self.dim] + ((a + move, b + move),) + local_box[self.dim + 1:]
                out.append((canon, sub))
        return out


def _flat_index(shape, box, base):
    """Flat positions of `box`'s elements in a tensor of `shape`, minus `base`: a slice
    when they form one run, else an index tensor (row-major order of the box)."""
    first, end = first_and_end(shape, box)
    if is_run(shape, box):
        return slice(first - base, end - base)
    idx = torch.zeros((), dtype=torch.long)
    for (a, b), s in zip(box, strides(shape)):
        idx = idx.unsqueeze(-1) + torch.arange(a, b) * s
    return (idx - base).reshape(-1)


@dataclass
class Region:
    placement: Placement
    start: int                 # flat elements [start, stop) of the local parameter
    stop: int
    opt_param: torch.Tensor    # the tensor the optimizer steps on, which holds them
    opt_offset: int            # flat position of `start` in opt_param
    writes: bool               # this replica writes the region to snapshots
    in_norm: bool              # this replica counts it in the global gradient norm

    def values(self, t=None):
        """Flat view of the region in `t` (default: the parameter; or a gradient or an
        optimizer-state tensor shaped like opt_param)."""
        t = self.opt_param if t is None else t
        return t.view(-1)[self.opt_offset:self.opt_offset + self.stop - self.start]

    def canonical_parts(self):
        """[(canonical box, index into values())] covering the region."""
        p, out = self.placement, []
        for local_box in flat_range_boxes(p.local_shape, self.start, self.stop):
            for canon, sub in p.canonical_boxes(local_box):
                out.append((canon, _flat_index(p.local_shape, sub, self.start)))
        return out


def writer_among(name, replicas):
    """Which of `replicas` identical copies writes `name`: spread by a stable hash."""
    return zlib.crc32(name.encode()) % replicas


# ---------------------------------------------------------------- canonical state through regions

OPTIM_FIELDS = ("exp_avg", "exp_avg_sq", "momentum_buffer")  # AdamW's moments, Muon's momentum


def state_fields(optimizer, param) -> tuple:
    """The state tensors shaped like `param` that its optimizer keeps: AdamW's moments, or
    what a composite optimizer (optimizers/muon.py) says for the part that steps it."""
    fields = getattr(optimizer, "state_fields", None)
    return fields(param) if fields is not None else OPTIM_FIELDS[:2]


@torch.no_grad()
def snapshot_pieces(regions, optimizer, with_optimizer=True):
    """[(key, canonical shape, box, tensor)] this rank writes. The step counter (AdamW's,
    Muon's) is one scalar per canonical parameter: the writer of its first element writes it."""
    out = []
    for r in regions:
        if not r.writes:
            continue
        name, shape = r.placement.name, r.placement.shape
        state = optimizer.state.get(r.opt_param, {}) if with_optimizer else {}
        for box, idx in r.canonical_parts():
            out.append((f"model/{name}", shape, box, r.values()[idx].reshape(box_shape(box))))
            for field in OPTIM_FIELDS:
                if field in state:
                    out.append((f"optim/{name}/{field}", shape, box,
                                r.values(state[field])[idx].reshape(box_shape(box))))
            if "step" in state and all(a == 0 for a, _ in box):
                out.append((f"optim/{name}/step", (), (), state["step"].reshape(())))
    return out


@torch.no_grad()
def load_regions(regions, optimizer, reader):
    """Fill every region this rank holds (every replica reads) from a snapshot, optimizer
    state included; a fresh optimizer gets its state tensors created here. optimizer
    None: the model only (the initial weights, parallel/initial.py)."""
    for r in regions:
        name = r.placement.name
        if optimizer is None:
            for box, idx in r.canonical_parts():
                r.values()[idx] = reader.read_box(f"model/{name}", box).reshape(-1).to(r.opt_param)
            continue
        state = optimizer.state[r.opt_param]
        stepped = _holds(reader, f"optim/{name}/step")  # the writer's AdamW had stepped
        if stepped:
            step = reader.read_box(f"optim/{name}/step", ()).reshape(()).clone()
            if optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"):
                step = step.to(r.opt_param.device)  # their kernels keep it beside the parameter
            if not state:
                for field in state_fields(optimizer, r.opt_param):
                    state[field] = torch.zeros_like(r.opt_param)
            state["step"] = step  # also into a live state: a replica group behind takes it
        else:  # every step so far skipped (fp16 overflows, non-finite gradients): no state
            state.clear()
        for box, idx in r.canonical_parts():
            r.values()[idx] = reader.read_box(f"model/{name}", box).reshape(-1).to(r.opt_param)
            for field in state_fields(optimizer, r.opt_param) if stepped else ():
                r.values(state[field])[idx] = reader.read_box(
                    f"optim/{name}/{field}", box).reshape(-1).to(r.opt_param)


def _holds(reader, key) -> bool:
    """Whether the snapshot (or a peer's state, which has no index: assumed) holds `key`."""
    keys = getattr(reader, "keys", None)
    return keys is None or key in keys()


def by_device(tensors) -> dict:
    """{device: its tensors}, in the order first seen: foreach kernels need one device per
    launch, and with parallel.offload gradients live in host memory while the device computes."""
    out = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


def grad_norm_squared(regions, device):
    """Sum of squared gradient elements over the regions this rank counts, as a 0-d tensor
    on `device` (the compute device, where the norm's all-reduce and the trainer's read
    of it run): one foreach norm over the gradients of each device they live on (one
    kernel launch, not one per region), their squares summed there, and each device's sum
    moved to `device`. With parallel.offload the gradients are host tensors while the
    device computes: a sum left on the host would reach NCCL (which refuses it) or meet the
    device's loss. All on `device` (no offload, or a CPU run): one foreach norm, no copy."""
    views = by_device(r.values(r.opt_param.grad) for r in regions
                      if r.in_norm and r.opt_param.grad is not None)
    sums = [torch.stack(torch._foreach_norm(vs)).square().sum().to(device) for vs in views.values()]
    if not sums:
        return torch.zeros((), device=device)
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()
