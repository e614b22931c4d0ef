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
"""

import json
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass

import torch

from activation_meter import ActivationMeter
import mfu
import preemption
from char_dataset import (LEGACY_ORDER, SAMPLERS, GlobalBatches, data_identity, data_order,
                          describe_data, eval_starts)
from errors import UserError
from parallel.grid import together
from snapshot import save_sharded

AGREED_READ_FAILURE = "stopping: another rank failed while reading the data (see its error)"


@dataclass
class TrainerConfig:
    """The `trainer:` section of gpt2_train_cfg.yaml."""
    max_steps: int = 300
    batch_size: int = 32        # GLOBAL sequences per optimizer step, whatever the layout
    grad_accum: int = 1         # micro-steps per optimizer step on each dp rank
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0      # 0 = no clipping
    eval_every: int = 50        # optimizer steps; 0 = never
    eval_batches: int = 4       # global batches of val data per eval
    log_every: int = 10
    save_every: int = 50        # 0 = only at the end
    seed: int = 1337
    run_dir: str = "runs/default"
    snapshot_path: str = ""     # a directory, any fsspec URL; "" = <run_dir>/snapshot
    keep_snapshots: int = 1     # the newest K snapshots survive each write
    resume_step: int = -1       # -1 = resume from the newest snapshot; S = from kept step S
    device: str = "auto"        # auto (cuda if available) | cpu | cuda
    measure_activations: bool = False  # log activation_peak_mb (activation_meter.py); small overhead
    precision: str = "fp32"     # fp32 | bf16 | fp16: autocast compute, fp32 weights and AdamW state
    fp16_init_scale: float = 65536.0  # fp16: the loss scaler's first scale
    fp16_growth_interval: int = 2000  # fp16: steps without overflow before the scale doubles
    activation_checkpointing: bool = False  # recompute each block in backward: less memory, ~1/3 more compute


def lr_at(step: int, t: TrainerConfig) -> float:
    """Linear warm-up to t.lr, then cosine decay to t.min_lr at t.max_steps."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


def peak_memory_mb(device) -> float:
    """Peak memory of this process: allocator peak on CUDA, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def snapshot_location(t: TrainerConfig) -> str:
    return t.snapshot_path or os.path.join(t.run_dir, "snapshot")


def check_resumable(path, meta, cfg, data):
    """Refuse a snapshot whose data order differs from this run's; return notes on
    settings that legitimately change on resume (the LR schedule, when extending).
    data: char_dataset.data_identity of this run's train split."""
    saved_t, saved_d = meta["config"]["trainer"], meta["config"]["data"]
    text = not cfg.data.tokens_path  # prepared tokens are known by their fingerprint, not path
    for section, key, saved in (("trainer", "batch_size", saved_t), ("trainer", "seed", saved_t),
                                ("data", "path", saved_d), ("data", "val_fraction", saved_d)):
        now, was = getattr(getattr(cfg, section), key), saved.get(key, "")
        if was != now and (text or section == "trainer"):
            raise UserError(
                f"snapshot {path} was trained with {section}.{key}={was!r}, this run asks "
                f"for {now!r}: resuming would change the data order. Use the snapshot's value "
                "or a new trainer.snapshot_path")
    was, now = meta.get("data_order", LEGACY_ORDER), data_order(cfg.data)
    if was != now:
        known = SAMPLERS.get(was["sampler"]) == was["version"] and was["sampler"] != now["sampler"]
        hint = (f"Add data.sampler={was['sampler']} to finish it in the order it started with"
                if known else "This version cannot reproduce that order")
        raise UserError(
            f"snapshot {path} was trained in data order {was['sampler']} v{was['version']}, this "
            f"run reads in order {now['sampler']} v{now['version']}: resuming would silently change "
            f"the data it trains on. {hint}, or use a new trainer.snapshot_path")
    if meta.get("data", data) != data:
        raise UserError(
            f"snapshot {path} was trained on {describe_data(meta['data'])}, this run reads "
            f"{describe_data(data)}: resuming would change the data it trains on. Use the data it "
            "was trained on, or a new trainer.snapshot_path")
    return [f"note: trainer.{k} is {getattr(cfg.trainer, k)} now, {saved_t[k]} when the snapshot "
            f"was written: the LR schedule changes from here on"
            for k in ("max_steps", "warmup_steps", "lr", "min_lr") if saved_t[k] != getattr(cfg.trainer, k)]


class MetricsLog:
    """metrics.jsonl, the console and wandb; active on the main rank only."""

    def __init__(self, cfg, config_dict, active, resumed_step, wandb_id):
        self.active, self.run = active, None
        self.tty = active and sys.stdout.isatty()
        if not active:
            return
        os.makedirs(cfg.trainer.run_dir, exist_ok=True)
        self.path = os.path.join(cfg.trainer.run_dir, "metrics.jsonl")
        self._keep_steps_up_to(resumed_step)  # a fresh run starts an empty file
        if cfg.wandb.mode != "disabled":
            import wandb
            self.run = wandb.init(
                project=cfg.wandb.project, id=wandb_id, resume="allow", mode=cfg.wandb.mode,
                name=cfg.wandb.name or os.path.basename(os.path.normpath(cfg.trainer.run_dir)),
                dir=cfg.trainer.run_dir, config=config_dict)

    def _keep_steps_up_to(self, step):
        """Drop records past the snapshot (the resumed run writes those steps again) and
        any line a crash left half-written; replace the file atomically."""
        lines = []
        if os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        if json.loads(line)["step"] <= step:
                            lines.append(line if line.endswith("\n") else line + "\n")
                    except (ValueError, KeyError, TypeError):
                        pass
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(lines)
        os.replace(tmp, self.path)

    def write(self, record, total_steps, console):
        if not self.active:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.run is not None:
            self.run.log(record, step=record["step"])
        if console:
            line = (f"step {record['step']}/{total_steps} | loss {record['loss']:.4f} | "
                    f"lr {record['lr']:.2e} | {record['tokens_per_s']:.0f} tok/s | "
                    f"{record['step_ms']:.1f} ms/step")
            if "mfu" in record:
                line += f" | mfu {100 * record['mfu']:.1f}%"
            if record.get("step_skipped"):
                line += f" | skipped (fp16 overflow; loss scale now {record['loss_scale']:g})"
            if "val_loss" in record:
                line += f" | val {record['val_loss']:.4f}"
            print(("\r" if self.tty else "") + line, flush=True)

    def write_files(self, files):
        """{name: JSON-able}: files beside metrics.jsonl (e.g. the pipeline timeline)."""
        if not self.active:
            return
        for name, obj in files.items():
            with open(os.path.join(os.path.dirname(self.path), name), "w") as f:
                json.dump(obj, f)

    def progress(self, step, total):
        if self.tty:
            done = int(30 * step / total)
            print(f"\r[{'#' * done}{'.' * (30 - done)}] {step}/{total}", end="", flush=True)

    def close(self):
        if self.run is not None:
            self.run.finish()


class Trainer:
    def __init__(self, cfg, strategy, grid, train_set, val_set, snapshot_meta):
        """snapshot_meta: what the snapshot carries beyond the training state (the
        config as a dict, GPT shape, tokenizer). Then restore() (optional) and
        open_metrics() before train()."""
        self.cfg, self.t = cfg, cfg.trainer
        self.strategy, self.grid = strategy, grid
        self.train_set, self.val_set = train_set, val_set
        self.snapshot_meta = snapshot_meta
        self.snapshot_path = snapshot_location(self.t)
        self.batches = GlobalBatches(len(train_set), self.t.batch_size, self.t.seed,
                                     cfg.data.sampler)
        self.step, self.wandb_id = 0, uuid.uuid4().hex[:12]
        strategy.configure_compute(self.t)
        strategy.configure_optimizer(self.t)
        # model FLOPs utilisation where the device's peak is known (never on CPU: mfu.py)
        self.peak_flops = mfu.device_peak(grid.device, self.t.precision)
        self.flops_per_token = mfu.flops_per_token(snapshot_meta["gpt_config"])
        self.metrics = None
        self.activations = ActivationMeter() if self.t.measure_activations else None

    def restore(self, reader):
        """Take model, optimizer and step from a snapshot (checked by check_resumable)."""
        self.strategy.load_shards(reader)
        self.strategy.precision.load_state(reader.meta.get("precision"))  # the fp16 loss scale
        self.step, self.wandb_id = reader.meta["step"], reader.meta["wandb_id"]
        if self.grid.is_main:
            print(f"resuming from snapshot {self.snapshot_path} at step {self.step}", flush=True)

    def open_metrics(self):
        self.metrics = MetricsLog(self.cfg, self.snapshot_meta["config"], self.grid.is_main,
                                  self.step, self.wandb_id)

    def _reseed(self, step):
        """Dropout etc. draw from streams fixed by (seed, step) and the rank's place in
        the grid (Strategy.reseed): resumable, under any layout."""
        self.strategy.reseed((self.t.seed * 1_000_003 + step) * 1_009)

    def train(self):
        t, g = self.t, self.grid
        if self.step < t.max_steps:
            micro, data_ms, error = self._read_step(self.step)
            if not g.all_ok(error is None):
                raise error or UserError(AGREED_READ_FAILURE)
        while self.step < t.max_steps:
            started = time.perf_counter()
            self._reseed(self.step)
            if self.activations is not None:
                with self.activations:
                    loss = self.strategy.forward_backward(micro)
            else:
                loss = self.strategy.forward_backward(micro)
            if not math.isfinite(loss):
                raise UserError(f"training loss became {loss} at step {self.step + 1}: "
                                "lower trainer.lr or raise trainer.warmup_steps")
            lr = lr_at(self.step, t)
            # the pre-clip global norm, logged: it exposes summed-instead-of-averaged
            # gradients, which AdamW's scale invariance hides from the loss
            grad_norm = self.strategy.clip_grad_norm_(t.grad_clip if t.grad_clip > 0 else math.inf)
            self.strategy.optimizer_step(lr)
            self.step += 1
            elapsed = time.perf_counter() - started + data_ms / 1000  # read at the previous step's end

            last = self.step == t.max_steps
            stats, files = self.strategy.step_stats(last)
            record = {"step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                      "tokens_per_s": t.batch_size * self.train_set.block_size / elapsed,
                      "step_ms": 1000 * elapsed, "data_ms": data_ms,
                      "peak_mem_mb": peak_memory_mb(g.device),
                      "state_bytes": self.strategy.state_bytes(),
                      **self.strategy.comm_stats(), **stats, **self.strategy.precision.metrics()}
            if self.peak_flops:
                record["mfu"] = mfu.mfu(self.flops_per_token, record["tokens_per_s"],
                                        self.peak_flops, g.world_size)
            if self.activations is not None:
                record["activation_peak_mb"] = self.activations.peak_bytes / 2**20
            self.metrics.write_files(files)
            if t.eval_every and (self.step % t.eval_every == 0 or last):
                record["val_loss"] = self.evaluate()
            logged = t.log_every and (self.step % t.log_every == 0 or last)
            if logged or "val_loss" in record:
                self.metrics.write(record, t.max_steps, console=bool(logged) or last)
            else:
                self.metrics.progress(self.step, t.max_steps)
            saved = (t.save_every and self.step % t.save_every == 0) or last
            if saved:
                self.save()
            if not last:  # read the next step's windows, then agree (every rank) on two things
                micro, data_ms, error = self._read_step(self.step)
                signum, failed = preemption.agreed_signal(g.device, failed=error is not None)
                if signum:  # a stop signal: snapshot this step (the next one's data waits)
                    self._stop_preempted(signum, saved)
                if failed:  # one rank's windows are damaged: all stop before any collective
                    raise error or UserError(AGREED_READ_FAILURE)
        return self.step

    def _read_step(self, step):
        """(micro-batches of `step` for this rank, ms it took, error or None). An error is
        returned, not raised: a damaged shard shows on one rank only, and the ranks agree
        on it in the step's one scalar all-reduce (preemption.agreed_signal) before the
        next collective, instead of leaving the others waiting in it."""
        started = time.perf_counter()
        try:
            micro = self.batches.local_micro_batches(self.train_set, step, self.grid.dp_rank,
                                                     self.grid.dp_size, self.t.grad_accum)
        except UserError as e:
            return None, 0.0, e
        except Exception as e:  # s3 errors, a vanished file, ...
            return None, 0.0, UserError(f"reading the data failed: {type(e).__name__}: {e}")
        return micro, 1000 * (time.perf_counter() - started), None

    def _stop_preempted(self, signum, saved):
        """A rank got SIGTERM/SIGUSR1 (preemption.py): every rank is here after the same
        step; snapshot it, so nothing trained is lost, and leave with EXIT_STATUS."""
        if not saved:
            self.save()
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
        mine = [row.view(g.dp_size, -1)[g.dp_rank] for row in starts]
        read = lambda: [self.val_set.batch(part) for share in mine  # noqa: E731
                        for part in share.view(t.grad_accum, -1)]
        # prepared shards can turn out damaged on one rank: agree first (text cannot)
        micro = together(g, "reading the val data", read) \
            if getattr(self.val_set, "checks_contents", False) else read()
        losses = [self.strategy.eval_loss(x, y) for x, y in micro]
        return sum(losses) / len(losses)

    def save(self):
        """Collective: every rank writes the part of the state it owns."""
        g, t = self.grid, self.t
        pieces = self.strategy.shard_pieces()
        save_sharded(self.snapshot_path, g, self.step, pieces, keep=t.keep_snapshots, meta={
            "samples_seen": self.step * t.batch_size, "wandb_id": self.wandb_id,
            "data_order": data_order(self.cfg.data), "data": data_identity(self.train_set),
            **self.snapshot_meta,
            "layout": {"world_size": g.world_size, "dp": g.dp_size, "pp": g.pp_size,
                       "tp": g.tp_size, "strategy": self.cfg.parallel.dp},
            "precision": self.strategy.precision.state(),  # fp16: the loss scaler's state
            "lr_schedule": {"warmup_steps": t.warmup_steps, "max_steps": t.max_steps,
                            "lr": t.lr, "min_lr": t.min_lr},
            "rng": {"scheme": "torch.manual_seed((seed*1000003 + step)*1009 + dp_rank) "
                              "at the start of each step; pipeline stages and TP ranks derive "
                              "their streams from it (Strategy.reseed, parallel/grid.derive_seed)",
                    "seed": t.seed},
        })

    def close(self):
        if self.metrics is not None:
            self.metrics.close()
