"""The process grid: world = dp_replicate x dp x pp x cp x tp, named dimensions from one list.

Built once in main.py and passed to whoever needs it; nothing deep inside
reads environment variables or global state. Rank r sits at the coordinates
of `torch.arange(world).view(*sizes)`, with DIMS from slowest- to
fastest-varying, so the ranks of one TP group are neighbours (same node), as
Megatron arranges them.

For each dimension d of DIMS the grid has `d_size`, `d_rank` and `d_group`
(grid.dp_size, grid.pp_rank, grid.tp_group, ...). Gradients are averaged over
GRAD_DIMS, the dimensions whose ranks hold the same parameters but see other
tokens: `grad_group`, `grad_size`, `grad_rank`. Expert parallelism (`ep`, not an axis:
carved out of the dp x cp ranks, as Megatron does) gets its groups in `carve_experts`. Data-parallel strategies use
only those, so a dimension that also splits data (context parallelism) joins
GRAD_DIMS here instead of changing each strategy.

The data-parallel ranks are dp_replicate x dp (DATA_DIMS: each reads its own rows of
the global batch, `data_rank` of `data_size`). dp_replicate is 1 unless hybrid
sharding (HSDP, `parallel.dp_replicate=R`) cuts them into R replica groups, slowest-
varying so that a group's ranks are neighbours (a node): ZeRO shards over the rest of
GRAD_DIMS (`shard_group`, `shard_size`, `shard_rank`), and the replicas of one shard
average it across groups over `dp_replicate_group`.
"""

import datetime
import hashlib
import math

import torch
import torch.distributed as dist

from errors import UserError
from parallel.comm import all_gather_single, checked_all_reduce

DIMS = ("dp_replicate", "dp", "pp", "cp", "tp")  # the grid's axes, slowest- to fastest-varying
DATA_DIMS = ("dp_replicate", "dp")  # the axes whose ranks read other rows of the global batch
GRAD_DIMS = DATA_DIMS + ("cp",)     # the axes gradients are averaged over (cp ranks see other tokens)
SHARD_DIMS = ("dp", "cp")           # the axes ZeRO shards over: GRAD_DIMS but the replicas
# the backend of a group that takes host tensors on a GPU run (group_over's host_tensors)
HOST_AND_CUDA = "cpu:gloo,cuda:nccl"


class ProcessGrid:
    def __init__(self, sizes: dict, device: torch.device, timeout_s=None, ep=1):
        """sizes: {dimension: degree} for dimensions of DIMS (missing ones are 1).
        ep: the expert-parallel degree (parallel.ep), carved out of dp x cp.
        timeout_s: how long a collective of any group made here may wait
        (parallel.timeout_s; None: torch's default, 30 minutes). Every subgroup gets it:
        `new_group` does not inherit the default group's."""
        unknown = set(sizes) - set(DIMS)
        assert not unknown, f"unknown grid dimensions {sorted(unknown)}"
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.sizes = {d: int(sizes.get(d, 1)) for d in DIMS}
        assert math.prod(self.sizes.values()) == self.world_size, "validated in parallel/layout.py"
        self.device = device
        self.timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        # the device's groups (NCCL on a GPU) wait a margin longer: launch/hang_report.py
        self.device_timeout = None if timeout_s is None else datetime.timedelta(
            seconds=nccl_timeout_s(timeout_s) if device.type == "cuda" else timeout_s)
        self.splits = can_split(device)  # one split per dimension instead of a group per line
        self.ranks = torch.arange(self.world_size).view(*self.sizes.values())
        self.coords = self.ranks_coords(self.rank)
        # every rank must create every group, in the same order
        self._groups = {}
        for d in DIMS:  # dp_size, dp_rank, dp_group, pp_size, ...
            setattr(self, f"{d}_size", self.sizes[d])
            setattr(self, f"{d}_rank", self.coords[d])
            setattr(self, f"{d}_group", self.group_over(d))
        self.grad_group = self.group_over(*GRAD_DIMS)
        self.shard_group = self.group_over(*SHARD_DIMS)
        # object collectives (snapshot manifests, the end-of-run state) pickle into tensors on
        # the group's device: over NCCL that stages world x the largest object on the GPU,
        # beside the model and optimizer state. They run on a gloo group, in host memory
        # (created under gloo too, so that CPU runs take the path GPU runs take). Under the
        # fake backend (mode=dryrun: one rank of a large world in this process) nothing
        # could answer a gloo rendezvous: the host group is fake as well.
        host = None if dist.get_backend() == "fake" else "gloo"
        self.host_group = dist.new_group(backend=host, timeout=self.timeout)
        self.data_size, self.data_rank = self.place_in(DATA_DIMS)
        self.grad_size, self.grad_rank = self.place_in(GRAD_DIMS)
        self.shard_size, self.shard_rank = self.place_in(SHARD_DIMS)
        self.carve_experts(ep)

    def carve_experts(self, ep):
        """Expert parallelism: the dp x cp ranks of one replica group, numbered row-major
        (`expert_slot`), in runs of `ep` consecutive ones: a run is an `ep_group` (its ranks
        hold different experts and trade tokens), and the ranks at the same place of every
        run in every replica group hold the same experts (the expert-data-parallel group,
        `expert_grad_group`, which averages their gradients; `expert_shard_group`: those
        of one replica group, over which ZeRO shards them). ep=1: the ep group is this rank
        alone and the expert groups are the dense ones."""
        slot = self.coords["dp"] * self.sizes["cp"] + self.coords["cp"]
        self.ep_size, self.ep_rank = ep, slot % ep
        self.expert_grad_size, self.expert_shard_size = self.grad_size // ep, self.shard_size // ep
        self.expert_grad_rank = self.coords["dp_replicate"] * self.expert_shard_size + slot // ep
        self.expert_shard_rank = slot // ep
        if ep == 1:
            self.ep_group, self.expert_grad_group = None, self.grad_group
            self.expert_shard_group, self.expert_norm_group = self.shard_group, None
            return

        def slot_of(c):
            return c["dp"] * self.sizes["cp"] + c["cp"]
        # each group keyed by what its ranks share, its members ordered by global rank
        self.ep_group = self.group_by(lambda c: (c["dp_replicate"], c["pp"], c["tp"],
                                                 slot_of(c) // ep))
        self.expert_grad_group = self.group_by(lambda c: (c["pp"], c["tp"], slot_of(c) % ep))
        self.expert_shard_group = self.group_by(lambda c: (c["dp_replicate"], c["pp"], c["tp"],
                                                           slot_of(c) % ep))
        # ranks holding different elements of a replicated strategy's gradients: pp x tp x ep
        self.expert_norm_group = self.group_by(lambda c: (c["dp_replicate"], slot_of(c) // ep))

    def group_by(self, key):
        """The group of ranks whose coordinates give the same key(coords) as this rank's
        (collective: every rank makes every such group, in the order of their keys)."""
        lines = {}
        for r in range(self.world_size):
            lines.setdefault(key(self.ranks_coords(r)), []).append(r)
        return self.group_of_lines([lines[k] for k in sorted(lines)])

    def ranks_coords(self, rank):
        """{dimension: coordinate} of global rank `rank`."""
        return dict(zip(DIMS, (int(c) for c in (self.ranks == rank).nonzero()[0])))

    def place_in(self, dims):
        """(size, this rank's index) of the group over `dims`, row-major: its place in
        group_over(*dims)."""
        index = 0
        for d in dims:
            index = index * self.sizes[d] + self.coords[d]
        return math.prod(self.sizes[d] for d in dims), index

    def group_over(self, *dims, host_tensors=False):
        """The group of ranks that differ only in the coordinates `dims` (names among
        DIMS), holding this rank. Collective the first time: every rank must ask for
        the same groups in the same order. Dimensions of size 1 change nothing: the
        group over (dp_replicate, dp) with one replica group is the one over dp.
        host_tensors: a group whose collectives also take host tensors. On a GPU the
        grid's groups are NCCL's, which refuses them: these are groups of their own with a
        backend per device type (HOST_AND_CUDA: gloo for host tensors beside NCCL),
        torchtune's way for PyTorch's FSDP2 with CPUOffloadPolicy, whose gradients and
        optimizer state are host DTensors that its norm and state gathers reduce. On any
        other device the grid's own group already takes them (gloo) and is returned."""
        axes = tuple(sorted(DIMS.index(d) for d in dims if self.sizes[d] > 1))
        key = ("host", axes) if host_tensors and self.device.type == "cuda" else axes
        if key not in self._groups:
            rest = [a for a in range(len(DIMS)) if a not in axes]
            size = math.prod(self.ranks.size(a) for a in axes)
            lines = self.ranks.permute(*rest, *axes).reshape(-1, size)
            backend = HOST_AND_CUDA if key != axes else None
            self._groups[key] = self.group_of_lines(lines.tolist(), backend)
        return self._groups[key]

    def group_of_lines(self, lines, backend=None):
        """Create a group for each list of global ranks in `lines` (collective: every rank
        passes the same lines, disjoint ones) and return the one holding this rank, or None.
        Where torch can split the default group (NCCL bound to this rank's GPU: `can_split`)
        all lines come from one `split_group`, which creates only this rank's communicator;
        else one `new_group` per line, each of which every rank must enter. backend: the
        groups' own (a split, or the world, would have the default group's): one
        `new_group` per line, the whole world's included."""
        if backend is None and any(len(line) == self.world_size for line in lines):
            return dist.group.WORLD
        if self.splits and backend is None:
            return dist.split_group(split_ranks=lines, timeout=self.device_timeout)
        mine = None
        for line in lines:
            group = dist.new_group(line, timeout=self.device_timeout, backend=backend)
            if self.rank in line:
                mine = group
        return mine

    def rank_at(self, **coords) -> int:
        """The global rank at this rank's coordinates, with those named changed
        (rank_at(pp=0): the first pipeline stage of this rank's pipeline)."""
        where = {**self.coords, **coords}
        return int(self.ranks[tuple(where[d] for d in DIMS)])

    @property
    def is_main(self):
        """The one rank that writes snapshots, metrics and logs for the whole job."""
        return self.rank == 0

    def max_over_ranks(self, values):
        """[the MAX over every rank of each of `values`] (ints): the ranks' agreements (a
        stop signal, a damaged read, a background write's progress, the fullest rank's
        state bytes), made here so that `launch/` and `checkpoint/` need no collective of
        their own. Host integers, so over the host group (gloo) in host memory: the
        trainer agrees every step, and on a GPU that must not wait for the device (an
        all-reduce on the GPU's stream and its read would). Not training traffic:
        device-checked, never counted."""
        flag = torch.tensor(list(values), dtype=torch.int64, device="cpu")
        if self.world_size > 1:
            checked_all_reduce(flag, "cpu", op=dist.ReduceOp.MAX, group=self.host_group)
        return flag.tolist()

    def sum_over_ranks(self, tensor):
        """`tensor` (on the grid's device) summed over every rank, in place: figures for a
        logged step's record (telemetry/expert_load.py), not training traffic."""
        if self.world_size > 1:
            checked_all_reduce(tensor, self.device)
        return tensor

    def gather_over_ranks(self, values) -> list:
        """[every rank's `values`] (floats), by rank, over the host group: the ranks'
        figures at a logged step (telemetry/stragglers.py). Host values, so in host
        memory, waiting for no device; not training traffic."""
        mine = torch.tensor(list(values), dtype=torch.float64, device="cpu")
        if self.world_size == 1:
            return [mine.tolist()]
        everyone = torch.empty(self.world_size * mine.numel(), dtype=torch.float64)
        all_gather_single(everyone, mine, group=self.host_group)
        return everyone.view(self.world_size, -1).tolist()

    def all_ok(self, ok: bool) -> bool:
        """True on every rank iff `ok` was true on every rank (so all stop together)."""
        flag = torch.tensor([1 if ok else 0], device=self.device)
        checked_all_reduce(flag, self.device, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def first_line(self, line):
        """Collective: None on every rank if no rank has a `line`, else the line of the
        lowest rank that has one, on every rank (so each prints what was found, e.g. the
        damaged part of a snapshot that only one rank read). One all-reduce; the lines
        travel (host memory) only when there is one."""
        if self.all_ok(line is None):
            return None
        lines = [None] * self.world_size
        dist.all_gather_object(lines, line, group=self.host_group)
        return next(found for found in lines if found is not None)

    def __repr__(self):
        shown = [d for d in DIMS if d != "dp_replicate" or self.sizes[d] > 1]  # HSDP only
        sizes = ", ".join(f"{d}={self.sizes[d]}" for d in shown)
        at = " ".join(f"{d}={self.coords[d]}" for d in shown)
        return f"ProcessGrid({sizes}; rank {self.rank} at {at})"


def nccl_timeout_s(timeout_s) -> float:
    """How long NCCL's groups wait: parallel.timeout_s and a margin (a quarter of it, at
    least 10 s). Every rank's hang watchdog writes its report once a step has run
    parallel.timeout_s, and reads the others' within the margin, before NCCL's own
    watchdog aborts the process (launch/hang_report.py); gloo's groups (the host group
    too) wait parallel.timeout_s."""
    return timeout_s + max(10.0, timeout_s / 4)


def can_split(device) -> bool:
    """Whether `dist.split_group` can make the grid's groups: torch has it, the run is on a
    GPU, and the default group is bound to it (main.init_process_group's device_id) with a
    backend that splits (NCCL). gloo cannot (torch 2.13 asks for an accelerator)."""
    if device.type != "cuda" or not hasattr(dist, "split_group"):
        return False
    world = dist.group.WORLD
    if getattr(world, "bound_device_id", None) is None:
        return False
    try:
        return bool(world._get_backend(device).supports_splitting)
    except (RuntimeError, AttributeError):
        return False


def uses_cuda(device_choice) -> bool:
    """trainer.device as main.pick_device reads it (here, so that config-time rules read
    it the same way): cuda, or auto where a CUDA device is available."""
    return device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())


def together(grid, what, fn):
    """Run fn on every rank; if it fails on any rank, every rank raises, so none is left
    waiting in the next collective for a rank that has gone."""
    try:
        result, error = fn(), None
    except UserError as e:
        result, error = None, e
    except Exception as e:  # s3 errors, a full disk, wandb refusing to start, ...
        result, error = None, UserError(f"{what} failed: {type(e).__name__}: {e}")
    if not grid.all_ok(error is None):
        raise error or UserError(f"stopping: another rank failed while {what} (see its error)")
    return result


def derive_seed(*parts):
    """A 63-bit seed for one random stream of one grid coordinate, from ints and names:
    distinct tuples give unrelated seeds (sums or products of the parts can collide:
    rank 0's stream 2 would be rank 1's stream 1)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
