"""A replica group's step in process: fault_tolerance/replica_group.py and trainer.py's ft
path through main.train, with a stand-in for torchft's Manager (no lighthouse, no launch).

- a step the vote rejects leaves weights, AdamW state, the fp16 scaler and the step (the
  learning rate's position) as they were before it, and the redone run's every record is
  the uninterrupted run's, to the bit (Strategy.drop_step, Trainer.compute_step);
- a redo on trainer.profile_from opens the profiler once (Trainer.train);
- the next quorum starts after the optimizer step, and none after the last step;
- the sum across groups holds at most one bucket beyond the gradients (sum_across), each
  bucket of one dtype, the loss and tokens in fp32 only;
- the healing state is read only after the device has run what was queued (_state);
- the next step's quorum, started as a step ends (stepped), hands a healing group the
  live state on its own thread, and begin_step takes it on the trainer's; a batch read
  ahead for the shares a group held serves the next step only if its quorum dealt them,
  and only the step it was read for;
- a healing state damaged on its way (a flipped bit) is refused in one line naming the
  tensor, before anything loads (its checksums, state_transfer.damage_in).

The stand-in is one group alone of ft.replicas=1: its all-reduce is the identity, its vote
says no on the tries the test names. The real launches (a lighthouse, groups killed) are
tests/test_fault_tolerance.py's.
"""

import pytest
import torch

import main
from config import load_config
from fault_tolerance import replica_group, state_transfer
from fault_tolerance.replica_group import ReplicaGroup
from harness import TINY, read_metrics

FT = ["ft.enabled=true", "parallel.timeout_s=120", "trainer.max_steps=4"]
REJECTED = 3  # the first try of step 3 is voted down
# what a record must repeat to the bit (timings aside)
EXACT = ("step", "loss", "grad_norm", "lr", "loss_scale", "step_skipped", "skipped_steps",
         "ft_live_groups")


class Done:
    def wait(self):
        return None


class StandInManager:
    """torchft's Manager as ReplicaGroup uses it, for one group alone: the all-reduce is
    the identity; should_commit says no on the tries (start_quorum calls, from 1) in
    `reject`. At each try's quorum it records the state a healing peer would get
    (state_dict: weights, AdamW moments and step, the fp16 scaler, the step) and what
    gradients are left over."""

    def __init__(self, load_state_dict, state_dict, reject=(), strategy=None):
        self.state_dict, self.reject, self.strategy = state_dict, set(reject), strategy
        self.step, self.tries, self.seen = 0, 0, []

    def load_state_dict(self, state):
        self.step = state["step"]

    def start_quorum(self):
        self.tries += 1
        state = self.state_dict()
        left = sum(float(g.abs().sum()) for g in self.strategy.grads() if g is not None)
        self.seen.append((self.tries, state, left))

    def errored(self):
        return None

    def participating_rank(self):
        return 0

    def num_participants(self):
        return 1

    def current_step(self):
        return self.step

    def allreduce(self, tensor, reduce_op=None):
        return Done()

    def should_commit(self):
        if self.tries in self.reject:
            return False
        self.step += 1
        return True

    def shutdown(self, wait=True):
        pass


def train(tmp_path, name, grid, monkeypatch, overrides, reject=(), after_step=None):
    """main.train of a tiny ft.enabled run, its manager the stand-in; returns (records,
    stand-in, the lr of every optimizer_step/drop_step call). after_step(group, stand-in):
    called after each optimizer_step."""
    cfg = load_config(TINY + FT + [f"trainer.run_dir={tmp_path / name}"] + overrides, 1)
    made, lrs = [], []

    def manager(group, load_state_dict, state_dict):
        made.append(StandInManager(load_state_dict, state_dict, reject, group.strategy))
        step = group.strategy.optimizer_step

        def optimizer_step(lr):
            lrs.append(lr)
            out = step(lr)
            if after_step is not None:
                after_step(group, made[-1])
            return out
        group.strategy.optimizer_step = optimizer_step
        return made[-1]
    monkeypatch.setattr(ReplicaGroup, "_torchft_manager", manager)
    main.train(cfg, grid)
    return read_metrics(tmp_path / name), made[0], lrs


def same_state(a, b):
    """held_state dicts equal to the bit."""
    assert a.keys() == b.keys()
    assert a["tensors"].keys() == b["tensors"].keys()
    for key, t in a["tensors"].items():
        assert torch.equal(t, b["tensors"][key]), key
    assert (a["step"], a["precision"]) == (b["step"], b["precision"])


@pytest.mark.parametrize("layout", [
    ["parallel.dp=single"],
    ["parallel.dp=single", "trainer.precision=fp16", "trainer.fp16_growth_interval=2"],
    ["parallel.dp=fsdp", "parallel.zero_stage=3"],
    ["parallel.dp=single", "model.moe_experts=4", "model.moe_top_k=2"],
], ids=["single", "single-fp16", "fsdp3", "single-experts"])
def test_a_rejected_step_changes_nothing_and_its_redo_is_the_uninterrupted_step(
        tmp_path, one_rank_grid, monkeypatch, layout):
    """The vote rejects step 3's first try: at the redo's quorum, weights, AdamW state
    (moments and step count), the fp16 scaler (fp16: its good-step count, which the
    rejected try's unscale advanced, and the scale, which doubles every 2 good steps) and
    the step are what they were at the rejected try's, no gradient is left over, and the
    redo ran at the same learning rate; every record of the run equals the uninterrupted
    run's to the bit. Red when the rejected step updates the model (drop_step without
    skip_step), keeps its gradients (drop_step calling step_optimizer, not
    optimizer_step), or keeps its scaler change (compute_step's load_state dropped); and
    when the rejected try's quorum, started as step 2 ends (group.stepped), starts before
    step 2's optimizer step (a healing peer would be sent weights without it)."""
    plain, _, plain_lrs = train(tmp_path, "plain", one_rank_grid, monkeypatch, layout)
    redone, manager, lrs = train(tmp_path, "redone", one_rank_grid, monkeypatch, layout,
                                 reject=[REJECTED])
    tries = {t: (state, left) for t, state, left in manager.seen}
    assert len(tries) == 5 and tries[REJECTED][0]["step"] == REJECTED - 1
    before, after = tries[REJECTED], tries[REJECTED + 1]
    print(f"at the rejected try: grads left {before[1]}; at its redo: {after[1]}; precision "
          f"{before[0]['precision']} / {after[0]['precision']}")
    same_state(before[0], after[0])
    assert before[1] == after[1] == 0.0, "gradients left over from the step before"
    assert lrs[REJECTED - 1] == lrs[REJECTED] == plain_lrs[REJECTED - 1]
    assert [r["ft_uncommitted_steps"] for r in redone] == [0, 0, 1, 1]
    for a, b in zip(plain, redone, strict=True):
        assert {k: a.get(k) for k in EXACT} == {k: b.get(k) for k in EXACT}, (a, b)


class Ran:
    """ReplicaGroup._background's thread, its fn run at once on the caller's thread: a
    quorum started by `stepped` reads the state exactly where the trainer started it."""

    def __init__(self, fn, name):
        self.name, self.started, self.result, self.error = name, 0.0, None, None
        try:
            self.result = fn()
        except Exception as e:
            self.error = e

    def join(self):
        pass


def test_the_next_quorum_starts_after_the_optimizer_step_and_none_after_the_last(
        tmp_path, one_rank_grid, monkeypatch):
    """trainer.max_steps=4, the quorums run where they are started (Ran): the stand-in's
    start_quorum reads the state a healing peer would be sent (held_state). Quorum k+1,
    started as step k ends (group.stepped), holds exactly the weights and AdamW state that
    step k's optimizer step left; step k's optimizer step runs with k quorums started; no
    quorum starts after the last step (4 in all). Red when the next quorum starts before
    the optimizer step (a healing peer sent the weights before it), or after the last step
    (stepped(True): a quorum the run never uses, the other groups held up by it)."""
    monkeypatch.setattr(ReplicaGroup, "_background", staticmethod(Ran))
    after = []  # (quorums started, the state) after each optimizer step
    _, manager, _ = train(tmp_path, "ordered", one_rank_grid, monkeypatch, ["parallel.dp=single"],
                          after_step=lambda group, m: after.append((m.tries, group._state())))
    started = [n for n, _ in after]
    quorums = [state for _, state, _ in manager.seen]
    off = [max(float((q["tensors"][k] - a["tensors"][k]).abs().max())
               for k in a["tensors"] if k.startswith("model/"))
           for (_, a), q in zip(after, quorums[1:])]
    print(f"quorums started at each optimizer step: {started}, in all {len(quorums)}; the "
          f"next quorum's weights off the step's by {off}")
    assert started == [1, 2, 3, 4] and len(quorums) == 4
    for (_, a), q in zip(after, quorums[1:], strict=False):
        same_state(a, q)


class CountingProfile:
    """torch.profiler.profile, counting the windows opened and the traces written."""
    opened, exported = [], []

    def __init__(self, **kwargs):
        CountingProfile.opened.append(kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def export_chrome_trace(self, path):
        CountingProfile.exported.append(path)


class CountingRange:
    """torch.profiler.record_function, recording each range's entry and exit."""
    events = []

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        CountingRange.events.append(("enter", self.name))

    def __exit__(self, *exc):
        CountingRange.events.append(("exit", self.name))


def test_a_redo_on_profile_from_opens_the_profiler_once(tmp_path, one_rank_grid, monkeypatch):
    """trainer.profile_from=3, profile_steps=2, step 3's first try voted down: one
    profiler window (one trace), and each step's range opened and closed once, the redo
    inside its step's range. Red when the redo goes through before_step again (a second
    profiler opened over the first, its range left open)."""
    CountingProfile.opened, CountingProfile.exported, CountingRange.events = [], [], []
    monkeypatch.setattr(torch.profiler, "profile", CountingProfile)
    monkeypatch.setattr(torch.profiler, "record_function", CountingRange)
    train(tmp_path, "profiled", one_rank_grid, monkeypatch,
          ["parallel.dp=single", f"trainer.profile_from={REJECTED}", "trainer.profile_steps=2"],
          reject=[REJECTED])
    steps = [e for e in CountingRange.events if e[1].startswith("train step")]
    print(f"{len(CountingProfile.opened)} profiler(s) opened; ranges: {steps}")
    assert len(CountingProfile.opened) == 1 and len(CountingProfile.exported) == 1
    assert steps == [(k, f"train step {n}") for n in (REJECTED, REJECTED + 1)
                     for k in ("enter", "exit")]


class Recorder:
    """A stand-in process group's all-reduce over two groups whose every figure is this
    group's: the sum doubles each tensor, in place (it allocates nothing)."""

    def __init__(self):
        self.reduced = []

    def allreduce(self, tensor, reduce_op=None):
        self.reduced.append(tensor.numel())
        tensor.mul_(2)
        return Done()

    def should_commit(self):
        return True


def new_bytes(fn):
    """(fn(), bytes of the storages that the operators run inside fn allocated): every
    output whose storage none of the operator's inputs has (views, in-place and out=
    operators allocate nothing)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                     if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                    Count.total += t.untyped_storage().nbytes()
                    given.add(t.untyped_storage().data_ptr())
            return out
    with Count():
        result = fn()
    return result, Count.total


def group_over_grads(grads, replica_id=0, replicas=2):
    """A ReplicaGroup (of ft.replicas=2, holding share 0) around the Recorder."""
    from types import SimpleNamespace
    ft = SimpleNamespace(replicas=replicas, replica_id=replica_id, timeout_s=60.0)
    grid = SimpleNamespace(device=torch.device("cpu"), rank=0, is_main=True,
                           first_line=lambda line: line)  # one rank: its own line
    group = object.__new__(ReplicaGroup)
    group.ft, group.grid, group.token, group.shares = ft, grid, 7, [0]
    group.numbers, group.refused = None, None
    group.manager = Recorder()
    return group


@pytest.mark.parametrize("bucket_mb", [32, 0.01], ids=["one-bucket", "small-buckets"])
def test_the_sum_across_groups_holds_at_most_one_bucket_beyond_the_gradients(monkeypatch, bucket_mb):
    """sum_across over a tiny GPT's gradients (as `single` holds them: 28 tensors, 112 KB),
    under a dispatch mode counting the bytes of every tensor it allocates: at most the
    gradients' bytes once (they fit one bucket), or one bucket (BUCKET_MB=0.01: 10 KB;
    tensors split across buckets, the larger ones reduced in place), plus the figures; and the sum is right, every
    element where it was (the stand-in doubles, the weight of share 0 of 2 halves), the
    loss and tokens in the same all-reduce as the (last fp32) bucket. Red for a flat copy
    of all the gradients, scaled out of place and concatenated with the figures (3x the
    gradient bytes) or anything over one bucket."""
    from model import GPT, GPTConfig
    monkeypatch.setattr(replica_group, "BUCKET_MB", bucket_mb)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=16))
    grads = [torch.randn_like(p) for p in model.parameters()]
    before = [g.clone() for g in grads]
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    group = group_over_grads(grads)
    loss, allocated = new_bytes(lambda: group.sum_across(torch.tensor(3.25), grads))
    bucket = min(grad_bytes, int(bucket_mb * 2**20) // 4 * 4)
    print(f"{len(grads)} gradients, {grad_bytes} B; sum_across allocated {allocated} B "
          f"(bucket {bucket} B) in {len(group.manager.reduced)} all-reduces")
    assert allocated <= bucket + 64, f"{allocated} B beyond the gradients (bucket {bucket} B)"
    assert loss.item() == 3.25 and group._who.tolist() == [14.0, 0.0]
    for g, b in zip(grads, before):
        assert torch.equal(g, b)
    # every element crosses once, the figures (loss, 2 tokens) with a bucket: one
    # all-reduce for all when they fit one
    assert sum(group.manager.reduced) == sum(g.numel() for g in grads) + 3
    assert len(group.manager.reduced) == 1 if bucket_mb == 32 else len(group.manager.reduced) >= 3


def test_the_loss_and_tokens_never_cross_in_a_bf16_bucket():
    """bf16 gradients: the loss and the start tokens (up to 2**20, exact in fp32 only) take
    an all-reduce of their own, in fp32, after the gradients'. Red when they ride with
    the bf16 bucket (the token comes back rounded)."""
    grads = [torch.randn(40, dtype=torch.bfloat16), torch.randn(9, dtype=torch.bfloat16)]
    group = group_over_grads(grads)
    group.token = 2**20 - 1
    loss = group.sum_across(torch.tensor(3.25), grads)
    assert group.manager.reduced == [49, 3]
    assert loss.item() == 3.25 and group._who.tolist() == [2.0 * (2**20 - 1), 0.0]


@pytest.mark.parametrize("bucket_mb", [32, 64 / 2**20], ids=["one-bucket", "16-element-buckets"])
@pytest.mark.parametrize("first", ["bf16", "fp32"])
def test_mixed_bf16_and_fp32_gradients_cross_in_buckets_of_their_own_dtype(monkeypatch, bucket_mb,
                                                                           first):
    """bf16 and fp32 gradients interleaved (bf16 or fp32 first), in one bucket or buckets
    of 16 elements, and a start token of 2097150 (exact in fp32, 2097152 in bf16): no
    bucket mixes dtypes, every gradient comes back exactly (the stand-in doubles, share 0
    of 2 halves: x / 2 * 2 is exact in either dtype), the token sum is 2 x 2097150 and the
    loss 3.25, exactly. Red when a bucket's buffer takes the dtype of the first bucket that
    needs one and is reused (fp32 gradients rounded to bf16, the loss and tokens riding in
    a bf16 buffer), or when buckets() packs both dtypes together."""
    monkeypatch.setattr(replica_group, "BUCKET_MB", bucket_mb)
    other = "fp32" if first == "bf16" else "bf16"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}
    torch.manual_seed(0)
    grads = [torch.randn(n, dtype=dtype[d]) for n, d in
             ((10, first), (4, first), (9, other), (3, other), (6, first), (12, other))]
    before = [g.clone() for g in grads]
    cap = max(1, min(int(bucket_mb * 2**20) // 4, sum(g.numel() for g in grads)))
    cut = list(replica_group.buckets(grads, cap, torch.device("cpu")))
    print(f"cap {cap}: buckets " + ", ".join(
        "+".join(f"{e - s}{str(g.dtype)[6:]}" for g, s, e in b) for b in cut))
    group = group_over_grads(grads)
    group.token = 2097150
    loss = group.sum_across(torch.tensor(3.25), grads)
    print(f"loss {loss.item()}, tokens {group._who.tolist()}; largest change of a gradient: " +
          ", ".join(f"{str(g.dtype)[6:]} {float((g.float() - b.float()).abs().max()):.3g}"
                    for g, b in zip(grads, before)))
    assert loss.item() == 3.25 and group._who.tolist() == [2.0 * 2097150, 0.0]
    for g, b in zip(grads, before):
        assert g.dtype == b.dtype and torch.equal(g, b), (g.dtype, g, b)
    assert sum(group.manager.reduced) == sum(g.numel() for g in grads) + 3
    assert all(len({g.dtype for g, *_ in b}) == 1 for b in cut), "a bucket mixes dtypes"


def test_buckets_cover_every_element_once_in_order():
    """buckets() over contiguous, non-contiguous and large gradients: the pieces tile each
    gradient in order, no bucket holds more than cap elements but a non-contiguous
    gradient larger than it, and a large contiguous one is alone (reduced in place)."""
    cap = 10
    grads = [torch.zeros(7), torch.zeros(4, 3).t(), torch.zeros(25), torch.zeros(3),
             torch.zeros(12).view(3, 4)[:, :2], torch.zeros(0), torch.zeros(9)]
    seen = {i: [] for i in range(len(grads))}
    for bucket in replica_group.buckets(grads, cap, torch.device("cpu")):
        size = sum(e - s for _, s, e in bucket)
        alone = len(bucket) == 1
        if any(g is grads[2] for g, *_ in bucket):
            assert alone and replica_group.in_place(bucket[0], cap, torch.device("cpu"))
        else:
            assert size <= cap or (alone and not bucket[0][0].is_contiguous()), bucket
            assert not any(replica_group.in_place(p, cap, torch.device("cpu")) for p in bucket)
        for g, s, e in bucket:
            seen[next(i for i, h in enumerate(grads) if h is g)].append((s, e))
    for i, g in enumerate(grads):
        ends = [0] + [e for _, e in seen[i]]
        assert [s for s, _ in seen[i]] == ends[:-1] and ends[-1] == g.numel(), (i, seen[i])


def test_the_healing_state_is_read_after_the_device_is_synchronized(monkeypatch):
    """_state (torchft's thread, a peer joining) waits for the device before held_state
    reads anything: a recorder of the two calls. Red without the wait, or with it after
    the read."""
    calls = []
    monkeypatch.setattr(replica_group, "wait_for_device", lambda device: calls.append("wait"))
    monkeypatch.setattr(replica_group, "held_state",
                        lambda strategy, step, replica_id, numbers: calls.append("read") or {})
    group = group_over_grads([])
    group.strategy = None
    group.manager.current_step = lambda: 4
    group._state()
    assert calls == ["wait", "read"]


def test_waiting_for_the_device_synchronizes_it_and_not_the_cpu(monkeypatch):
    """wait_for_device: torch.accelerator.synchronize on an accelerator's device, nothing
    on the CPU (no accelerator needed: synchronize faked)."""
    calls = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: calls.append(device))
    state_transfer.wait_for_device(torch.device("cpu"))
    assert calls == []
    state_transfer.wait_for_device(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)]


class Windows:
    """A dataset whose batch is the window starts it is asked for."""

    def batch(self, starts):
        return starts.clone()


def test_a_read_ahead_serves_a_step_only_for_the_shares_its_quorum_dealt():
    """StepBatches (training/batches.py) of ft.replicas=2: a replica group reads the next
    step's batches ahead for the shares it held (ReplicaGroup.next_shares); its quorum
    dealing others (group 1 left: group 0 holds both shares; a group joined: it holds one
    again, or another one), the step reads the shares it was dealt, and the read ahead is
    used only when they are the same. Red when take matches the step alone (before
    ft-overlap: the read ahead of the wrong shares trained the step)."""
    from types import SimpleNamespace
    from char_dataset import GlobalBatches
    from training.batches import StepBatches
    grid = SimpleNamespace(data_rank=0, data_size=1, all_ok=lambda ok: ok)
    batches = StepBatches(GlobalBatches(1000, 8, seed=1), Windows(), grid, grad_accum=2)
    fresh = lambda step, shares: batches._read(step, shares, 2)[0]  # noqa: E731
    for held, dealt in (([0], [0, 1]), ([0, 1], [0]), ([1], [0]), ([0], [0]), ([0, 1], [0, 1])):
        assert batches.read_ahead(5, held, 2) is None
        ahead = batches.ahead
        micro, _ = batches.take(5, dealt, 2)
        want = fresh(5, dealt)
        assert len(micro) == len(want) and all(torch.equal(a, b) for a, b in zip(micro, want)), \
            (held, dealt)
        assert (micro is ahead[2]) == (held == dealt) and batches.ahead is None


@pytest.mark.parametrize("shares", [[0], [1], [0, 1]], ids=["share0", "share1", "both"])
def test_a_read_ahead_serves_only_the_step_it_was_read_for(shares):
    """StepBatches of ft.replicas=2: a group reads ahead for step 5 with the shares it held,
    then its quorum jumps it to step 7 (it healed from a group ahead) with the same shares:
    step 7's micro-batches are read fresh, equal (exactly) to those a StepBatches that never
    read ahead takes for step 7, and not step 5's; a read ahead for step 7 is served as
    read. Red when take matches the shares alone (the read ahead of step 5 trains step 7)."""
    from types import SimpleNamespace
    from char_dataset import GlobalBatches
    from training.batches import StepBatches
    grid = SimpleNamespace(data_rank=0, data_size=1, all_ok=lambda ok: ok)
    new = lambda: StepBatches(GlobalBatches(1000, 8, seed=1), Windows(), grid, grad_accum=2)  # noqa: E731
    batches, never = new(), new()
    assert batches.read_ahead(5, shares, 2) is None
    ahead = batches.ahead[2]
    micro, _ = batches.take(7, shares, 2)
    want, _ = never.take(7, shares, 2)
    five, _ = never.take(5, shares, 2)
    same = lambda a, b: len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))  # noqa: E731
    print(f"step 7 took {[m.tolist() for m in micro]}; read fresh: {[m.tolist() for m in want]}; "
          f"step 5's: {[m.tolist() for m in five]}")
    assert not same(want, five), "steps 5 and 7 read the same windows: the test sees nothing"
    assert micro is not ahead and same(micro, want) and batches.ahead is None
    assert batches.read_ahead(7, shares, 2) is None  # read ahead for the step it serves
    ahead = batches.ahead[2]
    assert batches.take(7, shares, 2)[0] is ahead and same(ahead, want)


class HealingManager(StandInManager):
    """torchft's Manager as a healing group's quorum meets it: start_quorum hands the live
    state over through load_state_dict, on the thread that runs it."""

    def __init__(self, load_state_dict, state_dict):
        super().__init__(load_state_dict, state_dict)
        self.load, self.step = load_state_dict, 7

    def start_quorum(self):
        self.load({"numbers": None, "replica_id": 1, "tensors": {}, "crc32c": {}})

    def num_participants(self):
        return 2


def test_the_live_state_is_taken_by_begin_step_on_the_trainers_thread(monkeypatch):
    """The next step's quorum, started early (stepped) on its own thread while the step
    before ends, brings a healing group the live state: it is kept, and taken by
    begin_step on the trainer's thread (the weights change only between two steps), then
    the quorum's step and shares are dealt. Red when _load takes it at once, on the
    quorum's thread."""
    import threading
    taken = []
    monkeypatch.setattr(replica_group, "load_held_state",
                        lambda strategy, sent: taken.append(threading.current_thread()))
    group = group_over_grads([])
    group.strategy, group.events, group.healed_from, group.sent = None, {}, None, None
    group.manager = HealingManager(group._load, group._state)
    group.stepped(True)
    assert group.next_shares() == [0]  # the shares held: read ahead for the next step
    group.quorum.join()  # the state arrived on the quorum's thread ...
    assert taken == [] and group.quorum.name == "ft-quorum"
    assert group.begin_step() == (7, [0])  # ... and is taken here
    assert taken == [threading.current_thread()] and "ft_heal_s" in group.events


class TimedOutOnce(StandInManager):
    """A quorum request that times out once (its group was stopped while it waited), as
    torchft's Manager does it: the failed quorum's error is raised again by the next
    start_quorum unless _quorum_future is cleared."""

    def __init__(self, load_state_dict, state_dict):
        super().__init__(load_state_dict, state_dict)
        self._quorum_future, self.asked = None, 0

    def start_quorum(self):
        self.asked += 1
        if self._quorum_future is not None or self.asked == 1:
            self._quorum_future = "failed"
            raise TimeoutError("Timeout expired")


def test_an_early_quorum_that_timed_out_is_asked_again_and_a_late_one_is_not():
    """A quorum started as the step before ended (stepped) that fails (a group stopped
    meanwhile, SIGSTOP: its request timed out) is asked once more in begin_step, and the
    step goes on; a quorum asked in begin_step that fails ends the run (QuorumLost: the
    lighthouse gone). Red without the second request (the stopped group ended with "no
    quorum", tests/test_fault_tolerance.py's hung group), or without forgetting the
    failed one (torchft raises it again)."""
    import socket
    group = group_over_grads([])
    with socket.socket() as standing:  # the lighthouse, still accepting connections
        standing.bind(("localhost", 0))
        standing.listen()
        group.ft.lighthouse = f"localhost:{standing.getsockname()[1]}"
        group.events, group.healed_from, group.sent = {}, None, None
        group.manager = TimedOutOnce(group._load, group._state)
        group.stepped(True)
        assert group.begin_step() == (0, [0, 1]) and group.manager.asked == 2  # alone: both shares
        group.manager.asked = 0  # the next one fails once too, asked in begin_step: not again
        with pytest.raises(replica_group.QuorumLost, match="Timeout expired"):
            group.begin_step()
        assert group.manager.asked == 1
    # the lighthouse gone: an early quorum that failed is not asked again (the groups end
    # within ft.timeout_s, not twice that; red without the lighthouse.answers check)
    group.ft.lighthouse, group.manager.asked = "localhost:1", 0
    group.stepped(True)
    with pytest.raises(replica_group.QuorumLost, match="Timeout expired"):
        group.begin_step()
    assert group.manager.asked == 1


def test_a_damaged_healing_state_is_refused_in_one_line_before_anything_loads(
        tmp_path, one_rank_grid, monkeypatch):
    """The state a live group sends (held_state, as its quorum recorded it) carries each
    tensor's CRC-32C; the same state with one bit flipped in one tensor (its size the
    same) is refused by the healing group's _take in one line naming the tensor and the
    sending group, and nothing is loaded; the intact state loads. Red without the check
    (_take not calling damage_in): DID NOT RAISE, the damaged state loaded."""
    from errors import UserError
    _, manager, _ = train(tmp_path, "live", one_rank_grid, monkeypatch, ["parallel.dp=single"])
    sent = manager.seen[-1][1]
    assert state_transfer.damage_in(sent) is None
    key = next(k for k in sent["tensors"] if k.startswith("model/transformer.h.0.attn.c_attn.weight@"))
    loaded = []
    monkeypatch.setattr(replica_group, "load_held_state", lambda strategy, got: loaded.append(got))
    group = group_over_grads([])
    group.strategy = None  # load_held_state is the recorder
    group._take(sent)
    assert loaded == [sent]
    damaged = dict(sent, tensors=dict(sent["tensors"]))
    t = damaged["tensors"][key].clone()
    t.view(-1).view(torch.int32)[5] ^= 1 << 30  # one flipped bit: 0.02 -> about 1e37
    damaged["tensors"][key] = t
    with pytest.raises(UserError) as refused:
        group._take(damaged)
    line = str(refused.value)
    name, _, box = key.partition("@")
    assert f"tensor {name!r} (box {box}) does not match its crc32c checksum" in line, line
    assert "from group 0 is damaged" in line and "\n" not in line
    assert loaded == [sent]  # the damaged state was not loaded
