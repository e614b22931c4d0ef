"""`fsdp`: ZeRO stages 1-3 over the data-parallel group, on flat sharding units.

Units are the transformer blocks plus a root unit (embeddings, final LayerNorm,
tied LM head), each one flat padded buffer of which every rank owns 1/N
(data_parallel/fsdp_units.py). Each rank's AdamW steps only on its own shard.
Under tensor parallelism the units hold this rank's TP-local parameters and
are sharded over its dp group only.

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
- all stages: one scalar all-reduce for the global gradient norm (over dp,
  and TP when tp > 1).
- `parallel.reduce_dtype=bf16`: the reduce-scatters send a bf16 copy of the
  gradient (half the bytes) and the averaged shard is added back in fp32;
  the parameter all-gathers stay fp32 (they carry the master weights).
- `parallel.dp_replicate=R` (hybrid sharding, data_parallel/hybrid.py): all of the
  above inside a replica group of N = dp x cp ranks (grid.shard_group), plus, once
  per step after the last backward, one all-reduce of each unit's gradient shard
  with the R-1 ranks holding the same shard (grid.dp_replicate_group).
- `parallel.offload=true` (data_parallel/offload.py): the shard's master weights,
  gradient and AdamW state in host memory, the step on the host; the same
  collectives, plus a device-host copy of each reduced gradient shard and one of
  each updated shard back.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist

from parallel.data_parallel.contract import DataParallel, build_adamw, sharded_group
from parallel.data_parallel.grad_hooks import on_grad_accumulated
from parallel.data_parallel.naive import REDUCE_DTYPES
from parallel import model_plan as plan
from parallel.data_parallel.fsdp_units import FlatUnit
from parallel.data_parallel.hybrid import ReplicaMean
from parallel.grid import SHARD_DIMS
from parallel.placement import Region, load_regions, writer_among


class UnitsTogether:
    """A block's units gathered and freed together (its dense part and its experts)."""

    def __init__(self, units):
        self.units = units

    def start_gather(self, comm):
        for u in self.units:
            u.start_gather(comm)

    def wait_gather(self, comm):
        for u in self.units:
            u.wait_gather(comm)

    def free(self):
        for u in self.units:
            u.free()


class FSDP(DataParallel):
    name = "fsdp"

    def __init__(self, local, grid, cfg):
        super().__init__(local, grid, cfg)
        self.stage, self.prefetch = cfg.zero_stage, cfg.prefetch
        self.reshard_after_forward = cfg.reshard_after_forward
        self.canonical = dict(self.module.named_parameters())  # TP-local; the tied weight once
        groups = self.module.optim_groups(0.0)
        group_of = {n: g for g, grp in enumerate(groups) for n in grp["params"]}
        # shards over the ranks that average gradients, within one replica group (HSDP)
        N, r = grid.shard_size, grid.shard_rank
        self.offload = cfg.offload

        # one unit per block (of this pipeline stage), then the root: everything outside
        # the blocks (the token embedding is the LM head's weight: one parameter of one
        # unit). Under pipeline parallelism the tied embedding gets a unit of its own, so
        # its shard is laid out alike on the first and the last stage (their gradients
        # are summed shard to shard).
        names_per_block = plan.block_parameter_names(self.module)
        in_blocks = {n for names in names_per_block for n in names}
        root = [n for n in self.canonical if n not in in_blocks]
        own = [[plan.TIED]] if self.pipeline and plan.TIED in root else []
        root = [n for n in root if [n] not in own]
        def unit(names, rank, size, group):
            return FlatUnit([(n, self.canonical[n]) for n in names], group_of, rank, size,
                            self.stage, group, self.device, cfg.offload)
        # expert parallelism: a block's experts are a unit of their own, sharded over
        # the ranks that hold the same experts (grid.expert_shard_group)
        per_block = []
        for names in names_per_block:
            experts = [n for n in names if self.placements[n].expert]
            per_block.append([unit([n for n in names if n not in experts], r, N, grid.shard_group)])
            if experts:
                per_block[-1].append(unit(experts, grid.expert_shard_rank, grid.expert_shard_size,
                                          grid.expert_shard_group))
                per_block[-1][-1].divisor = N  # every shard rank's tokens reach its experts
        self.units = [u for units in per_block for u in units] + [
            unit(names, r, N, grid.shard_group) for names in own + [root] if names]
        self.blocks = [units[0] if len(units) == 1 else UnitsTogether(units) for units in per_block]
        self.root = self.units[-1]
        for unit in self.units:  # one rank sends nothing: no rounding to bf16 either
            unit.reduce_dtype = REDUCE_DTYPES[cfg.reduce_dtype] if unit.world > 1 \
                else unit.full.dtype
        # HSDP: the mean of each gradient shard across the replica groups, once a step
        self.replicas = ReplicaMean(grid.dp_replicate_group, grid.dp_replicate_size, self.comm,
                                    self.device, REDUCE_DTYPES[cfg.reduce_dtype]) \
            if grid.dp_replicate_size > 1 else None
        self._chunk_units = self._units_per_chunk()
        self._regions = None
        self._ready = {}        # unit -> gradient hooks fired in the current backward
        self._pending = []      # (work, finish) of launched gradient collectives
        self._register_grad_hooks()
        if self.stage == 3:
            self._register_unit_hooks()
        with self.comm.uncounted():  # this rank's shard of the initial weights, as a load
            self.update(lambda: load_regions(self.regions(), None, local.init))

    # ------------------------------------------------ hooks: gradients ready -> reduce

    def _register_grad_hooks(self):
        self._unit_of = {}
        for unit in self.units:
            for p in unit.params:
                self._unit_of[p] = unit
                on_grad_accumulated(p, self._grad_ready)  # held weakly (grad_hooks.py)

    def _grad_ready(self, param):
        unit = self._unit_of[param]
        if unit not in self._ready:  # a hook outside any backward_scope: not ours to count
            return
        self._ready[unit] += 1
        if self._ready[unit] == len(unit.params):
            self._reduce(unit)

    def _reduce(self, unit):
        self._ready[unit] = -1  # done for this micro-step
        if self.stage == 1:
            if self._last_micro:  # earlier micro-steps accumulate locally (no_sync)
                self._pending.append(unit.reduce_scatter_full_grad(self.comm))
            return
        self._pending.append(unit.reduce_scatter_grads(self.comm))
        if self.stage == 3:
            unit.free()  # its backward is over
        while self._pending and self._pending[0][0].is_completed():  # free full grads early
            work, finish = self._pending.pop(0)
            work.wait()
            finish()

    def _finish_backward(self, units):
        """After a backward: reduce units whose hooks did not all fire (a parameter
        without gradient counts as zeros), then wait for everything."""
        for unit in units:
            if self._ready[unit] != -1:
                self._reduce(unit)
        for work, finish in self._pending:
            work.wait()
            finish()
        self._pending = []
        for unit in units:  # offload: this backward's gradient shards, added on the host
            unit.land_grads()

    def sync_gradients(self):
        """HSDP, after the step's last backward: each unit's gradient shard (accumulated
        over the micro-steps) averaged with its replicas', all launched, then waited."""
        if self.replicas is None:
            return
        launched = [self.replicas.start(u.grad_shard, staged=self.offload) for u in self.units]
        for work, finish in launched:
            work.wait()
            finish()

    # ------------------------------------------------ hooks: stage 3 gathers and frees

    def _register_unit_hooks(self):
        self.module.register_forward_pre_hook(lambda m, a: self._pre_forward(self.root, 0))
        self.module.register_forward_hook(self._post_forward_root)
        for i, (_, block) in enumerate(plan.blocks(self.module)):
            block.register_forward_pre_hook(lambda m, a, i=i: self._pre_forward(self.blocks[i], i + 1))
            block.register_forward_hook(lambda m, a, out, i=i: self._post_forward_block(i, out))

    def _pre_forward(self, unit, next_block):
        unit.start_gather(self.comm)  # no-op if prefetched
        if self.prefetch and next_block < len(self.blocks):
            self.blocks[next_block].start_gather(self.comm)  # overlaps this unit's compute
        unit.wait_gather(self.comm)

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
                logits.register_hook(lambda grad: self.blocks[-1].start_gather(self.comm))
        else:
            self.root.free()

    def _pre_backward(self, i):
        self.blocks[i].start_gather(self.comm)  # no-op if prefetched or never freed
        if self.prefetch and i > 0:
            self.blocks[i - 1].start_gather(self.comm)
        self.blocks[i].wait_gather(self.comm)

    # ------------------------------------------------ the step

    def build_optimizer(self, tcfg):
        groups = self.module.optim_groups(tcfg.weight_decay)
        # pieces of every unit's shard, by optimizer group; the order defines the
        # optimizer's parameter indices
        self.pieces = [[(u, a, b, t) for u in self.units for g, a, b, t in u.pieces if g == gi]
                       for gi in range(len(groups))]
        # offloaded pieces are host tensors: torch's fused CPU AdamW steps on them
        self.optimizer = build_adamw([{"params": [t for *_, t in ps], "weight_decay": g["weight_decay"]}
                                      for ps, g in zip(self.pieces, groups)],
                                     tcfg, **({"fused": True} if self.offload else {}))

    def _units_per_chunk(self):
        """{pipeline chunk (None without a pipeline): the units its backward touches}."""
        if self.pipeline is None:
            return {None: self.units}
        per_chunk = {c: [u for u in self.units if any(n.startswith(p) for n in u.names for p in prefixes)]
                     for c, prefixes in self.pipeline.chunk_units().items()}
        if self.stage == 1:
            # stage 1 reduce-scatters a unit's step gradient once, into a shard that is a
            # view of that gradient: a unit two chunks of this rank share (zbv's rank 0:
            # the embedding and the LM head's) is reduced in the scope of the chunk whose
            # backward ends last, when all of its gradient is in
            order = self.pipeline.chunks_by_last_backward()
            for c in per_chunk:
                later = order[order.index(c) + 1:]
                per_chunk[c] = [u for u in per_chunk[c] if not any(u in per_chunk[d] for d in later)]
        return per_chunk

    @contextmanager
    def backward_scope(self, chunk, last):
        """Count gradient hooks per unit during one backward; units whose hooks did not
        all fire are reduced after it (a parameter without gradient counts as zeros)."""
        units = self._chunk_units[chunk]
        for u in self.units:  # every unit at once: a chunk's backward may reach a unit
            u.allocate_grads()  # another chunk's scope reduces (stage 1 under zbv)
        self._ready = {u: 0 for u in units}
        self._last_micro = last
        yield
        self._finish_backward(units)

    def norm_group(self):
        # gradient elements differ across the shards, stages and TP ranks (and are the
        # same on every replica group: counted once)
        return sharded_group(self.grid, *SHARD_DIMS, "pp", "tp")

    @torch.no_grad()
    def update(self, write):
        """write(): AdamW's step on this rank's shards, or a load of them (a snapshot, the
        initial weights). Offload: the last copy of the master weights to the device must
        be done first, and the new ones go back after; stages 1-2 then all-gather everyone's
        shard into the replicated parameters."""
        for u in self.units:
            u.before_update()
        write()
        for u in self.units:
            u.push_params()
        if self.stage < 3:
            for work in [u.refresh_full(self.comm) for u in self.units]:
                work.wait()

    def drop_gradients(self):
        opt = sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                  for v in s.values() if torch.is_tensor(v))
        device = sum(u.device_bytes() for u in self.units) + (0 if self.offload else opt)
        host = sum(u.host_bytes() for u in self.units) + (opt if self.offload else 0)
        for u in self.units:
            u.zero_grads()
        return device, host

    # ------------------------------------------------ what this rank holds, canonically

    def _owned_ranges(self):
        """(unit, name, a, b): this rank's shard covers elements [a, b) of the flattened
        local parameter `name` (never padding)."""
        for u in self.units:
            for i, name in enumerate(u.names):
                lo, hi = max(u.offsets[i], u.lo), min(u.offsets[i + 1], u.hi)
                if lo < hi:
                    yield u, name, lo - u.offsets[i], hi - u.offsets[i]

    def regions(self):
        """The parts of this rank's shard, one per parameter it touches, each inside one
        optimizer piece. A tensor TP does not split is the same on every TP rank (same
        unit layout): one TP rank, spread by name, writes it."""
        if self._regions is None:
            g, self._regions = self.grid, []
            for u, name, a, b in self._owned_ranges():
                start = u.offsets[u.names.index(name)] + a - u.lo  # shard coordinates
                _, pa, _, piece = next(p for p in u.pieces if p[1] <= start < p[2])
                placement = self.placements[name]
                writes = ((not placement.tp_replicated
                           or writer_among(name, g.tp_size) == g.tp_rank)
                          and placement.tied != "last"
                          # HSDP: of the replica groups' identical shards, one writes
                          and writer_among(name, g.dp_replicate_size) == g.dp_replicate_rank)
                self._regions.append(Region(placement, a, b, piece, start - pa, writes=writes,
                                            in_norm=placement.counted_in_norm(g.tp_rank)))
        return self._regions
