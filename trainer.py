"""The snapshotting training loop: batches, LR schedule, clipping, eval, logs, snapshots.

It talks to one `parallel.strategy.Strategy` and never asks which one.
Everything a step reads is a function of (config, step): the data position
(char_dataset.GlobalBatches), the LR (lr_at) and the random state (reseeded
each step from trainer.seed, the step and the data-parallel rank). So a
snapshot needs only the step, the model and the optimizer to continue
exactly, under any layout, and a resumed run's losses equal an
uninterrupted run's. The snapshot also records what fixes the data order
(the sampler and its version, the train split's size and, for prepared
tokens, the corpus's fingerprint), and check_resumable refuses to continue
with another.

With ft.enabled (fault_tolerance/) each step starts with the replica groups' quorum,
which deals this group its shares of the global batch; the groups' gradients are summed
across them before clipping, and a step they do not all commit is dropped and redone.
"""

import math
import os
import sys
import time
import uuid
from dataclasses import dataclass

import torch

from char_dataset import GlobalBatches, data_identity, data_order, eval_starts
from checkpoint.async_snapshot import AsyncSnapshots
from checkpoint.resume import snapshot_location
from checkpoint.snapshot_writer import save_sharded
from errors import UserError
from fault_tolerance.shares import share_micro_batches
from launch import preemption
from parallel.compile import compile_events
from parallel.grid import together
from parallel.pipeline_parallel.clock import DeviceClock
from telemetry import mfu
from telemetry.profiling import StepProfiler
from telemetry.activation_meter import ActivationMeter
from telemetry.metrics import MetricsLog, peak_memory, peak_rss_kib

AGREED_READ_FAILURE = "stopping: another rank failed while reading the data (see its error)"


@dataclass
class TrainerConfig:
    """The `trainer:` section of gpt2_train_cfg.yaml."""
    max_steps: int = 300        # optimizer steps to train (raise it to continue a finished run)
    batch_size: int = 32        # GLOBAL sequences per optimizer step, fixed whatever the layout
    grad_accum: int = 1         # micro-steps per optimizer step on each data-parallel rank
    lr: float = 2e-3            # peak learning rate (AdamW)
    min_lr: float = 2e-4        # the cosine decay ends here, at max_steps
    warmup_steps: int = 20      # linear warm-up steps
    weight_decay: float = 0.1   # AdamW weight decay, on matrices only (not biases or norms)
    beta1: float = 0.9          # AdamW beta1
    beta2: float = 0.95         # AdamW beta2
    grad_clip: float = 1.0      # max global gradient norm; 0 = no clipping
    eval_every: int = 50        # val loss every N optimizer steps and at the end; 0 = never
    eval_batches: int = 4       # global batches of val data per evaluation
    log_every: int = 10         # a metrics.jsonl record and a console line every N steps
    save_every: int = 50        # snapshot every N steps (and always at the end); 0 = only at the end
    seed: int = 1337            # initial weights, data order, dropout
    run_dir: str = "runs/default"  # metrics.jsonl, config.yaml, wandb files, the snapshot by default
    snapshot_path: str = ""     # snapshot directory, any fsspec URL ("" = <run_dir>/snapshot);
                                # resumed from when present
    keep_snapshots: int = 1     # the newest K snapshots survive each write
    resume_step: int = -1       # -1 = resume from the newest snapshot; S = go back to kept step S
    device: str = "auto"        # auto (cuda if available) | cpu | cuda; a rank's GPU is its LOCAL_RANK
    measure_activations: bool = False  # log activation_peak_mb, the bytes autograd saves for
                                       # backward (a hook per saved tensor: small overhead)
    precision: str = "fp32"     # fp32 | bf16 | fp16: autocast compute; weights, gradients and
                                # AdamW state stay fp32; fp16 adds a dynamic loss scaler
    fp16_init_scale: float = 65536.0  # fp16: the loss scaler's first scale (halved on overflow)
    fp16_growth_interval: int = 2000  # fp16: steps without overflow before the scale doubles
    activation_checkpointing: bool = False  # recompute each block in backward: less memory, ~1/3 more compute
    snapshot_async: bool = False  # write snapshots in the background from a host copy of each
                                  # rank's state (false: every rank waits for its write)
    compile: bool = False       # torch.compile each transformer block after parallelizing (parallel/compile.py)
    compile_backend: str = "inductor"  # inductor | aot_eager (no code generation: the tests) | eager
    compile_scope: str = "block"  # block | model (the whole GPT in one graph: one process, no checkpointing)
    deterministic: bool = False  # deterministic kernels (torch.use_deterministic_algorithms): bitwise-repeatable GPU runs, slower
    profile_from: int = 0       # first optimizer step torch.profiler records (0 = off); traces in <run_dir>/profile/
    profile_steps: int = 2      # how many steps from profile_from it records: one Chrome trace per rank
    memory_snapshot: bool = False  # CUDA only: a torch.cuda.memory snapshot per rank of the profiled steps


class LossWatch:
    """Whether a training loss became inf or NaN, and at which step, kept on the device:
    a step's loss is read only at the steps the trainer logs or saves (one host read for
    all its values), not after every step, where on a GPU it would wait for the step."""

    def __init__(self, device):
        self.first_bad = torch.zeros((), dtype=torch.int64, device=device)  # 0: none yet
        self.bad_loss = torch.zeros((), device=device)

    def watch(self, loss, step):
        new = ~torch.isfinite(loss) & (self.first_bad == 0)
        self.first_bad = torch.where(new, step, self.first_bad)
        self.bad_loss = torch.where(new, loss.detach().float(), self.bad_loss)

    def read(self, loss, grad_norm):
        """(loss, grad_norm) as floats, in one read with the watch; raises if some step's
        loss since the start was not finite."""
        values = torch.stack([loss.detach().double(), grad_norm.detach().double(),
                              self.first_bad.double(), self.bad_loss.double()]).tolist()
        if values[2]:
            raise UserError(f"training loss became {values[3]} at step {int(values[2])}: "
                            "lower trainer.lr or raise trainer.warmup_steps")
        return values[0], values[1]


def lr_at(step: int, t: TrainerConfig) -> float:
    """Linear warm-up to t.lr, then cosine decay to t.min_lr at t.max_steps."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


class Trainer:
    def __init__(self, cfg, strategy, grid, train_set, val_set, snapshot_meta):
        """snapshot_meta: what the snapshot carries beyond the training state (the
        config as a dict, GPT shape, tokenizer). Then restore() (optional),
        open_metrics() and (ft.enabled) join_replicas() before train()."""
        self.cfg, self.t = cfg, cfg.trainer
        self.strategy, self.grid = strategy, grid
        self.train_set, self.val_set = train_set, val_set
        self.snapshot_meta = snapshot_meta
        self.snapshot_path = snapshot_location(self.t)
        self.batches = GlobalBatches(len(train_set), self.t.batch_size, self.t.seed,
                                     cfg.data.sampler)
        self.step, self.wandb_id = 0, uuid.uuid4().hex[:12]
        self.resumed_record = None  # the snapshot step's metrics record (restore())
        strategy.configure_compute(self.t)
        strategy.configure_optimizer(self.t)
        # the strategy is built (this rank's parameters materialized) and nothing trained
        # yet: the fullest rank's peak host memory so far, for the first record written
        self.setup_record = {"setup_peak_rss_mb": grid.max_over_ranks([peak_rss_kib()])[0] / 1024}
        # trainer.compile: time compiling and compilations per code object (parallel/compile.py)
        self.compiles = compile_events() if self.t.compile else None
        if self.compiles is not None:
            self.compiles.pop_ms()  # this process's earlier compiles are not this run's
        # model FLOPs utilisation where the device's peak is known (never on CPU: telemetry/mfu.py)
        self.peak_flops = mfu.device_peak(grid.device, self.t.precision)
        self.flops_per_token = mfu.flops_per_token(snapshot_meta["gpt_config"])
        self.metrics = None
        self.activations = ActivationMeter() if self.t.measure_activations else None
        self.async_snapshots = AsyncSnapshots(self.snapshot_path, grid, self.t.keep_snapshots) \
            if self.t.snapshot_async else None
        self.clock = DeviceClock(grid.device)  # step_ms: CUDA events on a GPU, else the host's
        self.losses = LossWatch(grid.device)
        self.profiler = StepProfiler(self.t, grid)  # trainer.profile_from / memory_snapshot
        self.replicas = None  # ft.enabled: this launch's fault_tolerance.ReplicaGroup

    def restore(self, reader):
        """Take model, optimizer and step from a snapshot (checked by check_resumable)."""
        self.strategy.load_shards(reader)
        self.strategy.precision.load_state(reader.meta.get("precision"))  # the fp16 loss scale
        self.step, self.wandb_id = reader.meta["step"], reader.meta["wandb_id"]
        self.resumed_record = reader.meta.get("metrics_record")
        if self.grid.is_main:
            print(f"resuming from snapshot {self.snapshot_path} at step {self.step}", flush=True)

    def join_replicas(self, replica_group):
        """ft.enabled: from now on each step starts with the groups' quorum, takes this
        group's shares of the global batch, sums across groups and steps only if committed."""
        self.replicas = replica_group

    def open_metrics(self):
        self.metrics = MetricsLog(self.cfg, self.snapshot_meta["config"], self.grid.is_main,
                                  self.step, self.wandb_id, self.resumed_record)

    def _reseed(self, step):
        """Dropout etc. draw from streams fixed by (seed, step) and the rank's place in
        the grid (Strategy.reseed): resumable, under any layout."""
        self.strategy.reseed((self.t.seed * 1_000_003 + step) * 1_009)

    def train(self):
        t, g, ft = self.t, self.grid, self.replicas
        if self.step < t.max_steps and ft is None:
            micro, data_ms, error = self._read_step(self.step)
            if not g.all_ok(error is None):
                raise error or UserError(AGREED_READ_FAILURE)
        redo = False  # ft: the last try of this step was voted down
        while self.step < t.max_steps:
            if not redo:  # a redone step stays in its first try's profiler range and window
                self.profiler.before_step(self.step + 1)
            started = self.clock.mark()  # the device's clock: CUDA events on a GPU
            if ft is not None:  # the quorum first: it says which shares this group computes
                self.step, shares = ft.begin_step()  # (a joining group heals: step jumps)
                micro, data_ms, error = self._read_step(self.step, shares)
                if not g.all_ok(error is None):
                    raise error or UserError(AGREED_READ_FAILURE)
            computed = self.compute_step(micro, ft)
            redo = computed is None
            if redo:  # a replica group failed in it: redone with the next quorum
                continue
            loss, grad_norm, lr = computed
            ended = self.clock.mark()  # after the optimizer's kernels, not before them
            self.step += 1
            self.losses.watch(loss, self.step)  # on the device: read at the steps below

            last = self.step == t.max_steps
            saved = bool(t.save_every and self.step % t.save_every == 0) or last
            if ft is not None:  # one group writes (trainer.snapshot_path may be shared)
                saved = saved and ft.writes_snapshots()
            logged = bool(t.log_every and (self.step % t.log_every == 0 or last))
            evaluated = bool(t.eval_every and (self.step % t.eval_every == 0 or last))
            # the steps every rank measures alike (their figures take collectives); only
            # these, a step that compiled and a save step read anything from the device
            measured = logged or evaluated
            comm = self.strategy.comm_stats()
            stats, files = self.strategy.step_stats(last, measure=measured or last)
            compiled = self.compiles.pop_ms() if self.compiles is not None else 0.0
            ft_figures, ft_event = ft.figures() if ft is not None else ({}, False)
            # a step that compiled shows its cost; one with a membership change or after a
            # recovery shows it
            written = measured or bool(compiled) or ft_event
            record = None
            if written or saved:  # never snapshot a model a non-finite loss has trained
                loss, grad_norm = self.losses.read(loss, grad_norm)  # raises on a non-finite loss
            if written:
                # the whole step on the device's timeline, optimizer included
                elapsed = self.clock.seconds(started, [ended])[0] + data_ms / 1000  # data: read at the previous step's end
                record = {"step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                          "tokens_per_s": t.batch_size * self.train_set.block_size / elapsed,
                          "step_ms": 1000 * elapsed, "data_ms": data_ms,
                          **peak_memory(g.device),
                          **(self.strategy.state_figures() if measured else {}),  # state_bytes (and host_state_bytes)
                          **comm, **stats, **self.strategy.precision.metrics(), **ft_figures}
                if self.peak_flops:
                    record["mfu"] = mfu.mfu(self.flops_per_token, record["tokens_per_s"],
                                            self.peak_flops, g.world_size)
                if self.activations is not None:
                    record["activation_peak_mb"] = self.activations.peak_bytes / 2**20
                if self.compiles is not None:  # compile_ms: the part of step_ms spent compiling
                    record.update(compile_ms=compiled, **self.compiles.counts())
            self.metrics.write_files(files)
            if evaluated:
                record["val_loss"] = self.evaluate()
                if self.compiles is not None:  # evaluation compiles for its own mode and shape
                    record.update(val_compile_ms=self.compiles.pop_ms(), **self.compiles.counts())
            if saved:
                figures = self.save(final=last, record=record)
                if written:
                    record.update(figures)
            if written:
                record.update(self.setup_record)  # the first record only
                self.setup_record = {}
                self.metrics.write(record, t.max_steps, console=logged or last)
            else:
                self.metrics.progress(self.step, t.max_steps)
            self.profiler.after_step(self.step, last)
            if not last:  # read the next step's windows, then agree (every rank) on them, a
                # stop signal and the progress of a background snapshot, in one all-reduce
                micro, data_ms, error = self._read_step(self.step) if ft is None else \
                    (None, 0.0, None)  # ft: read after the next quorum deals the shares
                signum, failed, progress = preemption.agreed_signal(
                    g, failed=error is not None,
                    extra=self.async_snapshots.flags() if self.async_snapshots else ())
                if self.async_snapshots:
                    self.async_snapshots.advance(progress)  # raises on a failed write
                if signum:  # a stop signal: snapshot this step (the next one's data waits)
                    self._stop_preempted(signum, saved)
                if failed:  # one rank's windows are damaged: all stop before any collective
                    raise error or UserError(AGREED_READ_FAILURE)
        return self.step

    def compute_step(self, micro, ft=None):
        """The step's computation on this rank's micro-batches: forward and backward (under
        the activation meter when measured), the clip, the optimizer step. Returns (loss,
        pre-clip gradient norm, lr), on the device, unread. mode=dryrun runs just this.
        ft (ft.enabled): this group's shares summed over the live replica groups before the
        clip, and the optimizer step only if torchft's vote commits it; else None."""
        t = self.t
        self._reseed(self.step)
        if self.activations is not None:
            with self.activations:
                loss = self.strategy.loss_and_gradients(micro)
        else:
            loss = self.strategy.loss_and_gradients(micro)
        if ft is not None:  # this group's shares -> the global batch, over the live groups
            loss = ft.sum_across(loss, self.strategy.grads())
            scale = self.strategy.precision.state()  # fp16: a dropped step keeps its scale
        lr = lr_at(self.step, t)
        # the pre-clip global norm, logged: it exposes summed-instead-of-averaged
        # gradients, which AdamW's scale invariance hides from the loss
        grad_norm = self.strategy.clip_gradients(t.grad_clip if t.grad_clip > 0 else math.inf)
        if ft is not None and not ft.commit():  # a group failed in it
            self.strategy.drop_step(lr)
            self.strategy.precision.load_state(scale)
            self.strategy.comm_stats()  # the dropped step's traffic is not the next one's
            return None
        self.strategy.optimizer_step(lr)
        return loss, grad_norm, lr

    def _read_step(self, step, shares=None):
        """(micro-batches of `step` for this rank, ms it took, error or None); shares
        (ft.enabled): of the ft.replicas shares of the global batch, those this replica
        group computes (fault_tolerance/shares.py). An error is
        returned, not raised: a damaged shard shows on one rank only, and the ranks agree
        on it in the step's one scalar all-reduce (preemption.agreed_signal) before the
        next collective, instead of leaving the others waiting in it."""
        started = time.perf_counter()
        try:
            if shares is None:
                micro = self.batches.local_micro_batches(self.train_set, step, self.grid.data_rank,
                                                         self.grid.data_size, self.t.grad_accum)
            else:
                micro = share_micro_batches(self.batches, self.train_set, step, shares,
                                            self.cfg.ft.replicas, self.grid.data_rank,
                                            self.grid.data_size, self.t.grad_accum)
        except UserError as e:
            return None, 0.0, e
        except Exception as e:  # s3 errors, a vanished file, ...
            return None, 0.0, UserError(f"reading the data failed: {type(e).__name__}: {e}")
        return micro, 1000 * (time.perf_counter() - started), None

    def _stop_preempted(self, signum, saved):
        """A rank got SIGTERM/SIGUSR1 (launch/preemption.py): every rank is here after the same
        step; snapshot it, so nothing trained is lost, and leave with EXIT_STATUS."""
        if self.async_snapshots:
            self.async_snapshots.drain()  # this step's save (if it was one) is committed now
        if not saved:
            self.save(final=True)
        message = (f"preempted: {preemption.signal_name(signum)} received, stopped after step "
                   f"{self.step} of {self.t.max_steps} and wrote its snapshot to "
                   f"{self.snapshot_path}; run the same command to resume (exit status "
                   f"{preemption.EXIT_STATUS})")
        if self.grid.is_main:
            with open(os.path.join(self.t.run_dir, preemption.MARKER), "w") as f:
                f.write(message + "\n")
        raise preemption.Preempted(message)

    def evaluate(self):
        """Mean val loss over fixed windows, in micro-batches of the training size."""
        g, t = self.grid, self.t
        starts = eval_starts(len(self.val_set), t.batch_size, t.eval_batches)
        mine = [row.view(g.data_size, -1)[g.data_rank] for row in starts]
        read = lambda: [self.val_set.batch(part) for share in mine  # noqa: E731
                        for part in share.view(t.grad_accum, -1)]
        # prepared shards can turn out damaged on one rank: agree first (text cannot)
        micro = together(g, "reading the val data", read) \
            if getattr(self.val_set, "checks_contents", False) else read()
        losses = [self.strategy.eval_loss(x, y) for x, y in micro]
        return sum(losses) / len(losses)

    def save(self, final=False, record=None):
        """Collective: every rank writes the part of the state it owns: now, or (with
        trainer.snapshot_async, unless `final`) staged in host memory and written in the
        background. Returns the figures for the step's metrics record.

        record: that metrics record as it stands; the snapshot carries it, because it is
        written to metrics.jsonl only after the snapshot commits: a kill in between
        would otherwise leave the step missing from metrics.jsonl (the resumed run starts
        after it), and MetricsLog writes it back from here."""
        started = time.perf_counter()
        pieces = self.strategy.shard_pieces()
        meta = self._snapshot_meta()
        if record is not None:
            meta["metrics_record"] = dict(record)
        if self.async_snapshots is None:
            save_sharded(self.snapshot_path, self.grid, self.step, pieces, keep=self.t.keep_snapshots,
                         meta=meta)
            return {"snapshot_ms": 1000 * (time.perf_counter() - started)}
        if final:  # the end, or a stop: what is in flight first, then this step, synchronously
            self.async_snapshots.drain()
            save_sharded(self.snapshot_path, self.grid, self.step, pieces, keep=self.t.keep_snapshots,
                         meta=meta)
        else:
            self.async_snapshots.begin(self.step, pieces, meta)
        return {"snapshot_ms": 1000 * (time.perf_counter() - started),
                "snapshot_wait_ms": self.async_snapshots.last_wait_ms if not final else 0.0}

    def _snapshot_meta(self):
        """What a snapshot records besides the tensors (the manifest)."""
        g, t = self.grid, self.t
        return {
            "samples_seen": self.step * t.batch_size, "wandb_id": self.wandb_id,
            "data_order": data_order(self.cfg.data), "data": data_identity(self.train_set),
            **self.snapshot_meta,
            "layout": {"world_size": g.world_size, **g.sizes, "strategy": self.strategy.name},
            "precision": self.strategy.precision.state(),  # fp16: the loss scaler's state
            "lr_schedule": {"warmup_steps": t.warmup_steps, "max_steps": t.max_steps,
                            "lr": t.lr, "min_lr": t.min_lr},
            "rng": {"scheme": "torch.manual_seed((seed*1000003 + step)*1009 + dp_rank) "
                              "at the start of each step; pipeline stages and TP ranks derive "
                              "their streams from it (Strategy.reseed, parallel/grid.derive_seed)",
                    "seed": t.seed},
        }

    def close(self):
        if getattr(self, "profiler", None) is not None:  # a window the run stopped inside
            self.profiler.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.async_snapshots is not None:
            lost = self.async_snapshots.close()  # a save the run stopped in the middle of
            if lost:
                where = f" on rank {self.grid.rank}" if self.grid.world_size > 1 else ""
                sys.stderr.flush()  # one write of the whole line, as main.py's error line
                os.write(2, f"warning{where}: {lost}\n".encode())
