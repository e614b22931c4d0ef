"""`fsdp`: ZeRO stages 1-3 over the data-parallel group, on flat sharding units.

Units are the transformer blocks plus a root unit (embeddings, final LayerNorm,
tied LM head), each one flat padded buffer of which every rank owns 1/N
(parallel/fsdp_units.py). Each rank's AdamW steps only on its own shard.

Per optimizer step each rank communicates (Φ = parameters, k = grad_accum):
- stage 1: one reduce-scatter of every unit's full (locally accumulated)
  gradient, launched from the gradient hooks of the last micro-step, since a
  rank steps only on its own shard; after the step, one all-gather per unit of
  the updated shards (model and full gradients replicated in memory, optimizer
  state sharded). On the wire that is DDP's volume: 2(N-1)/N x 4 bytes x Φ.
- stage 2: like stage 1, but each micro-step reduce-scatters a unit's gradient
  the moment its last parameter's gradient is ready (overlapping the rest of
  backward), and only the 1/N gradient shard is kept.
- stage 3: parameters sharded too. A unit is all-gathered just before its
  forward, freed after it (`reshard_after_forward`), gathered again just
  before its backward, and its gradients are reduce-scattered as soon as they
  are ready. With `prefetch`, the next unit's all-gather is launched before
  the current unit computes, in forward and in backward. Per micro-step about
  1.5x a DDP all-reduce's bytes.
- all stages: one scalar all-reduce for the global gradient norm.
"""

import torch
import torch.distributed as dist

from parallel.comm import CommCounter
from parallel.fsdp_units import FlatUnit
from parallel.strategy import Strategy


class FSDP(Strategy):
    def __init__(self, model, grid, cfg):
        super().__init__(model, grid, cfg)
        self.stage, self.prefetch = cfg.zero_stage, cfg.prefetch
        self.reshard_after_forward = cfg.reshard_after_forward
        self.module = model.to(self.device)
        self.canonical = dict(self.module.named_parameters())  # the tied weight once
        groups = self.module.optim_groups(0.0)
        group_of = {n: g for g, grp in enumerate(groups) for n in grp["params"]}
        N, r = grid.dp_size, grid.dp_rank

        # one unit per block, then the root: everything outside the blocks (wte is
        # lm_head.weight, so the tied weight is one parameter of one unit)
        names_per_block = [[f"transformer.h.{i}.{n}" for n, _ in block.named_parameters()]
                           for i, block in enumerate(self.module.transformer.h)]
        in_blocks = {n for names in names_per_block for n in names}
        root = [n for n in self.canonical if n not in in_blocks]
        self.units = [FlatUnit([(n, self.canonical[n]) for n in names], group_of, r, N,
                               self.stage, grid.dp_group)
                      for names in names_per_block + [root]]
        self.blocks, self.root = self.units[:-1], self.units[-1]
        self._comm = self.comm  # eval switches to an uncounted one
        self._pending = []      # (work, finish) of launched gradient collectives
        self._register_grad_hooks()
        if self.stage == 3:
            self._register_unit_hooks()

    # ------------------------------------------------ hooks: gradients ready -> reduce

    def _register_grad_hooks(self):
        for unit in self.units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, unit=unit: self._grad_ready(unit))

    def _grad_ready(self, unit):
        self._ready[unit] += 1
        if self._ready[unit] == len(unit.params):
            self._reduce(unit)

    def _reduce(self, unit):
        self._ready[unit] = -1  # done for this micro-step
        if self.stage == 1:
            if self._last_micro:  # earlier micro-steps accumulate locally (no_sync)
                self._pending.append(unit.reduce_scatter_full_grad(self._comm))
            return
        self._pending.append(unit.reduce_scatter_grads(self._comm))
        if self.stage == 3:
            unit.free()  # its backward is over
        while self._pending and self._pending[0][0].is_completed():  # free full grads early
            work, finish = self._pending.pop(0)
            work.wait()
            finish()

    def _finish_backward(self):
        """After loss.backward(): reduce units whose hooks did not all fire (a
        parameter without gradient counts as zeros), then wait for everything."""
        for unit in self.units:
            if self._ready[unit] != -1:
                self._reduce(unit)
        for work, finish in self._pending:
            work.wait()
            finish()
        self._pending = []

    # ------------------------------------------------ hooks: stage 3 gathers and frees

    def _register_unit_hooks(self):
        self.module.register_forward_pre_hook(lambda m, a: self._pre_forward(self.root, 0))
        self.module.register_forward_hook(self._post_forward_root)
        for i, block in enumerate(self.module.transformer.h):
            block.register_forward_pre_hook(lambda m, a, i=i: self._pre_forward(self.blocks[i], i + 1))
            block.register_forward_hook(lambda m, a, out, i=i: self._post_forward_block(i, out))

    def _pre_forward(self, unit, next_block):
        unit.start_gather(self._comm)  # no-op if prefetched
        if self.prefetch and next_block < len(self.blocks):
            self.blocks[next_block].start_gather(self._comm)  # overlaps this unit's compute
        unit.wait_gather(self._comm)

    def _post_forward_block(self, i, out):
        if torch.is_grad_enabled() and out.requires_grad:
            if self.reshard_after_forward:
                self.blocks[i].free()
            out.register_hook(lambda grad: self._pre_backward(i))
        else:
            self.blocks[i].free()

    def _post_forward_root(self, module, args, out):
        logits = out[0]
        if torch.is_grad_enabled() and logits.requires_grad:
            # the root stays gathered: the LM head's backward comes first, the
            # embedding's last; prefetch the last block behind the LM head
            if self.prefetch and self.blocks:
                logits.register_hook(lambda grad: self.blocks[-1].start_gather(self._comm))
        else:
            self.root.free()

    def _pre_backward(self, i):
        self.blocks[i].start_gather(self._comm)  # no-op if prefetched or never freed
        if self.prefetch and i > 0:
            self.blocks[i - 1].start_gather(self._comm)
        self.blocks[i].wait_gather(self._comm)

    # ------------------------------------------------ the step

    def configure_optimizer(self, tcfg):
        groups = self.module.optim_groups(tcfg.weight_decay)
        self.group_names = [g["params"] for g in groups]
        # pieces of every unit's shard, by optimizer group; the order defines the
        # optimizer's parameter indices
        self.pieces = [[(u, a, b, t) for u in self.units for g, a, b, t in u.pieces if g == gi]
                       for gi in range(len(groups))]
        self.optimizer = torch.optim.AdamW(
            [{"params": [t for *_, t in ps], "weight_decay": g["weight_decay"]}
             for ps, g in zip(self.pieces, groups)],
            lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay)

    def forward_backward(self, micro_batches):
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            self._ready = {u: 0 for u in self.units}
            self._last_micro = i == len(micro_batches) - 1
            _, loss = self.module(x.to(self.device), y.to(self.device))
            (loss / len(micro_batches)).backward()
            self._finish_backward()
            total += loss.detach()
        return self.dp_mean(total / len(micro_batches))

    @torch.no_grad()
    def eval_loss(self, x, y):
        self._comm = CommCounter()  # evaluation's gathers are not training traffic
        self.module.eval()
        try:
            _, loss = self.module(x.to(self.device), y.to(self.device))
        finally:
            self.module.train()
            self._comm = self.comm
        return self.dp_mean(loss)

    def _grads(self):
        return [t.grad for ps in self.pieces for *_, t in ps]  # shards only: no padding

    def clip_grad_norm_(self, max_norm):
        grads = self._grads()
        sq = torch.zeros((), device=self.device)
        for g in grads:
            sq += g.pow(2).sum()
        self.comm.all_reduce(sq, group=self.grid.dp_group)  # sum of squares over all shards
        norm = sq.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for g in grads:
            g.mul_(coef)
        return norm.item()

    def optimizer_step(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.stage < 3:  # replicated parameters: everyone's updated shard to everyone
            for work in [u.refresh_full(self.comm) for u in self.units]:
                work.wait()
        opt = sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                  for v in s.values() if torch.is_tensor(v))
        self.last_state_bytes = opt + sum(u.resident_bytes() for u in self.units)
        for u in self.units:
            u.zero_grads()

    def state_bytes(self):
        """Max over the dp group (not training traffic, so not counted): the
        trainer logs rank 0's value, and it should be the worst rank's."""
        value = torch.tensor([self.last_state_bytes], dtype=torch.int64, device=self.device)
        if self.grid.dp_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.grid.dp_group)
        return int(value.item())

    # ------------------------------------------------ canonical snapshots

    def _gather(self, unit, shard):
        """A flat buffer from every rank's shard (snapshots only: not counted)."""
        out = torch.empty(unit.world * unit.shard_size, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(out, shard.contiguous(), group=self.grid.dp_group)
        return out

    @torch.no_grad()
    def state_dict(self):
        state = {}
        for u in self.units:
            state.update(u.unflatten(u.full if self.stage < 3 else self._gather(u, u.shard)))
        return {n: state[n] for n in self.canonical}

    # ------------------------------------------------ sharded snapshots

    def _owned_ranges(self):
        """(unit, name, shape, a, b): this rank's shard covers elements [a, b) of the
        flattened canonical parameter `name` (never padding)."""
        for u in self.units:
            for i, (name, shape) in enumerate(zip(u.names, u.shapes)):
                lo, hi = max(u.offsets[i], u.lo), min(u.offsets[i + 1], u.hi)
                if lo < hi:
                    yield u, name, tuple(shape), lo - u.offsets[i], hi - u.offsets[i]

    def _optim_slice(self, u, name, a, b):
        """The AdamW state tensors of the piece holding [a, b) of `name`, sliced to it."""
        start = u.offsets[u.names.index(name)] + a - u.lo  # shard coordinates
        for _, pa, pb, t in u.pieces:
            if pa <= start and start + (b - a) <= pb:
                return self.optimizer.state[t], start - pa
        raise AssertionError(f"{name}[{a}:{b}] lies in no optimizer piece")

    @torch.no_grad()
    def shard_pieces(self):
        """Each rank writes the ranges its shard owns: parameters and AdamW state.
        The step counter is per parameter; the owner of element 0 writes it."""
        out = []
        for u, name, shape, a, b in self._owned_ranges():
            start = u.offsets[u.names.index(name)] + a - u.lo
            out.append((f"model/{name}", shape, a, u.shard[start:start + b - a]))
            state, at = self._optim_slice(u, name, a, b)
            for field in ("exp_avg", "exp_avg_sq"):
                if field in state:
                    out.append((f"optim/{name}/{field}", shape, a, state[field][at:at + b - a]))
            if a == 0 and "step" in state:
                out.append((f"optim/{name}/step", (), 0, state["step"].reshape(1)))
        return out

    @torch.no_grad()
    def load_shards(self, reader):
        """Read only this rank's ranges (stages 1-2 also need the replicated parameters)."""
        for u in self.units:
            if self.stage < 3:
                u.full.copy_(u.flatten({n: reader.read_full(f"model/{n}") for n in u.names},
                                       self.device))
        for u, name, shape, a, b in self._owned_ranges():
            start = u.offsets[u.names.index(name)] + a - u.lo
            if self.stage == 3:
                u.shard[start:start + b - a] = reader.read(f"model/{name}", a, b - a)
            piece = next(t for _, pa, pb, t in u.pieces if pa <= start < pb)
            state = self.optimizer.state[piece]
            if not state:  # a fresh piece: full-size buffers, filled range by range
                state["step"] = reader.read(f"optim/{name}/step").reshape(()).clone()
                for field in ("exp_avg", "exp_avg_sq"):
                    state[field] = torch.zeros_like(piece)
            _, at = self._optim_slice(u, name, a, b)
            for field in ("exp_avg", "exp_avg_sq"):
                state[field][at:at + b - a] = reader.read(f"optim/{name}/{field}", a, b - a)
