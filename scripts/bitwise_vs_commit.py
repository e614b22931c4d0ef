"""Change no number: this checkout's training runs against those of a base commit, bitwise.

    python scripts/bitwise_vs_commit.py [--base ed1af4f] [--matrix full|small]
                                        [--only NAME,...] [--keep DIR] [--jobs J] [--list]

The base commit is written out of this checkout's git history (`git archive`, nothing in
the checkout changes) into a temporary directory. Each layout of the matrix (every data
parallel strategy and ZeRO stage, hybrid sharding, offload, tensor parallelism with
sequence parallelism, every pipeline schedule, context parallelism, bf16, fp16 with its
loss scaler, recompute, compile, accumulation, fault-tolerant replica groups; `--list`)
runs main.py under both trees with the same overrides: a tiny model with dropout, 6 steps,
an evaluation and a snapshot at step 3 and at the end, gloo, one thread per rank, the
embedded corpus (`torchrun --standalone --nproc_per_node=N main.py ...`, or `python
main.py ...` for one process). Then, bitwise:

- metrics.jsonl: the logged steps, and each step's `loss`, `grad_norm` (pre-clip),
  `val_loss` (present in both or in neither), `lr`, and the fp16 `loss_scale` and
  `skipped_steps`;
- the final snapshot: every canonical tensor (names, dtypes, shapes, bits), and its
  `step`, `samples_seen` and `precision` (the fp16 loss scaler's state). Each tree's
  snapshots are read by that tree's own reader (checkpoint.snapshot_reader);
- resume (layouts marked so): the base's snapshot of step 3, resumed by this checkout
  (`trainer.resume_step=3`), logs the base's own steps 4-6 and ends with its final
  snapshot.

"This checkout" is the working tree this script lives in, uncommitted changes included
(`--new COMMIT`: that commit instead, written out as the base is).
One row per layout (`identical`, or the first differing step and field, or tensor); exit
status 1 on any difference or failed run, 2 when the base commit is not in the history (a
shallow clone: `git fetch --unshallow`). tests/test_bitwise_vs_commit.py runs the small
matrix in the suite.
"""

import argparse
import io
import json
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = "ed1af4f"  # issue 43's base: the commit before the redesign
STEPS, RESUME_AT = 6, 3
# a tiny model with dropout (the random streams must stay those of the base too); 4 layers
# so that interleaved and ZB-V pipelines have two chunks per rank; batch 12 divides over
# 1-4 data-parallel ranks, 2 micro-steps and 2 or 4 pipeline micro-batches
COMMON = ["model.n_layer=4", "model.n_head=2", "model.n_embd=32", "model.dropout=0.1",
          "data.block_size=16", "trainer.batch_size=12", f"trainer.max_steps={STEPS}",
          "trainer.warmup_steps=2", "trainer.log_every=1", f"trainer.eval_every={RESUME_AT}",
          "trainer.eval_batches=2", f"trainer.save_every={RESUME_AT}", "trainer.keep_snapshots=2",
          "sample.length=0", "wandb.mode=disabled", "parallel.timeout_s=120"]
# compared per step: the three, and the learning rate and fp16 loss scaler's
# numbers where the base logs them
FIELDS = ("loss", "grad_norm", "val_loss", "lr", "loss_scale", "skipped_steps")
SNAPSHOT_META = ("step", "samples_seen", "precision")


@dataclass
class Layout:
    name: str
    nproc: int
    overrides: list
    resume: bool = False  # also resume the base's step-3 snapshot under this checkout
    groups: int = 0  # > 0: fault-tolerant replica groups (a lighthouse, one launch per group)
    what: str = ""


def _pp(schedule, microbatches=4, *extra):
    return ["parallel.dp=ddp_bucket", "parallel.pp=2", f"parallel.pp_schedule={schedule}",
            f"parallel.microbatches={microbatches}", *extra]


FSDP = lambda stage: ["parallel.dp=fsdp", f"parallel.zero_stage={stage}"]  # noqa: E731

LAYOUTS = [
    Layout("single", 1, ["parallel.dp=single"], resume=True),
    Layout("single_fp16", 1, ["parallel.dp=single", "trainer.precision=fp16",
                              "trainer.fp16_init_scale=262144", "trainer.fp16_growth_interval=2"],
           resume=True, what="the loss scaler skips step 1, halves, grows at 3 and 5, skips 6"),
    Layout("single_bf16_recompute", 1, ["parallel.dp=single", "trainer.precision=bf16",
                                        "trainer.activation_checkpointing=true"], resume=True),
    Layout("single_compile", 1, ["parallel.dp=single", "trainer.compile=true",
                                 "trainer.compile_backend=aot_eager"], resume=True),
    Layout("ddp_naive_x2", 2, ["parallel.dp=ddp_naive"], resume=True),
    Layout("ddp_bucket_x2_recompute", 2, ["parallel.dp=ddp_bucket", "parallel.bucket_cap_mb=0.01",
                                          "trainer.activation_checkpointing=true"], resume=True,
           what="several buckets; the base has no selective recompute"),
    Layout("ddp_bucket_ring_x3_bf16reduce", 3, ["parallel.dp=ddp_bucket", "parallel.allreduce=ring",
                                                "parallel.reduce_dtype=bf16"], resume=True),
    Layout("ddp_bucket_x2_bf16", 2, ["parallel.dp=ddp_bucket", "trainer.precision=bf16"], resume=True),
    Layout("torch_ddp_x2", 2, ["parallel.dp=torch_ddp"], resume=True),
    Layout("fsdp1_x2", 2, FSDP(1), resume=True),
    Layout("fsdp2_x3", 3, FSDP(2), resume=True, what="uneven shards"),
    Layout("fsdp3_x2_accum2", 2, FSDP(3) + ["trainer.grad_accum=2"], resume=True),
    Layout("fsdp2_x2_offload", 2, FSDP(2) + ["parallel.offload=true"], resume=True),
    Layout("hsdp2x2_fsdp3", 4, FSDP(3) + ["parallel.dp_replicate=2"], resume=True),
    Layout("torch_fsdp_x2", 2, ["parallel.dp=torch_fsdp"], resume=True),
    Layout("tp2_sp", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"], resume=True),
    Layout("tp2_torch", 2, ["parallel.tp=2", "parallel.tp_impl=torch"], resume=True),
    Layout("pp2_gpipe", 2, _pp("gpipe", 2), resume=True),
    Layout("pp2_1f1b", 2, _pp("1f1b"), resume=True),
    Layout("pp2_interleaved", 2, _pp("interleaved", 4, "parallel.pp_virtual_stages=2"), resume=True),
    Layout("pp2_zb1p", 2, _pp("zb1p"), resume=True),
    Layout("pp2_zbv", 2, _pp("zbv"), resume=True),
    Layout("pp2_torch_1f1b", 2, _pp("1f1b", 4, "parallel.pp_impl=torch"), resume=True),
    Layout("cp2", 2, ["parallel.cp=2"], resume=True),
    Layout("cp2_allgather", 2, ["parallel.cp=2", "parallel.cp_impl=allgather"], resume=True),
    Layout("pp2_tp2_sp_1f1b", 4, _pp("1f1b", 2, "parallel.tp=2", "parallel.sequence_parallel=true"),
           resume=True),
    Layout("ft_2groups", 1, FSDP(3), groups=2,
           what="2 fault-tolerant replica groups of 1 rank and a lighthouse"),
]
BY_NAME = {layout.name: layout for layout in LAYOUTS}
# the suite's (tests/test_bitwise_vs_commit.py): one process with the loss scaler and a
# resume, one 2-rank sharded run with accumulation
SMALL = ["single_fp16", "fsdp3_x2_accum2"]


# --- the two trees -------------------------------------------------------------------

class BaseMissing(Exception):
    """The base commit is not in this checkout's history (a shallow clone, or no git)."""


def resolve(base, repo=REPO):
    """The full hash of `base` in repo's history, or BaseMissing with why not."""
    try:
        out = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}"],
                             capture_output=True, text=True)
    except OSError as e:
        raise BaseMissing(f"git is not available ({e})") from None
    if out.returncode != 0:
        shallow = subprocess.run(["git", "-C", repo, "rev-parse", "--is-shallow-repository"],
                                 capture_output=True, text=True).stdout.strip()
        why = ("a shallow clone: `git fetch --unshallow` brings the history" if shallow == "true"
               else "not a git checkout" if shallow == "" else "no such commit here")
        raise BaseMissing(f"commit {base} is not in the history of {repo} ({why})")
    return out.stdout.strip()


def write_tree(commit, directory, repo=REPO):
    """The files of `commit` under `directory` (git archive: the checkout is not touched).
    A directory already holding them (--keep, a second run) is used as it is."""
    done = os.path.join(directory, ".bitwise-complete")
    if os.path.exists(done):
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    archive = subprocess.run(["git", "-C", repo, "archive", "--format=tar", commit],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(directory, filter="data")
        else:  # Python before 3.12 and its backports
            tar.extractall(directory)
    open(done, "w").close()
    return directory


# --- running jobs --------------------------------------------------------------------

def default_env():
    """One thread per rank, unbuffered output, nothing of an enclosing launch."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               WANDB_SILENT="true")
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    return env


def _kill_tree(pid):
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from launch.process_tree import kill_tree
    kill_tree(pid)


@dataclass
class Runner:
    """How jobs start: the interpreter (the suite passes its fork server's stand-in), the
    environment, and how a job past its timeout is killed with its process tree."""
    python: str = sys.executable
    env: dict = field(default_factory=default_env)
    kill_tree: object = _kill_tree
    timeout: float = 600

    def command(self, tree, nproc, args):
        main = os.path.join(tree, "main.py")
        if nproc == 1:
            return [self.python, main, *args]
        return [self.python, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}", main, *args]

    def start(self, cmd, cwd):
        os.makedirs(cwd, exist_ok=True)
        log = open(os.path.join(cwd, "console.log"), "w")
        with log:
            return subprocess.Popen(cmd, cwd=cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def finish(self, proc, deadline):
        try:
            return proc.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.kill_tree(proc.pid)
            proc.wait()
            return "timeout"

    def run(self, tree, layout, cwd, extra=()):
        """Run `layout` under `tree` in `cwd`: None when every process succeeded, else why
        not (exit status or timeout, with the console's end)."""
        args = COMMON + layout.overrides + list(extra)
        deadline = time.time() + self.timeout
        if not layout.groups:
            code = self.finish(self.start(self.command(tree, layout.nproc, args), cwd), deadline)
            return None if code == 0 else _failure(code, cwd)
        return self.run_groups(tree, layout, cwd, args, deadline)

    def run_groups(self, tree, layout, cwd, args, deadline):
        """A lighthouse of `tree` and layout.groups replica groups, each launch in
        cwd/group<i>. The quorum needs every group (ft.min_replicas): each step is dealt
        to all of them, as in the base."""
        port = free_port()
        ft = [f"ft.lighthouse=localhost:{port}", f"ft.min_replicas={layout.groups}"]
        beacon = self.start([self.python, os.path.join(tree, "main.py"), "mode=lighthouse", *ft],
                            os.path.join(cwd, "lighthouse"))
        groups = [self.start(self.command(tree, layout.nproc, args + ft + [
            "ft.enabled=true", f"ft.replicas={layout.groups}", f"ft.replica_id={i}", "ft.timeout_s=60"]),
            os.path.join(cwd, f"group{i}")) for i in range(layout.groups)]
        codes = [self.finish(proc, deadline) for proc in groups]
        if beacon.poll() is None:
            beacon.send_signal(signal.SIGTERM)
        self.finish(beacon, time.time() + 30)
        for i, code in enumerate(codes):
            if code != 0:
                return _failure(code, os.path.join(cwd, f"group{i}"))
        return None


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _failure(code, cwd):
    """Why a run failed: main.py's one-line errors where it printed them, else the end of
    its console."""
    with open(os.path.join(cwd, "console.log"), errors="replace") as f:
        text = f.read()
    errors = [line for line in text.splitlines() if line.startswith("error")]
    why = "\n".join(errors[:4]) if errors else text[-2000:]
    return f"{'timed out' if code == 'timeout' else f'exit status {code}'} in {cwd}\n{why}"


def run_dirs(cwd, layout):
    """The run directories whose metrics and final snapshot are compared."""
    if layout.groups:
        return [os.path.join(cwd, f"group{i}", "runs", "default") for i in range(layout.groups)]
    return [os.path.join(cwd, "runs", "default")]


# --- reading what the runs wrote -----------------------------------------------------

def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


# runs under each tree: that tree's own snapshot reader
DUMP = r"""
import os, sys, torch
tree, out, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path.insert(0, tree)
import checkpoint.snapshot_reader
from checkpoint.snapshot_reader import open_snapshot
where = os.path.realpath(checkpoint.snapshot_reader.__file__)
if not where.startswith(os.path.realpath(tree) + os.sep):  # a module the interpreter held
    sys.exit(f"the snapshot reader came from {where}, not from {tree}")
dumps = {}
for path in paths:
    reader = open_snapshot(path)
    dumps[path] = {"meta": {k: reader.meta.get(k) for k in %r},
                   "tensors": {k: reader.read_full(k) for k in reader.keys()}}
torch.save(dumps, out)
""" % (SNAPSHOT_META,)


def read_snapshots(runner, tree, paths, out):
    """({path: {"meta": {...}, "tensors": {key: tensor}}}, None) of the newest snapshot at
    each path, read by `tree`'s own reader in one process; or ({}, why it failed)."""
    import torch
    if not paths:
        return {}, None
    cmd = [runner.python, "-c", DUMP, tree, out, *paths]
    proc = subprocess.run(cmd, env=runner.env, capture_output=True, text=True, timeout=runner.timeout)
    if proc.returncode != 0:
        return {}, f"reading the snapshots under {tree} failed ({proc.returncode}): {proc.stderr[-2000:]}"
    return torch.load(out, weights_only=True), None


# --- comparing -----------------------------------------------------------------------

def same_bits(a, b):
    """Two JSON numbers (or anything else) equal to the bit: NaN equals NaN, -0.0 is not 0.0."""
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return type(a) is type(b) and a == b


def metrics_difference(base, new, fields=FIELDS):
    """The first difference between two runs' metrics records, in words, or "". A field
    the base logged must be there, equal to the bit; val_loss where the base has none
    must be absent too (an evaluation the base did not do). Other fields the new code
    adds are not compared; timings, memory and traffic never are."""
    steps = lambda rs: [r.get("step") for r in rs]  # noqa: E731
    if steps(base) != steps(new):
        return f"steps {steps(new)} where the base logged {steps(base)}"
    for a, b in zip(base, new):
        for name in fields:
            if name not in a and not (name == "val_loss" and name in b):
                continue
            if name not in a or name not in b:
                return f"step {a['step']} {name}: {b.get(name, 'absent')!r} where the base has " \
                       f"{a.get(name, 'none')!r}"
            if not same_bits(a[name], b[name]):
                return f"step {a['step']} {name}: {b[name]!r} where the base has {a[name]!r}" + \
                       _relative(a[name], b[name])
    return ""


def _relative(a, b):
    if isinstance(a, float) and isinstance(b, float) and math.isfinite(a) and math.isfinite(b) and a:
        return f" (relative {abs(b - a) / abs(a):.2g})"
    return ""


def tensor_bits(t):
    import torch
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)


def snapshot_difference(base, new):
    """The first difference between two snapshots read by read_snapshots, in words, or ""."""
    import torch
    for name in SNAPSHOT_META:
        if not same_bits(base["meta"].get(name), new["meta"].get(name)):
            return f"snapshot {name}: {new['meta'].get(name)!r} where the base has {base['meta'].get(name)!r}"
    a, b = base["tensors"], new["tensors"]
    if sorted(a) != sorted(b):
        return f"snapshot keys: {sorted(set(b) - set(a))[:3]} new, {sorted(set(a) - set(b))[:3]} missing"
    for key in a:
        x, y = a[key], b[key]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"snapshot {key}: {y.dtype} {tuple(y.shape)} where the base has {x.dtype} {tuple(x.shape)}"
        if not torch.equal(tensor_bits(x), tensor_bits(y)):
            diff = (x.double() - y.double()).abs().max().item()
            return f"snapshot {key}: {int((tensor_bits(x) != tensor_bits(y)).sum())} bytes differ " \
                   f"(max abs difference {diff:.3g})"
    return ""


# --- the matrix ----------------------------------------------------------------------

@dataclass
class Row:
    layout: Layout
    runs: str = ""       # a failed run, or ""
    metrics: str = ""    # the first difference, or ""
    snapshot: str = ""
    resume: str = "-"    # "-": not resumed
    seconds: float = 0.0

    def identical(self):
        return not (self.runs or self.metrics or self.snapshot or self.resume not in ("", "-"))


def run_layout(runner, layout, base_tree, new_tree, work):
    """Every job of one layout: base, new, and the new code resuming the base's snapshot.
    Returns the Row with its run and metrics comparisons filled in, and the snapshots to
    read: [(row attribute, base path, new path, which tree reads the new one)]."""
    row, start = Row(layout), time.time()
    cwd = lambda side: os.path.join(work, layout.name, side)  # noqa: E731
    failures = [(side, runner.run(tree, layout, cwd(side))) for side, tree in
                (("base", base_tree), ("new", new_tree))]
    failed = [f"{side}: {why}" for side, why in failures if why]
    if failed:
        row.runs = "\n".join(failed)
        row.seconds = time.time() - start
        return row, []
    base_dirs, new_dirs = run_dirs(cwd("base"), layout), run_dirs(cwd("new"), layout)
    row.metrics = "; ".join(f"{_group(i, layout)}{d}" for i, d in enumerate(
        metrics_difference(read_metrics(b), read_metrics(n)) for b, n in zip(base_dirs, new_dirs)) if d)
    snapshots, written = [], []
    for i, (b, n) in enumerate(zip(base_dirs, new_dirs)):  # replica groups: the first writes
        b, n = os.path.join(b, "snapshot"), os.path.join(n, "snapshot")
        if os.path.isdir(b) and os.path.isdir(n):
            snapshots.append(("snapshot", b, n))
        elif os.path.isdir(b) or os.path.isdir(n):
            written.append(f"{_group(i, layout)}a snapshot written by the {'base' if os.path.isdir(b) else 'new code'} only")
    if not snapshots and not written:
        written.append("no snapshot written")
    row.snapshot = "; ".join(written)
    if layout.resume:
        snapshots.append(("resume",) + _resume(runner, row, layout, base_dirs[0], new_tree, cwd("resume")))
    row.seconds = time.time() - start
    return row, [s for s in snapshots if s[2]]


def _resume(runner, row, layout, base_dir, new_tree, cwd):
    """The new code resumes a copy of the base's snapshot of step RESUME_AT; its records
    must be the base's from there on. Returns (base snapshot, resumed snapshot or None)."""
    copy = os.path.join(cwd, "snapshot-of-base")
    shutil.copytree(os.path.join(base_dir, "snapshot"), copy)
    why = runner.run(new_tree, layout, cwd, [f"trainer.snapshot_path={copy}",
                                             f"trainer.resume_step={RESUME_AT}"])
    if why:
        row.resume = f"resumed run failed: {why}"
        return os.path.join(base_dir, "snapshot"), None
    base = [r for r in read_metrics(base_dir) if r["step"] > RESUME_AT]
    row.resume = metrics_difference(base, read_metrics(os.path.join(cwd, "runs", "default")))
    return os.path.join(base_dir, "snapshot"), copy


def _group(i, layout):
    return f"group {i}: " if layout.groups else ""


def check(layouts, base=BASE, work=None, runner=None, jobs=1, new_tree=REPO, out=print):
    """Run `layouts` under the base commit and under `new_tree`; returns the rows (each
    layout's comparison). `out`: where progress and the table go."""
    runner = runner or Runner()
    commit = resolve(base)
    work = work or tempfile.mkdtemp(prefix="bitwise-")
    base_tree = write_tree(commit, os.path.join(work, "trees", commit[:12]))
    out(f"base {commit[:12]} in {base_tree}; new: {new_tree}; runs under {work}")

    def one(layout):
        row, snaps = run_layout(runner, layout, base_tree, new_tree, os.path.join(work, "runs"))
        out(f"  ran {layout.name} ({row.seconds:.0f} s){': FAILED' if row.runs else ''}")
        return row, snaps

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        done = list(pool.map(one, layouts))
    wanted = [(row, kind, b, n) for row, snaps in done for kind, b, n in snaps]
    base_read, base_failed = read_snapshots(runner, base_tree, sorted({b for _, _, b, _ in wanted}),
                                            os.path.join(work, "base-snapshots.pt"))
    new_read, new_failed = read_snapshots(runner, new_tree, sorted({n for _, _, _, n in wanted}),
                                          os.path.join(work, "new-snapshots.pt"))
    for row, kind, b, n in wanted:
        difference = base_failed or new_failed or snapshot_difference(base_read[b], new_read[n])
        if kind == "snapshot":
            row.snapshot = "; ".join(filter(None, [row.snapshot, difference]))
        elif difference:
            row.resume = "; ".join(filter(None, [row.resume, difference]))
    rows = [row for row, _ in done]
    out(table(rows, commit))
    return rows


def table(rows, commit):
    cell = lambda text: "identical" if text == "" else text.splitlines()[0]  # noqa: E731
    width = max(len(r.layout.name) for r in rows)
    lines = [f"{'layout':<{width}}  ranks  {'metrics (loss, grad_norm, val_loss, ...)':<40}  "
             f"{'final snapshot':<24}  resume of the base's step-{RESUME_AT} snapshot"]
    for r in rows:
        ranks = f"{r.layout.groups}x{r.layout.nproc}" if r.layout.groups else str(r.layout.nproc)
        if r.runs:
            lines.append(f"{r.layout.name:<{width}}  {ranks:<5}  RUN FAILED: {cell(r.runs)}")
            continue
        lines.append(f"{r.layout.name:<{width}}  {ranks:<5}  {cell(r.metrics):<40}  "
                     f"{cell(r.snapshot):<24}  {cell(r.resume)}")
    same = sum(r.identical() for r in rows)
    lines.append(f"{same} of {len(rows)} layouts bitwise identical to {commit[:12]}"
                 + ("" if same == len(rows) else ": DIFFERENT"))
    return "\n".join(lines)


def details(rows):
    """Every failed run and difference in full (the table shows each one's first line)."""
    cells = [(r.layout.name, what, text) for r in rows for what, text in
             (("run", r.runs), ("metrics", r.metrics), ("snapshot", r.snapshot), ("resume", r.resume))
             if text not in ("", "-")]
    return "\n".join(f"{name} {what}: {text}" for name, what, text in cells)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=BASE, help=f"the commit to compare against (default {BASE})")
    parser.add_argument("--new", default="", help="a commit to check in place of this working tree")
    parser.add_argument("--matrix", choices=("full", "small"), default="full")
    parser.add_argument("--only", default="", help="comma-separated layout names (--list)")
    parser.add_argument("--keep", default="", help="a directory for the base's files and every run, kept")
    parser.add_argument("--jobs", type=int, default=1, help="layouts run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job (default 600)")
    parser.add_argument("--list", action="store_true", help="print the layouts and exit")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or (SMALL if args.matrix == "small" else list(BY_NAME))
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown layout(s) {', '.join(unknown)}; --list shows them")
    layouts = [BY_NAME[n] for n in names]
    if args.list:
        for layout in layouts:
            print(f"{layout.name:<32} {layout.nproc if not layout.groups else f'{layout.groups}x{layout.nproc}'} "
                  f"{' '.join(layout.overrides)}{'  (+resume)' if layout.resume else ''}"
                  f"{'  # ' + layout.what if layout.what else ''}")
        return 0
    work = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="bitwise-")
    start = time.time()
    try:
        new_tree = REPO
        if args.new:
            commit = resolve(args.new)
            new_tree = write_tree(commit, os.path.join(work, "trees", commit[:12]))
        rows = check(layouts, args.base, work, Runner(timeout=args.timeout), args.jobs, new_tree)
    except BaseMissing as e:
        print(f"bitwise_vs_commit: {e}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if not all(r.identical() for r in rows):
        print(f"\n{details(rows)}")
    print(f"{time.time() - start:.0f} s")
    return 0 if all(r.identical() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
