"""Device mistakes fail fast, on CPU, before a GPU ever sees them.

- Every tensor constructor of the product's code (not tests/, not bench/) names
  its device, except a short allow-list of host-only uses, each with its reason:
  a tensor made without device= lands on the CPU, and an NCCL collective given
  it crashes ("No backend type associated with device type cpu") -- or worse,
  it silently runs a computation on the host.
- Object collectives run on the grid's gloo group (host memory), never staged
  on the GPU.
- Every collective goes through parallel/comm.py (the strategies' counted comm, or
  checked_all_reduce for the ranks' uncounted agreements) outside a named
  allow-list, each entry with its reason.
- The counted comm (parallel/comm.py) refuses a tensor on another device than
  the grid's with one clear message: handed a `meta` tensor where the grid
  works on the CPU, and a CPU tensor where it works on `meta` (a CUDA tensor
  cannot be made on this CPU-only build; the check compares devices, whichever), and
  main.py does not report that defect as another rank's failure.
- parallel.offload's host gradients beside the device's compute (`meta` stands for the
  GPU): the gradient norm ends on the compute device, fp16 unscales each device's
  gradients with a flag of their own.
"""

import ast
import os

import pytest
import torch

from harness import REPO

# torch functions that create a tensor and take device=; *_like copy their argument's
# device, and from_numpy / frombuffer wrap host memory (they take no device at all)
CONSTRUCTORS = {"tensor", "as_tensor", "asarray", "scalar_tensor", "zeros", "ones", "empty",
                "full", "arange", "linspace", "logspace", "eye", "rand", "randn", "randint",
                "randperm", "normal", "empty_strided", "tril_indices", "triu_indices"}

HOST_ONLY = {  # a directory, a file, or "file:function" -> why its tensors stay on the host
    "data/": "the data pipeline reads and orders windows on the host; the strategy moves "
             "each micro-batch to the device",
    "optimizers/muon.py:Muon._update": "the step count, a host scalar as torch.optim.AdamW's "
                                        "and Muon's own (the momentum is zeros_like the gradient)",
    "planner/dryrun.py:ranks_to_try": "rank arithmetic of the world tried, never a tensor of a rank",
    "planner/dryrun.py:RandomWindows.batch": "mode=dryrun's stand-in for the data pipeline, which "
                                             "makes batches on the host (as data/ does)",
    "checkpoint/hf_gpt2.py:to_hf": "the export's zero biases, written to a safetensors file "
                                   "beside the CPU tensors of the canonical state",
    "checkpoint/snapshot_reader.py:SnapshotReader.read_box": "the box is filled from bytes read off "
                                                      "storage; the loader copies it to the device",
    "checkpoint/snapshot_reader.py:SnapshotReader.read": "an empty range, beside read_box's host "
                                                  "tensors",
    "char_dataset.py": "the tokens and the windows cut from them live on the host",
    "main.py:generate_text": "the final sample runs on a fresh CPU model after the process "
                             "group is gone",
    "parallel/grid.py:ProcessGrid.__init__": "rank arithmetic: which rank sits where",
    "parallel/grid.py:ProcessGrid.gather_over_ranks": "host figures gathered over the host "
        "group (gloo), in host memory: a logged step's busy times (telemetry/stragglers.py)",
    "moe/experts.py:Experts.__init__": "a module's parameters, as nn.Linear makes its own: under "
        "the caller's device (shapes_only's meta device), allocated on grid.device by the strategy",
    "parallel/placement.py:_flat_index": "element positions; indexing moves them to the "
                                         "indexed tensor's device",
    "parallel/reference/torch_tp.py:head_major_rows": "a row permutation used as an index",
    "parallel/context_parallel/ring_attention.py:zigzag_positions": "token positions, used as "
                                                                    "an index on the batch's device",
    "parallel/strategy.py:Strategy.state_dict": "the canonical state is assembled on the main "
                                                "rank's host for the sample and the export",
}


def product_files():
    for top, dirs, files in os.walk(REPO):
        rel = os.path.relpath(top, REPO)
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__"))
                         and not (rel == "." and d in ("tests", "bench", "docs"))
                         and not os.path.exists(os.path.join(top, d, "pyvenv.cfg")))
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.normpath(os.path.join(rel, name)).replace(os.sep, "/")


def constructors_without_device(path, root=REPO):
    """[(line, "torch.<name>", enclosing "Class.function")] in one file."""
    with open(os.path.join(root, path)) as f:
        tree = ast.parse(f.read(), path)
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, scope + [child.name])
                continue
            func = getattr(child, "func", None)
            if (isinstance(child, ast.Call) and isinstance(func, ast.Attribute)
                    and func.attr in CONSTRUCTORS and isinstance(func.value, ast.Name)
                    and func.value.id == "torch"
                    and not any(k.arg == "device" for k in child.keywords)):
                found.append((child.lineno, f"torch.{func.attr}", ".".join(scope)))
            visit(child, scope)

    visit(tree, [])
    return found


def allowed(path, scope):
    """The HOST_ONLY entry covering a constructor in `scope` of `path`, or None."""
    for entry in HOST_ONLY:
        where, _, function = entry.partition(":")
        if (path.startswith(where) if where.endswith("/") else path == where) and \
                (not function or scope == function or scope.startswith(function + ".")):
            return entry
    return None


def test_every_tensor_constructor_names_its_device_or_is_a_listed_host_only_use():
    unlisted, used = [], set()
    for path in product_files():
        for line, call, scope in constructors_without_device(path):
            entry = allowed(path, scope)
            if entry is None:
                unlisted.append(f"{path}:{line} {call} in {scope or 'module'}")
            used.add(entry)
    assert not unlisted, ("tensor constructors without device= (add device=grid.device, or a "
                          "HOST_ONLY entry saying why the tensor stays on the host):\n  "
                          + "\n  ".join(unlisted))
    stale = set(HOST_ONLY) - used
    assert not stale, f"HOST_ONLY entries that no longer cover anything: {sorted(stale)}"


def test_the_scan_sees_a_constructor_without_device(tmp_path):
    """The scanner itself: a missing device= is found, a present one is not."""
    (tmp_path / "m.py").write_text("import torch\nclass A:\n    def f(self, d):\n"
                                   "        a = torch.zeros(3)\n"
                                   "        return torch.zeros(3, device=d), torch.zeros_like(a)\n")
    assert constructors_without_device("m.py", str(tmp_path)) == [(4, "torch.zeros", "A.f")]


OBJECT_COLLECTIVES = {"gather_object", "all_gather_object", "broadcast_object_list",
                      "scatter_object_list", "send_object_list", "recv_object_list"}


def test_object_collectives_run_on_the_host_group():
    """Object collectives pickle into tensors on their group's device: over NCCL the
    end-of-run gather staged world x the largest share on the GPU, beside the model
    and optimizer state. Every one must name `group=<grid>.host_group` (gloo)."""
    offending = []
    for path in product_files():
        with open(os.path.join(REPO, path)) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in OBJECT_COLLECTIVES:
                group = next((k.value for k in node.keywords if k.arg == "group"), None)
                if not (isinstance(group, ast.Attribute) and group.attr == "host_group"):
                    offending.append(f"{path}:{node.lineno} {node.func.attr}")
    assert not offending, "object collectives off grid.host_group:\n  " + "\n  ".join(offending)


# every torch.distributed function that communicates (tensor, object and point-to-point)
COLLECTIVES = OBJECT_COLLECTIVES | {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "all_gather_coalesced", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "broadcast",
    "_broadcast_coalesced", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier"}

RAW_COLLECTIVES = {  # "file:function:collective" -> why it may bypass parallel/comm.py
    "main.py:main:barrier": "the last collective, after training: no tensor of ours (the "
                            "group is bound to the rank's GPU by device_id)",
    "parallel/reference/torch_tp.py:TorchTP.clip_gradients:all_reduce":
        "PyTorch's TP reference, kept as PyTorch users write it; its norm is built on "
        "self.device",
    "parallel/strategy.py:Strategy.state_dict:gather_object":
        "an object collective on grid.host_group (gloo, host memory; "
        "test_object_collectives_run_on_the_host_group)",
    "telemetry/ranks.py:write_ranks:gather_object":
        "an object collective on grid.host_group (every rank's memory and replica digests, "
        "once at the end of training)",
    "checkpoint/snapshot_writer.py:save_sharded:broadcast_object_list":
        "an object collective on grid.host_group (the snapshot's id)",
    "checkpoint/snapshot_writer.py:save_sharded:all_gather_object":
        "an object collective on grid.host_group (the parts' indexes for the manifest)",
    "parallel/grid.py:ProcessGrid.first_line:all_gather_object":
        "an object collective on grid.host_group (a damaged snapshot's line, only when a "
        "rank has one)",
}


def raw_collectives(path, root=REPO):
    """[(line, collective, enclosing "Class.function")]: every `dist.<collective>` or
    `torch.distributed.<collective>` named (called or passed), and every collective
    imported by name from torch.distributed, in one file."""
    with open(os.path.join(root, path)) as f:
        tree = ast.parse(f.read(), path)
    found = []

    def is_dist(node):
        return (isinstance(node, ast.Name) and node.id == "dist") or (
            isinstance(node, ast.Attribute) and node.attr == "distributed"
            and isinstance(node.value, ast.Name) and node.value.id == "torch")

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, scope + [child.name])
                continue
            if isinstance(child, ast.Attribute) and child.attr in COLLECTIVES and is_dist(child.value):
                found.append((child.lineno, child.attr, ".".join(scope)))
            if isinstance(child, ast.ImportFrom) and child.module == "torch.distributed":
                found.extend((child.lineno, a.name, ".".join(scope)) for a in child.names
                             if a.name in COLLECTIVES)
            visit(child, scope)

    visit(tree, [])
    return found


def test_every_collective_goes_through_parallel_comm_or_is_a_listed_exception():
    """parallel/comm.py checks each tensor's device (CommCounter; checked_all_reduce for
    the ranks' uncounted agreements): a raw dist.all_reduce of a CPU flag would reach
    NCCL unchecked."""
    unlisted, used = [], set()
    for path in product_files():
        if path == "parallel/comm.py":
            continue
        for line, name, scope in raw_collectives(path):
            entry = f"{path}:{scope}:{name}"
            if entry in RAW_COLLECTIVES:
                used.add(entry)
            else:
                unlisted.append(f"{path}:{line} dist.{name} in {scope or 'module'}")
    assert not unlisted, ("collectives outside parallel/comm.py (use the strategy's comm, or "
                          "grid.max_over_ranks or comm.checked_all_reduce for an uncounted agreement, or add a "
                          "RAW_COLLECTIVES entry saying why):\n  " + "\n  ".join(unlisted))
    stale = set(RAW_COLLECTIVES) - used
    assert not stale, f"RAW_COLLECTIVES entries that no longer cover anything: {sorted(stale)}"


def test_the_scan_sees_a_raw_collective(tmp_path):
    (tmp_path / "m.py").write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed import barrier\n"
        "def f(t, ok):\n    dist.all_reduce(t, op=dist.ReduceOp.MAX)\n"
        "    torch.distributed.broadcast(t, 0)\n    dist.P2POp(dist.isend, t, 1)\n"
        "    ok(t)\n    return dist.get_rank(), dist.new_group([0])\n")
    assert raw_collectives("m.py", str(tmp_path)) == [
        (3, "barrier", ""), (5, "all_reduce", "f"), (6, "broadcast", "f"), (7, "isend", "f")]


def test_uncounted_agreement_refuses_a_tensor_on_another_device():
    from parallel.comm import WrongDevice, checked_all_reduce
    with pytest.raises(WrongDevice, match="all_reduce: tensor of shape \\(1,\\) is on meta, but "
                                          "the process groups work on cpu"):
        checked_all_reduce(torch.zeros(1, device="meta"), torch.device("cpu"))


@pytest.mark.parametrize("grid_device,tensor_device", [("cpu", "meta"), ("meta", "cpu")])
def test_counted_comm_refuses_a_tensor_on_another_device_than_the_grids(grid_device, tensor_device):
    """No process group is needed: the check runs before torch.distributed is called."""
    from parallel.comm import CommCounter, WrongDevice
    comm = CommCounter(torch.device(grid_device))
    wrong = torch.zeros(2, 3, device=tensor_device)
    right = torch.zeros(6, device=grid_device)
    calls = {
        "all_reduce": lambda: comm.all_reduce(wrong),
        "broadcast": lambda: comm.broadcast(wrong, src=0),
        "all_gather": lambda: comm.all_gather(right, wrong),
        "reduce_scatter": lambda: comm.reduce_scatter(wrong.view(-1), right),
        "send": lambda: comm.exchange(sends=[(wrong, 1)]),
        "recv": lambda: comm.exchange(recvs=[(wrong, 1)]),
    }
    for kind, call in calls.items():
        with pytest.raises(WrongDevice) as raised:
            call()
        message = str(raised.value)
        assert message.startswith(f"{kind}:") and f"is on {tensor_device}" in message \
            and f"work on {grid_device}" in message and "device=grid.device" in message, message
    assert comm.pop()["comm_calls"] == 0  # nothing was counted either


def test_each_rank_picks_its_gpu_or_says_why_it_cannot():
    """torchrun: LOCAL_RANK indexes the node's GPUs; a launcher that shows each task one
    GPU (srun --gpus-per-task=1): device 0 whatever LOCAL_RANK; more ranks than GPUs:
    one line (NCCL would fail on two ranks sharing a GPU)."""
    from errors import UserError
    from main import cuda_index
    assert [cuda_index(r, 8) for r in range(8)] == list(range(8))
    assert [cuda_index(r, 1) for r in range(4)] == [0, 0, 0, 0]
    with pytest.raises(UserError, match="LOCAL_RANK=5 but this task sees 4 CUDA devices"):
        cuda_index(5, 4)
    with pytest.raises(UserError, match="LOCAL_WORLD_SIZE=4 ranks on this node but each "
                                        "sees 1 CUDA device: two ranks would share a GPU"):
        cuda_index(0, 1, local_world=4)
    with pytest.raises(UserError, match="LOCAL_WORLD_SIZE=8 ranks on this node but each sees 4"):
        cuda_index(0, 4, local_world=8)  # every rank refuses, not only those past the GPUs
    assert cuda_index(3, 8, local_world=4) == 3


def test_a_rank_without_local_rank_is_not_put_on_gpu_0(monkeypatch):
    """Without LOCAL_RANK (a launcher other than torchrun) every rank fell back to local
    rank 0: all of a node's ranks on GPU 0. Now the launcher's own variable is read
    (Slurm's SLURM_LOCALID, Open MPI's), and with none a multi-rank job that sees several
    GPUs is refused with one line; one rank, or one GPU per task, still takes GPU 0."""
    import main
    from errors import UserError
    assert main.local_rank_from_env({}) is None
    assert main.local_rank_from_env({"SLURM_LOCALID": "3", "RANK": "11"}) == 3
    assert main.local_rank_from_env({"LOCAL_RANK": "1", "SLURM_LOCALID": "0"}) == 1
    assert main.local_rank_from_env({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}) == 2
    with pytest.raises(UserError, match="every rank would take GPU 0"):
        main.cuda_index(None, 4, world_size=8)
    assert main.cuda_index(None, 1, world_size=8) == 0  # srun --gpus-per-task=1
    assert main.cuda_index(None, 4, world_size=1) == 0  # python main.py on a 4-GPU box
    current = []  # and through pick_device, CUDA faked: refused before any device is touched
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(UserError, match="no LOCAL_RANK / SLURM_LOCALID"):
        main.pick_device("cuda", main.local_rank_from_env({}), 2)
    assert current == []


def test_torchrun_with_more_ranks_than_the_nodes_one_gpu_is_one_line(monkeypatch):
    """pick_device reads LOCAL_WORLD_SIZE: torchrun --nproc_per_node=2 on a one-GPU box
    put every rank on GPU 0 and NCCL failed with its own error. CUDA faked in process."""
    import main
    from errors import UserError
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for local_rank in (0, 1):
        with pytest.raises(UserError, match="LOCAL_WORLD_SIZE=2 ranks on this node"):
            main.pick_device("cuda", local_rank)
    assert current == []  # refused before any device is touched
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank per GPU: fine
    assert main.pick_device("cuda", 0) == torch.device("cuda", 0) and current == [0]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # no torchrun (srun --gpus-per-task=1)
    assert main.pick_device("auto", 0) == torch.device("cuda", 0)


# ---------------------------------------------------------------- offload: host gradients, device compute

def offloaded(grid, dp):
    """A one-layer GPT under `dp` (fsdp stage 3, or torch_fsdp: PyTorch's FSDP2) with
    parallel.offload, after one forward and backward: its gradients are host tensors."""
    from model import GPT, GPTConfig
    from parallel.config import ParallelConfig
    from parallel.initial import InitialWeights
    from parallel.parallelize import parallelize
    from training.config import TrainerConfig
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=11, block_size=8, dropout=0.0)
    with torch.device("meta"):
        meta = GPT(config)
    strategy = parallelize(meta, grid, ParallelConfig(dp=dp, zero_stage=3, offload=True),
                           InitialWeights(meta, seed=3))
    strategy.configure_optimizer(TrainerConfig())
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 11, (2, 8), generator=g) for _ in range(2))
    strategy.loss_and_gradients([(x, y)])
    return strategy


def test_the_norm_of_offloaded_gradients_ends_on_the_compute_device(one_rank_grid):
    """parallel.offload on a GPU crashed at step 1: the gradients are host tensors, and the
    squared norm was summed on the host whatever device it was asked for: NCCL refused
    it in the norm's all-reduce, and with one rank the trainer's read met the device's
    loss. `meta` stands for the GPU: fsdp3's host gradients, its norm asked for on meta
    (what the counted comm then checks), and torch_fsdp's clip returning on its device.
    On CPU the sum is the one foreach norm it always was, to the bit."""
    from parallel.comm import CommCounter
    from parallel.placement import grad_norm_squared
    meta = torch.device("meta")
    fsdp = offloaded(one_rank_grid, "fsdp")
    assert {g.device.type for g in fsdp.grads()} == {"cpu"}
    sq = grad_norm_squared(fsdp.regions(), meta)
    print(f"fsdp3 offload: host gradients, squared norm on {sq.device}")
    assert sq.device == meta and sq.shape == ()
    CommCounter(meta).check("all_reduce", sq)  # where NCCL's all-reduce takes it
    views = [r.values(r.opt_param.grad) for r in fsdp.regions() if r.in_norm]
    assert torch.equal(grad_norm_squared(fsdp.regions(), torch.device("cpu")),
                       torch.stack(torch._foreach_norm(views)).square().sum())
    reference = offloaded(one_rank_grid, "torch_fsdp")
    reference.device = meta  # its gradients stay CPU DTensors
    norm = reference.clip_gradients(float("inf"))
    print(f"torch_fsdp offload: norm on {norm.device}")
    assert norm.device == meta and norm.shape == ()


def test_fp16_unscales_offloaded_gradients_on_their_own_device():
    """fp16 with parallel.offload crashed at step 1 on a GPU: GradScaler's kernel got the
    overflow flag and the inverse scale on the GPU beside host gradients (CUDA's kernel
    wants one device; the CPU's, handed a flag elsewhere, unscales nothing at all). Each
    device's gradients are unscaled with a flag and scale of their own, the flags summed
    on the compute device (`meta` stands for the GPU: the host gradients must come out
    halved and the flag on meta); on one device, an inf is found and a clean step is not."""
    from parallel.precision import unscale_and_find_inf
    meta, cpu = torch.device("meta"), torch.device("cpu")
    host = [torch.full((3,), 4.0), torch.full((2, 2), 6.0)]
    found = unscale_and_find_inf(host, 0.5, meta)
    print(f"host gradients after unscaling by 0.5: {[g.tolist() for g in host]}, flag on {found.device}")
    assert found.device == meta and found.shape == (1,)
    assert [g.tolist() for g in host] == [[2.0] * 3, [[3.0, 3.0], [3.0, 3.0]]]
    clean, bad = [torch.full((3,), 4.0)], [torch.tensor([1.0, float("inf")])]
    assert unscale_and_find_inf(clean, 0.25, cpu).item() == 0 and clean[0].tolist() == [1.0] * 3
    assert unscale_and_find_inf(clean + bad, 0.25, cpu).item() > 0


def test_a_wrong_device_is_not_reported_as_another_ranks_failure():
    """main.py turns a collective's failure into one line per rank; a WrongDevice (whose
    text names NCCL) was read as "another rank stopped", on the rank that made the
    mistake. It is a defect of this program: raised with its traceback. A backend's own
    failure is still one line."""
    from errors import UserError
    from parallel.comm import CommCounter, WrongDevice, collective_failure
    with pytest.raises(WrongDevice) as raised:
        CommCounter(torch.device("meta")).all_reduce(torch.zeros(()))
    line = collective_failure(raised.value, 60)
    print(f"WrongDevice -> {line!r}")
    assert line is None
    peer = collective_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"), 60)
    assert isinstance(peer, UserError) and "another rank stopped" in str(peer)
