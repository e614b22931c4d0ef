"""The CUDA/NCCL paths a static review found wrong (GPU readiness, round two), each shown
on CPU where the behaviour can be shown here:

- every subgroup of the grid carries parallel.timeout_s (a rank that skips a tp
  collective stops every rank with one line, instead of a 30-minute wait), and on a GPU
  the grid's groups come from one `split_group` per dimension (faked in process);
- step_ms / MFU time the whole step, optimizer included, on the device's clock (a
  stand-in event class, as tests/test_pp.py does for the pipeline's clock);
- a training step reads nothing from the device but the logged values at logged steps;
- ring attention under bf16 autocast is as accurate as PyTorch's SDPA;
- a rank's GPU comes from its launcher, never GPU 0 by default, and asynchronous
  snapshots synchronize the run's device, not whatever CUDA is there;
- torch_fsdp with offload meshes over groups that take host tensors (gloo beside NCCL);
- the host reads a device-to-host copy only after its event (offload's gradient shards,
  the async snapshot's staging copies): stand-in events that land the copies when
  synchronized.
"""

import os
import re
import sys
import time

import pytest
import torch

from harness import REPO, TINY, job_env, our_frames, python, run_tree


# ---------------------------------------------------------------- 1. subgroup timeouts

def test_a_rank_skipping_a_tp_collective_stops_every_rank_within_the_timeout(tmp_path):
    """dp2 x tp2 (the tp groups are subgroups of the world): rank 1 does not enter a
    forward all-reduce of its tp group and waits in another collective instead
    (tests/skip_worker.py). Its tp peer waits in the all-reduce, the other tp group in
    the gradient all-reduces of the dp groups: every rank must give up after
    parallel.timeout_s with one line and a non-zero exit. Without the timeout on the
    subgroups they wait 30 minutes (torch's default for new_group)."""
    timeout_s = 4
    cmd = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           os.path.join(REPO, "tests", "skip_worker.py"), *TINY, "parallel.tp=2",
           "parallel.dp=ddp_bucket", f"parallel.timeout_s={timeout_s}", "trainer.max_steps=2"]
    result = run_tree(cmd, 180, "a job with a skipped tp collective", cwd=tmp_path, env=job_env())
    ended = time.time()
    skipped = re.search(r"^SKIPPED ([0-9.]+)$", result.stdout, re.M)
    assert skipped, result.stdout[-3000:] + result.stderr[-3000:]
    waited = ended - float(skipped.group(1))
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error on rank")]
    print(f"every rank stopped {waited:.1f} s after the skip (timeout {timeout_s} s):\n"
          + "\n".join(lines))
    assert result.returncode != 0
    assert sorted(ln[:15] for ln in lines) == [f"error on rank {r}" for r in range(4)], result.stderr
    assert all("parallel.timeout_s=4 s" in ln or "another rank stopped" in ln for ln in lines), lines
    assert not our_frames(result.stderr), result.stderr[-5000:]  # no traceback of ours
    assert waited <= timeout_s + 30, f"ranks stopped {waited:.0f} s after the skip"


class FakeDist:
    """torch.distributed as ProcessGrid sees it, for rank `rank` of `world`: records
    every group it is asked for."""

    def __init__(self, rank, world, splits):
        self.rank, self.world, self.splits = rank, world, splits
        self.new_groups, self.split_groups = [], []

    def install(self, monkeypatch):
        import parallel.grid as grid
        monkeypatch.setattr(grid.dist, "get_rank", lambda: self.rank)
        monkeypatch.setattr(grid.dist, "get_world_size", lambda: self.world)
        monkeypatch.setattr(grid.dist, "get_backend", lambda group=None: "nccl" if self.splits else "gloo")
        monkeypatch.setattr(grid.dist, "new_group", self.new_group)
        monkeypatch.setattr(grid.dist, "split_group", self.split_group)
        monkeypatch.setattr(grid, "can_split", lambda device: self.splits)

    def new_group(self, ranks=None, timeout=None, backend=None):
        self.new_groups.append((ranks, timeout, backend))
        return ("group", tuple(ranks or range(self.world)))

    def split_group(self, parent_pg=None, split_ranks=None, timeout=None, **kw):
        self.split_groups.append((split_ranks, timeout))
        return next((("split", tuple(line)) for line in split_ranks if self.rank in line), None)


@pytest.mark.parametrize("splits", [False, True], ids=["gloo-new_group", "nccl-split_group"])
def test_every_group_of_the_grid_gets_the_timeout_and_gpus_split_once_per_dimension(
        monkeypatch, splits):
    """Rank 5 of dp2 x pp2 x tp2, in process (torch.distributed faked). gloo: a new_group
    per line of every dimension, each with the timeout. GPU (NCCL bound to the rank's
    device): one split_group per dimension, naming every line, with the timeout: each
    rank creates its own communicators only, not every group of the world's."""
    import datetime
    from parallel.grid import ProcessGrid
    fake = FakeDist(5, 8, splits)
    fake.install(monkeypatch)
    grid = ProcessGrid({"dp": 2, "pp": 2, "tp": 2}, torch.device("cpu"), timeout_s=7)
    timeout = datetime.timedelta(seconds=7)
    assert fake.new_groups[-1] == (None, timeout, "gloo")  # the host group
    lines = {"ones": [[r] for r in range(8)], "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
             "pp": [[0, 2], [1, 3], [4, 6], [5, 7]], "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    # DIMS in order, each group made once: dp_replicate and cp have size 1 (lines of one
    # rank, made for the first and reused), and grad_group (dp_replicate x dp x cp) and
    # shard_group (dp x cp) are dp's
    order = ("ones", "dp", "pp", "tp")
    if splits:
        assert [s for s, _ in fake.split_groups] == [lines[d] for d in order]
        assert all(t == timeout for _, t in fake.split_groups)
        assert fake.new_groups == [(None, timeout, "gloo")]
        assert grid.tp_group == ("split", (4, 5)) and grid.dp_group == ("split", (1, 5))
    else:
        made = [(r, t) for r, t, _ in fake.new_groups[:-1]]
        assert made == [(line, timeout) for d in order for line in lines[d]]
        assert grid.tp_group == ("group", (4, 5)) and grid.pp_group == ("group", (5, 7))


@pytest.mark.parametrize("replicas", [1, 2], ids=["1d-mesh", "hsdp-2d-mesh"])
def test_torch_fsdp_offload_on_a_gpu_meshes_over_groups_that_take_host_tensors(monkeypatch, replicas):
    """torch_fsdp with parallel.offload crashed at step 1 on GPUs: CPUOffloadPolicy leaves
    the gradients (and AdamW's state) host DTensors, and the norm's all-reduce (then the
    clip's, the snapshot's full tensors) ran over the grid's NCCL-only groups (a known
    FSDP2 limitation; torchtune adds gloo). Rank 1 of 4 on a GPU, in process
    (torch.distributed faked, FSDP2's fully_shard and DeviceMesh stand-ins): with offload
    the mesh is built from groups of their own, one new_group per line (the whole world's
    too) with gloo beside NCCL and NCCL's timeout; without, from the grid's split groups. On
    a CPU grid the grid's own gloo groups already take host tensors: no group is added."""
    import datetime
    import parallel.reference.torch_fsdp as torch_fsdp
    from types import SimpleNamespace
    from model import GPT, GPTConfig
    from parallel.config import ParallelConfig
    from parallel.data_parallel.replicated import ReplicatedStrategy
    from parallel.grid import HOST_AND_CUDA, ProcessGrid, nccl_timeout_s
    from parallel.strategy import LocalModel, Strategy
    meshes, sharded = [], []
    monkeypatch.setattr(torch_fsdp, "DeviceMesh", SimpleNamespace(
        from_group=lambda group, device_type, **kw: meshes.append((group, device_type)) or len(meshes)))
    monkeypatch.setattr(torch_fsdp, "fully_shard", lambda module, mesh, **kw: sharded.append((mesh, kw)))
    # the GPU's allocation and initial weights are not under test
    monkeypatch.setattr(ReplicatedStrategy, "__init__", Strategy.__init__)
    with torch.device("meta"):
        gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=11, block_size=8))
    sizes = {"dp_replicate": replicas, "dp": 4 // replicas}

    def build(device, offload):
        grid = ProcessGrid(sizes, torch.device(device), timeout_s=7)
        made = len(fake.new_groups)
        torch_fsdp.TorchFSDP(LocalModel(gpt, {}, None), grid, ParallelConfig(
            dp="torch_fsdp", dp_replicate=replicas, offload=offload, prefetch=False))
        assert [mesh for mesh, _ in sharded[-3:]] == [len(meshes)] * 3  # two blocks, the root
        assert isinstance(sharded[-1][1].get("offload_policy"), torch_fsdp.CPUOffloadPolicy) == offload
        return grid, fake.new_groups[made:], meshes[-1]

    fake = FakeDist(1, 4, splits=True)
    fake.install(monkeypatch)
    grid, added, mesh = build("cuda", offload=True)
    print(f"offload on a GPU: mesh over {mesh}, groups added {added}")
    # NCCL beside gloo: the margin NCCL's groups wait beyond the timeout (test_hang_watchdog.py)
    timeout = datetime.timedelta(seconds=nccl_timeout_s(7))
    if replicas == 1:
        assert added == [([0, 1, 2, 3], timeout, HOST_AND_CUDA)]
        assert mesh == (("group", (0, 1, 2, 3)), "cuda")
    else:  # replicate lines, then shard lines; rank 1 holds (1, 3) and (0, 1)
        assert added == [(line, timeout, HOST_AND_CUDA) for line in ([0, 2], [1, 3], [0, 1], [2, 3])]
        assert mesh == ([("group", (1, 3)), ("group", (0, 1))], "cuda")
    grid, added, mesh = build("cuda", offload=False)
    assert added == [] and mesh == (
        grid.grad_group if replicas == 1 else [grid.dp_replicate_group, grid.shard_group], "cuda")
    fake = FakeDist(1, 4, splits=False)
    fake.install(monkeypatch)
    grid, added, mesh = build("cpu", offload=True)
    assert added == [] and mesh == (
        grid.grad_group if replicas == 1 else [grid.dp_replicate_group, grid.shard_group], "cpu")


# ---------------------------------------------------------------- in-process training runs

def train_in_process(grid, run_dir, overrides):
    """main.train on the one-rank grid of this process (TINY, then `overrides`)."""
    import contextlib
    import io
    import main
    cfg = main.load_config(TINY + list(overrides) + [f"trainer.run_dir={run_dir}"], 1)
    with contextlib.redirect_stdout(io.StringIO()):
        main.train(cfg, grid)
    from harness import read_metrics
    return read_metrics(run_dir)


class DeviceTimeline:
    """A stand-in for CUDA events on a device whose work runs asynchronously: the host
    returns from a kernel launch at once, and `now` (ms) is the device's clock, moved on
    by the work the test says each call queues."""
    now = 0.0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = DeviceTimeline.now

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.at - self.at


def test_step_time_is_the_devices_and_includes_the_optimizer(one_rank_grid, tmp_path, monkeypatch):
    """step_ms (and so tokens_per_s and MFU) on a GPU: the host returns from the
    optimizer's kernels long before they ran, so a host timer stopped after
    optimizer.step(), with the last host sync before it (the old grad-norm read), leaves
    them out. Faked: the step's forward/backward queue 10 ms of device work and AdamW's
    step 50 ms, the host takes none of it; step_ms must be those 60 ms (+ data_ms, the
    host's read of the batch)."""
    import trainer as trainer_module
    from parallel.pipeline_parallel.clock import DeviceClock
    from parallel.strategy import Strategy
    monkeypatch.setattr(trainer_module, "DeviceClock",
                        lambda device: DeviceClock(device, event_class=DeviceTimeline),
                        raising=False)
    real_step, real_reseed = torch.optim.AdamW.step, Strategy.reseed

    def optimizer_step(self, *a, **kw):
        DeviceTimeline.now += 50.0
        return real_step(self, *a, **kw)

    def reseed(self, seed):  # the step's start: its forward and backward follow
        DeviceTimeline.now += 10.0
        return real_reseed(self, seed)

    monkeypatch.setattr(torch.optim.AdamW, "step", optimizer_step)
    monkeypatch.setattr(Strategy, "reseed", reseed)
    records = train_in_process(one_rank_grid, tmp_path / "run", [
        "parallel.dp=single", "trainer.max_steps=3"])
    device_ms = [r["step_ms"] - r["data_ms"] for r in records]
    print(f"step_ms - data_ms per step: {device_ms}")
    assert device_ms == pytest.approx([60.0] * 3, abs=1e-6), device_ms


# what a training step may read from tensors in our code (file, or file:function): host
# values by construction, never a device sync
HOST_READS = {
    "data/": "the data pipeline orders and cuts windows on the host",
    "char_dataset.py": "the windows of the text, on the host",
    "parallel/grid.py:ProcessGrid.max_over_ranks": "host integers over the host group (gloo): "
        "the step's agreement (stop signal, damaged read, background snapshot) and, at logged "
        "steps, state_bytes",
    "parallel/context_parallel/ring_attention.py:_draw_seed": "on CPU a draw of the CPU "
        "generator; on a GPU the generator's seed and offset, no tensor",
    "parallel/precision.py:Precision.unscale_and_check": "fp16 only: whether to step is the "
        "host's decision, read every step as torch.amp.GradScaler reads it",
    "parallel/finite.py:step_unless": "foreach AdamW only, the CPU's: whether the gradients "
        "were finite, read on the host (nothing to wait for); fused AdamW, a GPU's, takes it as "
        "found_inf unread (test_nonfinite_steps.py)",
}
LOGGED_READS = {"telemetry/loss_watch.py:LossWatch.read"}  # the logged loss and grad norm, at logged steps
# mixture of experts, at logged steps: the balance losses and the load, one table read
EXPERT_READS = {"telemetry/expert_load.py:moe_stats"}
READERS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


def count_host_reads(monkeypatch):
    """Wrap every Tensor method that reads values into host memory; returns a list that
    collects (call site "file:Class.function", step) for each call from our code (not
    torch's own internals: AdamW's step counters are host tensors by torch's design)."""
    from training import step as step_module
    reads, now = [], [0]
    real_reseed = step_module.reseed

    def reseed(strategy, t, step):  # the start of step step + 1
        now[0] = step + 1
        return real_reseed(strategy, t, step)

    monkeypatch.setattr(step_module, "reseed", reseed)
    repo = os.path.realpath(REPO)
    for name in READERS:
        real = getattr(torch.Tensor, name)

        def reader(self, *a, _real=real, **kw):
            frame = sys._getframe(1)
            path = os.path.realpath(frame.f_code.co_filename)
            if path.startswith(repo + os.sep) and "site-packages" not in path:
                rel = os.path.relpath(path, repo)
                if not rel.startswith("tests"):
                    reads.append((f"{rel}:{frame.f_code.co_qualname}", now[0]))
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, reader)
    return reads


def host_only(site):
    path, _, function = site.partition(":")
    return any((path.startswith(entry) if entry.endswith("/") else
                (entry == path or entry == site or site.startswith(entry + "."))) for entry in HOST_READS)


@pytest.mark.parametrize("layout", [["parallel.dp=single", "trainer.precision=bf16"],
                                    ["parallel.dp=fsdp", "parallel.zero_stage=3"],
                                    ["parallel.dp=single", "trainer.precision=bf16",
                                     "model.moe_experts=4", "model.moe_bias_rate=0.01"]],
                         ids=["single-bf16", "fsdp3", "single-bf16-experts"])
def test_a_training_step_reads_the_device_only_for_the_logged_values(
        one_rank_grid, tmp_path, monkeypatch, layout):
    """Every host read in our code during steps 1-4 of a 5-step run logged every 2nd
    step: none at steps 1 and 3 (on a GPU each would wait for the queued work: the loss's
    all-reduce, the norm, state_bytes' all-reduce, a per-tensor loop), and at steps 2
    and 4 only the logged values, in one read. Host-only values (HOST_READS, each with
    its reason) are not device reads."""
    reads = count_host_reads(monkeypatch)
    train_in_process(one_rank_grid, tmp_path / "run", layout + [
        "trainer.max_steps=5", "trainer.log_every=2", "model.dropout=0.1"])
    device = [(site, step) for site, step in reads if not host_only(site) and 1 <= step <= 4]
    print("device reads by step:", device)
    assert [s for s in device if s[1] in (1, 3)] == [], device
    logged = LOGGED_READS | (EXPERT_READS if any("moe_experts" in o for o in layout) else set())
    assert sorted(set(device)) == sorted((site, step) for step in (2, 4) for site in logged), device
    assert len(device) == 2 * len(logged), device  # one read per logged step


# ---------------------------------------------------------------- 2. ring attention under bf16

class TableRing:
    """cp rank `rank` of `size` in this process, forward only: each `pass_on` hands over
    the keys and values its left neighbour would, from a table of every rank's."""

    def __init__(self, rank, size, kvs):
        self.rank, self.size, self.kvs, self.hops = rank, size, kvs, 0

    def pass_on(self, tensor):
        self.hops += 1
        src = (self.rank - self.hops) % self.size
        return lambda: self.kvs[src]


def test_ring_attention_under_bf16_autocast_is_as_accurate_as_sdpa():
    """cp2 (both ranks in process): causal attention of the same bf16 q, k, v as the
    model's attention gets them under autocast, against an fp64 reference. Without the
    fp32 accumulation autocast ran every block's products, scores included, in bf16:
    4.5x SDPA's error here (0.79% vs 0.17%, relative L2)."""
    import torch.nn.functional as F
    from parallel.context_parallel.ring_attention import ring_attention, zigzag_positions
    N, B, H, T, d = 2, 2, 4, 256, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=g).mul(s).to(torch.bfloat16) for s in (2, 2, 1))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    pos = [zigzag_positions(r, N, T // N) for r in range(N)]
    kvs = [torch.stack([k[:, :, p], v[:, :, p]]).contiguous() for p in pos]
    ring = torch.empty_like(ref)
    for r in range(N):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ring_attention(q[:, :, pos[r]], k[:, :, pos[r]], v[:, :, pos[r]], 0.0,
                                 TableRing(r, N, kvs))
        assert out.dtype == torch.bfloat16  # what autocast's attention would hand on
        ring[:, :, pos[r]] = out.double()
    error = {name: ((x.double() - ref).norm() / ref.norm()).item()
             for name, x in (("ring", ring), ("sdpa", sdpa))}
    print(f"relative L2 error against fp64: ring {error['ring']:.3%}, SDPA {error['sdpa']:.3%} "
          f"({error['ring'] / error['sdpa']:.2f}x)")
    assert error["ring"] <= 1.2 * error["sdpa"], error


def test_ring_dropout_seed_reads_nothing_from_a_gpu():
    """The masks' seed on a GPU: the generator's seed and offset (host numbers), the
    offset moved on as a draw would, so two calls draw two seeds and a recompute that
    restores the generator's state draws the first again. The old draw, int(torch.randint(
    device=cuda)), waited for the device every forward. A stand-in generator (no GPU here)."""
    from parallel.context_parallel.ring_attention import _draw_seed

    class Generator:  # CUDA's philox generator as _draw_seed sees it
        def __init__(self):
            self.offset = 8

        def initial_seed(self):
            return 1234

        def get_offset(self):
            return self.offset

        def set_offset(self, offset):
            self.offset = offset

    gen, made = Generator(), []
    real = torch.randint
    try:
        torch.randint = lambda *a, **kw: made.append(a) or real(*a, **kw)
        first = _draw_seed(torch.device("cuda", 0), generator=gen)
        second = _draw_seed(torch.device("cuda", 0), generator=gen)
        gen.set_offset(8)  # a recompute restores the generator's state
        replay = _draw_seed(torch.device("cuda", 0), generator=gen)
    finally:
        torch.randint = real
    assert made == [] and first != second and replay == first and gen.offset == 12


def test_cp_positions_are_copied_to_the_device_once(monkeypatch):
    """The position hook and the all-gather reference ask for this rank's true positions
    every forward: on a GPU each ask copied them from the host (`meta` stands for the
    device here)."""
    from parallel.context_parallel.apply import CPContext
    cp = CPContext(group=None, size=2, rank=1, comm=None, right=0, left=0)
    copies = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: copies.append(a) or real_to(self, *a, **kw))
    meta = torch.device("meta")
    first = cp.positions(8, meta)
    assert first.device == meta and cp.positions(8, meta) is first and cp.positions_of(1, 8, meta) is first
    assert len(copies) == 1 and cp.positions(8).tolist() == list(range(4, 12))


# ---------------------------------------------------------------- async snapshots: the run's device

def test_async_snapshot_waits_for_the_runs_device_only(one_rank_grid, tmp_path, monkeypatch):
    """A CPU run on a machine with CUDA (faked here: is_available true) must not touch
    CUDA: the old writer synchronized every GPU whenever torch.cuda.is_available(). On
    CUDA the writer waits for an event recorded after the staging copies (a stand-in
    event class here), not for the whole device."""
    from checkpoint import async_snapshot
    from checkpoint.snapshot_reader import open_snapshot
    synced = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append(a))
    path = str(tmp_path / "snapshot")
    saver = async_snapshot.AsyncSnapshots(path, one_rank_grid, keep=1)
    meta = {"config": {}, "gpt_config": {}, "tokenizer": {}}
    saver.begin(2, [("model/w", (2, 3), ((0, 2), (0, 3)), torch.ones(2, 3))], meta)
    saver.drain()
    saver.close()
    assert synced == [] and open_snapshot(path).meta["step"] == 2

    class Event:
        log = []

        def record(self):
            Event.log.append("record")

        def synchronize(self):
            Event.log.append("synchronize")

    assert async_snapshot.staging_done(torch.device("cpu"), Event) is None
    event = async_snapshot.staging_done(torch.device("cuda", 1), Event)
    event.synchronize()
    assert Event.log == ["record", "synchronize"]


class Landing:
    """A stand-in CUDA event recorded after non-blocking device-to-host copies into
    `buffers`: until it is synchronized the copies are in flight, so the buffers hold what
    the host must not read (NaN here); synchronize() lands them (and is logged in `log`)."""

    def __init__(self, buffers, log):
        self.landed = [(b, b.clone()) for b in buffers]
        self.log = log
        for b in buffers:
            b.fill_(float("nan"))

    def synchronize(self):
        self.log.append("synchronize")
        for b, values in self.landed:
            b.copy_(values)


def test_offloaded_gradient_shards_are_added_on_the_host_only_after_their_copy_landed():
    """parallel.offload, issue 47: each reduced gradient shard leaves the GPU by a
    non-blocking copy into pinned host memory, and `land` must wait for its event before
    the host adds it to the host gradient. On CPU the copy is synchronous and the event
    None, so nothing else shows a missing wait; here each copy lands only when its
    stand-in event is synchronized. Two micro-steps' shards, each divided by 2."""
    from parallel.data_parallel.offload import HostShard
    log = []

    class OnGPU(HostShard):  # HostShard whose receive copies are in flight, as on CUDA
        def _empty(self, size, dtype):
            self.last = super()._empty(size, dtype)
            return self.last

        def _event(self):  # right after receive's copy into its new host buffer
            return Landing([self.last], log)

    shard = OnGPU(4, torch.float32, torch.device("cpu"))
    shard.allocate_grad()
    shard.receive(torch.tensor([2.0, 4.0, 6.0, 8.0]), 2)
    shard.receive(torch.tensor([1.0, 1.0, 1.0, 1.0]), 2)
    shard.land()
    print(f"host gradient {shard.grad.tolist()}, order {log}")
    # a shard read before its copy landed adds NaN
    assert shard.grad.tolist() == [1.5, 2.5, 3.5, 4.5] and log == ["synchronize"] * 2


def test_the_async_snapshot_writer_reads_the_staging_copies_only_after_they_landed(
        one_rank_grid, tmp_path, monkeypatch):
    """trainer.snapshot_async on CUDA, issue 47: the save step copies every piece into
    pinned host buffers without waiting, and the writer thread may read them only after
    the event recorded behind those copies (staging_done) completed. On CPU the copies
    are synchronous and the event None; here the staged buffers hold NaN until the
    stand-in event is synchronized: the snapshot must hold the pieces' values, and the
    synchronize must come before the writer starts."""
    from checkpoint import async_snapshot
    from checkpoint.snapshot_reader import open_snapshot
    log, path = [], str(tmp_path / "snapshot")
    saver = async_snapshot.AsyncSnapshots(path, one_rank_grid, keep=1)
    monkeypatch.setattr(async_snapshot, "staging_done",
                        lambda device: Landing(list(saver.buffers.values()), log))
    real_write = async_snapshot.write_own_part
    monkeypatch.setattr(async_snapshot, "write_own_part",
                        lambda save: log.append("writer reads") or real_write(save))
    w, b = torch.arange(6.0).reshape(2, 3), torch.tensor([0.5, -1.0])
    meta = {"config": {}, "gpt_config": {}, "tokenizer": {}}
    saver.begin(2, [("model/w", (2, 3), ((0, 2), (0, 3)), w), ("model/b", (2,), ((0, 2),), b)], meta)
    saver.drain()
    assert saver.close() is None
    snapshot = open_snapshot(path)
    written = {key: snapshot.read_full(key) for key in ("model/w", "model/b")}
    print(f"order {log}, written {({k: v.tolist() for k, v in written.items()})}")
    assert log == ["synchronize", "writer reads"]
    assert torch.equal(written["model/w"], w) and torch.equal(written["model/b"], b)


# ---------------------------------------------------------------- 4. profiling a run

def test_two_ranks_profile_steps_2_and_3_into_one_trace_each(tmp_path):
    """trainer.profile_from=2 profile_steps=2 on 2 ranks (ddp_bucket): one Chrome trace
    per rank under <run_dir>/profile/, holding steps 2 and 3 only, their matmuls and the
    gradient all-reduces; trainer.memory_snapshot on CPU is one note, once."""
    import json
    from harness import run_job
    result = run_job(tmp_path, 2, ["parallel.dp=ddp_bucket", "trainer.max_steps=4",
                                   "trainer.profile_from=2", "trainer.profile_steps=2",
                                   "trainer.memory_snapshot=true"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("trainer.memory_snapshot is CUDA only") == 1, result.stdout
    # where the traces went: one line, from rank 0, when the window closes
    assert result.stdout.count("profile: ") == 1 and (
        "profile: steps 2 to 3 written to runs/default/profile/trace-rank00000.json (one per "
        "rank, rank00000 to rank00001)\n") in result.stdout, result.stdout
    profile = tmp_path / "runs" / "default" / "profile"
    assert sorted(os.listdir(profile)) == ["trace-rank00000.json", "trace-rank00001.json"]
    for rank in (0, 1):
        with open(profile / f"trace-rank{rank:05d}.json") as f:
            events = json.load(f)["traceEvents"]
        names = {e.get("name", "") for e in events}
        steps = sorted(n for n in names if n.startswith("train step"))
        matmuls = sorted(n for n in names if n in ("aten::mm", "aten::addmm", "aten::bmm"))
        collectives = sorted(n for n in names if "allreduce" in n.replace("_", "").lower())
        print(f"rank {rank}: {len(events)} events, {steps}, {matmuls}, {collectives}")
        assert steps == ["train step 2", "train step 3"], steps
        assert matmuls and collectives, sorted(names)[:80]


def test_deterministic_runs_set_and_restore_deterministic_kernels(monkeypatch):
    """trainer.deterministic (gpu_smoke.sh's rerun column asks for bitwise reruns, which
    kernels with atomics do not give on a GPU): deterministic algorithms on, cuDNN without
    autotuning, cuBLAS's fixed workspace, for the run only (a process may run more jobs)."""
    import main
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    with main.determinism(True):
        # strict: warn-only leaves CUDA's memory-efficient and cuDNN attention on their
        # atomics (an H100 rerun differed)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled() == before
    with main.determinism(False):
        assert torch.are_deterministic_algorithms_enabled() == before
