"""What PyTorch's DTensor references (torch_fsdp, torch_tp) share: their state, in full.

A reference only, so simple: snapshots and state_dict are full canonical tensors, rank r
writing every world-th key, and a load keeps this rank's part of each full tensor it
reads (our own strategies write and read only their regions: parallel/placement.py).
state_bytes counts the tensors' local parts.
"""

import torch
from torch.distributed.tensor import DTensor

from checkpoint.canonical import check_state_names, optimizer_state_from
from parallel.data_parallel.replicated import ReplicatedStrategy


def local_part(t):
    return t.to_local() if isinstance(t, DTensor) else t


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


class DTensorReference(ReplicatedStrategy):
    """Replicas whose parameters PyTorch made DTensors; a subclass says how a canonical
    tensor becomes this rank's part (`local`)."""

    replaces = ("state_dict", "shard_pieces", "load_shards")

    def canonical(self, name, t):
        """`t` (parameter `name` or one of its AdamW states) as a canonical CPU tensor (a
        padded vocabulary's rows cut off: placement.Placement.leading_rows)."""
        t, shape = full(t.detach()).cpu(), self.placements[name].shape
        return t[:shape[0]] if shape and shape[0] != t.size(0) else t

    def padded(self, name, canonical):
        """A canonical tensor of parameter `name` with the zero rows its local tensor pads."""
        rows = self.placements[name].local_shape[0] - canonical.size(0) if canonical.dim() else 0
        return torch.cat([canonical, canonical.new_zeros(rows, *canonical.shape[1:])]) if rows \
            else canonical

    def local(self, name, canonical, like):
        """This rank's part of `canonical`, held as `like` (parameter `name`) is."""
        raise NotImplementedError

    def drop_gradients(self):
        tensors = [t for p in self.module.parameters() for t in (p, p.grad) if t is not None]
        tensors += [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        held = sum(local_part(t).numel() * local_part(t).element_size() for t in tensors)
        self.optimizer.zero_grad(set_to_none=True)
        # offloaded (torch_fsdp): all of it in host memory (the device holds gathered units only)
        return (0, held) if self.cfg.offload else (held, 0)

    def state_dict(self):
        return {n: self.canonical(n, p).clone() for n, p in self.module.named_parameters()}

    def shard_pieces(self):
        tensors = {f"model/{n}": t for n, t in self.state_dict().items()}
        for name, p in self.named.items():
            for field, v in self.optimizer.state.get(p, {}).items():
                tensors[f"optim/{name}/{field}"] = v.cpu() if field == "step" else self.canonical(name, v)
        mine = sorted(tensors)[self.grid.rank::self.grid.world_size]
        return [(k, tuple(tensors[k].shape), 0, tensors[k].reshape(-1)) for k in mine]

    @torch.no_grad()
    def load_shards(self, reader):
        state = {n: reader.read_full(f"model/{n}") for n in self.named}
        check_state_names({n: self.placements[n] for n in self.named}, state, "snapshot model state")
        for name, p in self.named.items():
            local_part(p).copy_(local_part(self.local(name, self.padded(name, state[name]), p)))
        for name, fields in optimizer_state_from(reader).items():
            p = self.named[name]
            self.optimizer.state[p] = {k: v.reshape(()).clone() if k == "step" else
                                       self.local(name, self.padded(name, v), p)
                                       for k, v in fields.items()}
