"""Sharding units for `fsdp`: one flat, padded fp32 buffer per unit, 1/N of it per rank.

A unit (a transformer block, or the root: embeddings, final LayerNorm and the
tied LM head) lays its parameters end to end in `full`, a flat buffer padded
to N * S elements (N = dp size, S = shard size). Rank r owns full[r*S:(r+1)*S].
The module's parameters are views into `full`, so the model code runs
unchanged on whatever `full` holds:

- stages 1-2: `full` stays allocated; `shard` is a view of this rank's slice,
  so the optimizer updates the model in place and an all-gather refreshes it;
- stage 3: `shard` is the only persistent copy. `gather` re-allocates the
  storage of `full` and all-gathers into it; `free` resizes that storage to 0.
  Resizing the *storage* (not rebinding tensors) also empties every view
  autograd saved for backward, so memory really goes, and a re-gather before
  backward refills all of them at once (FSDP2 does the same).

Parameters are ordered by optimizer group (decayed matrices first), so this
rank's shard intersects each group in one contiguous `piece`: the optimizer
steps on those pieces with torch's own AdamW, element by element the same
math as one process, and padding is never part of any piece.

With `parallel.offload` the pieces are views of a host copy of the shard (`host`,
data_parallel/offload.py), the master weights, and so is the gradient they read:
reduced gradient shards go to the host as they arrive, the updated shard comes back
to the device's `shard` after the step (`push_params`).
"""

import torch

from parallel.data_parallel.offload import HostShard
from parallel.initial import swap_in

FREED, GATHERING, GATHERED = "freed", "gathering", "gathered"


class FlatUnit:
    def __init__(self, named_params, group_of, rank, world, stage, dp_group, device, offload=False):
        """named_params: [(canonical name, nn.Parameter)], on the meta device (or with
        values, which are not read); group_of: name -> optimizer group index (from
        GPT.optim_groups). Allocates zeros for what this rank holds; the strategy fills
        them (FSDP.__init__: its shard, then stages 1-2 gather the rest). offload:
        the shard's master weights and gradient in host memory."""
        order = sorted(named_params, key=lambda np_: group_of[np_[0]])  # stable within a group
        self.names = [n for n, _ in order]
        self.params = [p for _, p in order]
        self.shapes = [p.shape for p in self.params]
        numels = [p.numel() for p in self.params]
        self.offsets = [sum(numels[:i]) for i in range(len(numels) + 1)]
        self.numel, self.world, self.stage, self.group = self.offsets[-1], world, stage, dp_group
        # the reduced sum is divided by the ranks whose tokens it holds: the group's, but
        # for experts (FSDP: grid.shard_size, of which their group is 1 / ep)
        self.divisor = world
        self.shard_size = -(-self.numel // world)  # ceil: pad, never truncate
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size
        dtype = self.params[0].dtype

        # stage 3 holds a shard only: `full` is the storage the parameters view, freed
        # below before anything touches it (torch.empty: no page of it becomes resident)
        alloc = torch.zeros if stage < 3 else torch.empty
        self.full = alloc(world * self.shard_size, dtype=dtype, device=device)
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            swap_in(p, self.full[off:off + p.numel()].view(shape))  # tied weights: one param, one view

        if stage < 3:
            self.shard = self.full[self.lo:self.hi]
        else:
            self.shard = torch.zeros(self.shard_size, dtype=dtype, device=device)
        # what the optimizer steps on: the shard itself, or its host copy (offload)
        self.host = HostShard(self.shard_size, dtype, device) if offload else None
        self.master = self.host.shard if offload else self.shard
        self.full_grad = self.grad_shard = None  # allocate_grads, at the first backward
        self.state, self.work = GATHERED, None
        self.reduce_dtype = self.full.dtype  # parallel.reduce_dtype=bf16: reduce-scatter in bf16
        if stage == 3:
            self.free()

        # this rank's intersection with each optimizer group's range, in shard coordinates
        self.pieces = []  # (group index, start, end, tensor view of shard)
        for g in sorted(set(group_of[n] for n in self.names)):
            idx = [i for i, n in enumerate(self.names) if group_of[n] == g]
            a = max(self.offsets[idx[0]], self.lo) - self.lo
            b = min(self.offsets[idx[-1] + 1], self.hi) - self.lo
            if a < b:
                self.pieces.append((g, a, b, self.master[a:b]))

    def allocate_grads(self):
        """Gradient memory, once, when the first backward needs it (a replica's autograd
        allocates its gradients then too: no strategy holds any at setup). Stage 1 keeps
        the full gradient, into whose views autograd accumulates; stages 2-3 the shard;
        with offload the shard's gradient is in host memory."""
        if self.grad_shard is not None:
            return
        if self.stage == 1:
            self.full_grad = torch.zeros_like(self.full)
            for p, off, shape in zip(self.params, self.offsets, self.shapes):
                p.grad = self.full_grad[off:off + p.numel()].view(shape)
        if self.host is not None:
            self.host.allocate_grad()
            self.grad_shard = self.host.grad
        elif self.stage == 1:
            self.grad_shard = self.full_grad[self.lo:self.hi]
        else:
            self.grad_shard = torch.zeros_like(self.shard)
        for _, a, b, piece in self.pieces:
            piece.grad = self.grad_shard[a:b]  # clipping and AdamW read it here

    # ------------------------------------------------ canonical <-> flat

    def flatten(self, by_name, device):
        """Canonical tensors -> one padded flat buffer (N * S) on `device`."""
        flat = torch.zeros(self.world * self.shard_size, dtype=self.params[0].dtype, device=device)
        for n, off, i in zip(self.names, self.offsets, range(len(self.names))):
            flat[off:self.offsets[i + 1]] = by_name[n].reshape(-1)
        return flat

    def unflatten(self, flat):
        """Padded flat buffer -> {canonical name: CPU tensor of the parameter's shape}."""
        return {n: flat[off:off + s.numel()].view(s).detach().cpu().clone()
                for n, off, s in zip(self.names, self.offsets, self.shapes)}

    # ------------------------------------------------ stage 3: gather / free the parameters

    def start_gather(self, comm):
        if self.state != FREED:
            return
        storage = self.full.untyped_storage()
        storage.resize_(self.full.numel() * self.full.element_size())
        self.work = comm.all_gather(self.full, self.shard, group=self.group, async_op=True)
        self.state = GATHERING

    def wait_gather(self, comm):
        """Make sure the parameters are here (gathering now if nobody prefetched them)."""
        self.start_gather(comm)
        if self.state == GATHERING:
            self.work.wait()
            self.work, self.state = None, GATHERED

    def free(self):
        if self.state == GATHERING:  # a prefetch nobody used: let it land first
            self.work.wait()
            self.work = None
        self.full.untyped_storage().resize_(0)
        self.state = FREED

    def refresh_full(self, comm):
        """Stages 1-2 after the optimizer step: everyone's updated shard into `full`.
        The input is a copy because it is a view of the output."""
        return comm.all_gather(self.full, self.shard.clone(), group=self.group, async_op=True)

    # ------------------------------------------------ gradients

    def reduce_scatter_grads(self, comm):
        """Stages 2-3: this unit's grads (zeros where a param got none) -> async
        reduce-scatter. Returns (work, finish): finish() adds the averaged shard
        into grad_shard once the work is done."""
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)
                 for p in self.params]
        pad = self.world * self.shard_size - self.numel
        flat = torch.cat(grads + [grads[0].new_zeros(pad)]).to(self.reduce_dtype)
        for p in self.params:
            p.grad = None  # the full gradient lives on only until the reduce-scatter is done
        out = torch.empty_like(self.shard, dtype=self.reduce_dtype)
        work = comm.reduce_scatter(out, flat, group=self.group, async_op=True)

        def finish(flat=flat):  # keeps `flat` alive until the collective is done
            if self.host is not None:  # added on the host once it has landed
                self.host.receive(out, self.divisor)
            else:
                self.grad_shard.add_(out.to(self.grad_shard.dtype).div_(self.divisor))
        return work, finish

    def reduce_scatter_full_grad(self, comm):
        """Stage 1, last micro-step: the accumulated full gradient (resident all step)
        -> async reduce-scatter; finish() puts the averaged shard into grad_shard, the
        only part clipping and AdamW read. The rest of full_grad keeps this rank's own
        sums until zero_grads: no all-reduce, since nobody steps on the other shards."""
        wire = self.full_grad.to(self.reduce_dtype)  # no copy in fp32
        out = torch.empty_like(self.shard, dtype=self.reduce_dtype)
        work = comm.reduce_scatter(out, wire, group=self.group, async_op=True)

        def finish(wire=wire):  # keeps `wire` alive until the collective is done
            if self.host is not None:  # into the host gradient (zeros) once it has landed
                self.host.receive(out, self.divisor)
            else:
                self.grad_shard.copy_(out.to(self.grad_shard.dtype).div_(self.divisor))
        return work, finish

    def land_grads(self):
        """Offload: after a backward, add what its reduce-scatters sent to the host."""
        if self.host is not None:
            self.host.land()

    def zero_grads(self):
        if self.full_grad is not None:
            self.full_grad.zero_()
        if self.grad_shard is not None and self.grad_shard is not self.full_grad:
            self.grad_shard.zero_()  # (stage 1 without offload: a view of full_grad)

    # ------------------------------------------------ offload: the master weights on the host

    def before_update(self):
        """The optimizer is about to write the master weights: the last copy of them to
        the device must be done reading them."""
        if self.host is not None:
            self.host.wait_pushed()

    def push_params(self):
        """Offload: the host's master weights (updated or loaded) to the device's shard,
        without waiting (stages 1-2 then all-gather it into `full`)."""
        if self.host is not None:
            self.host.push(self.shard)

    # ------------------------------------------------ what this rank holds

    def device_bytes(self):
        """Parameters (full or shard + whatever is gathered now) and the gradients on the
        device."""
        total = self.full.untyped_storage().nbytes()
        if self.stage == 3:
            total += self.shard.numel() * self.shard.element_size()
        if self.full_grad is not None:  # stage 1 (without offload its shard is a view of it)
            total += self.full_grad.numel() * self.full_grad.element_size()
        elif self.grad_shard is not None and self.host is None:
            total += self.grad_shard.numel() * self.grad_shard.element_size()
        if self.stage > 1:  # stray full gradients (there should be none at the end of a step)
            total += sum(p.grad.numel() * p.grad.element_size() for p in self.params
                         if p.grad is not None)
        return total

    def host_bytes(self):
        """The offloaded master weights and gradient (0 without offload)."""
        return self.host.nbytes() if self.host is not None else 0
