"""The training loop, minGPT's: each concern of a run is an object called at a fixed point
of the step; the trainer knows only their order.

It talks to one `parallel.strategy.Strategy` and never asks which one, nor whether fault
tolerance is on: this launch's replica group deals each step's batch and votes on it (the
plain run's, fault_tolerance/one_group.py, deals the whole batch and always commits).
Everything a step reads is a function of (config, step) (training/step.py), so a snapshot
needs only the step, the model and the optimizer to continue exactly, under any layout.
It also records what fixes the data order (the sampler and its version, the train
split's size and, for prepared tokens, the corpus's fingerprint), and check_resumable
refuses to continue with another.

A step, in this order (steps; train wraps them: a collective that gives up waiting ends
the run with every rank's report of where it was and who is behind, launch/hang_report.py):

 0. hangs.at              the step, for a hang report (and the phases of 8 and 11)
 1. profiler.before_step  its range in the trace; a redone try stays in it (telemetry/)
 2. record.before_step    its start on the device's clock (telemetry/step_record.py)
 3. group.begin_step      the quorum (a replica group's, started at the end of 5): the step
                          to compute, this group's shares of its batch
 4. batches.take          this rank's micro-batches: read ahead at 11 for these shares, else
                          now and agreed
 5. compute_step          reseed, forward and backward under the activation meter, the sum
                          across replica groups, the clip, their vote, the optimizer step,
                          then the next step's quorum started in the background (a replica
                          group's; training/step.py); voted down: dropped, and redone from 1
 6. record.after_step     the loss watch; the figures of the strategy, the group, the meter,
                          compilation; the record if the step logs, evaluates, compiled or
                          changed the groups (the loss read then: raises on inf or NaN)
 7. evaluate              at trainer.eval_every and the last step
 8. save                  at trainer.save_every and the last step, by one group; now or in
                          the background (checkpoint/sync_snapshot.py, async_snapshot.py)
 9. record.write          metrics.jsonl, the console, wandb
10. profiler.after_step
11. end_of_step           (not after the last) the next step's batches read for the shares
                          this step held, then one all-reduce agrees on a stop signal
                          (snapshot, exit 75), a damaged read, a background snapshot's progress
                          (launch/preemption.py)
"""

import os
import sys
import time
import uuid

from char_dataset import GlobalBatches, data_identity, data_order, eval_starts
from checkpoint.async_snapshot import AsyncSnapshots
from checkpoint.resume import snapshot_location
from checkpoint.sync_snapshot import SyncSnapshots
from errors import UserError
from fault_tolerance.one_group import OneGroup
from fault_tolerance.replica_group import QuorumLost
from launch.hang_report import HangReport
from launch import preemption
from launch.preemption import EndOfStep
from parallel.comm import collective_failure, timed_out
from parallel.compile import compile_events
from parallel.grid import together
from parallel.pipeline_parallel.clock import DeviceClock
from telemetry import mfu
from telemetry.activation_meter import ActivationMeter
from telemetry.compile_time import CompileTime
from telemetry.profiling import StepProfiler
from telemetry.step_record import StepRecord
from training.batches import StepBatches
from training.step import compute_step


def due(every, step, last=False):
    """Whether a step does what comes every `every` steps (0: never) and at the last."""
    return bool(every and (step % every == 0 or last))


class Trainer:
    def __init__(self, cfg, strategy, grid, train_set, val_set, snapshot_meta):
        """strategy: ready to train (parallelize(model, grid, cfg): compiled, recomputed,
        its precision and optimizer set). snapshot_meta: what the snapshot carries beyond
        the training state (the config as a dict, GPT shape, tokenizer). Then restore()
        (optional), open_metrics() and join_replicas() before train()."""
        self.cfg, self.t = cfg, cfg.trainer
        self.strategy, self.grid = strategy, grid
        self.train_set, self.val_set = train_set, val_set
        self.snapshot_meta = snapshot_meta
        self.snapshot_path = snapshot_location(self.t)
        self.step, self.wandb_id = 0, uuid.uuid4().hex[:12]
        self.saved_at = 0  # the step of the last snapshot this launch wrote (or resumed)
        self.resumed_record = None  # the snapshot step's metrics record (restore())
        t = self.t
        self.record = StepRecord(t, grid, strategy, DeviceClock(grid.device),
                                 t.batch_size * train_set.block_size,
                                 mfu.flops_per_token(snapshot_meta["gpt_config"]))
        self.compiles = CompileTime(compile_events() if t.compile else None)
        self.meter = ActivationMeter(on=t.measure_activations)
        self.snapshots = (AsyncSnapshots if t.snapshot_async else SyncSnapshots)(
            self.snapshot_path, grid, t.keep_snapshots)
        self.profiler = StepProfiler(t, grid)  # trainer.profile_from / memory_snapshot
        self.batches = StepBatches(GlobalBatches(len(train_set), t.batch_size, t.seed,
                                                 cfg.data.sampler), train_set, grid, t.grad_accum)
        self.group = OneGroup()  # join_replicas: this launch's (ft.enabled: a ReplicaGroup)
        self.hangs = HangReport(t.run_dir, grid.rank, grid.world_size, strategy.comm,
                                cfg.parallel.timeout_s)
        if grid.is_main:
            self.hangs.clear()  # an earlier launch's reports are not this one's
        self.end_of_step = EndOfStep(grid, self.snapshots, lambda: self.save(final=True), t,
                                     self.snapshot_path)

    def restore(self, reader):
        """Take model, optimizer and step from a snapshot (checked by check_resumable).
        Damage a rank's reads find (a checksum) stops every rank with that rank's line,
        after the load's collectives ran alike on every rank."""
        with reader.damage_found_later():
            self.strategy.load_shards(reader)
        damage = self.grid.first_line(reader.found)
        if damage is not None:
            raise UserError(damage)
        self.strategy.precision.load_state(reader.meta.get("precision"))  # the fp16 loss scale
        if self.strategy.balancer is not None:  # mixture of experts: the choice biases
            self.strategy.balancer.load_state(reader.meta.get("moe_bias"))
        self.step, self.wandb_id = reader.meta["step"], reader.meta["wandb_id"]
        self.saved_at = self.step
        self.resumed_record = reader.meta.get("metrics_record")
        if self.grid.is_main:
            print(f"resuming from snapshot {self.snapshot_path} at step {self.step}", flush=True)

    def join_replicas(self, group):
        """This launch's replica group (fault_tolerance/replica_group.start)."""
        self.group = group

    def open_metrics(self):
        self.record.open(self.cfg, self.snapshot_meta["config"], self.step, self.wandb_id,
                         self.resumed_record)

    def train(self):
        """The steps up to trainer.max_steps; a collective that gave up waiting ends it with
        where every rank was and which are behind, and a step that runs longer than
        parallel.timeout_s has the watchdog write the same (launch/hang_report.py)."""
        # each rank's watchdog: on NCCL no timeout reaches this thread (launch/hang_report.py)
        watch = self.hangs.watch() if self.grid.world_size > 1 else None
        try:
            with preemption.stepping(self.progress):  # Ctrl-C: after the step; again: at once
                return self.steps()
        except Exception as e:
            failure = collective_failure(e, self.cfg.parallel.timeout_s)
            if failure is None:
                raise
            raise self.hangs.explain(failure, e, timed_out(e)) from e
        finally:
            if watch is not None:
                watch.stop()

    def steps(self):
        """The steps up to trainer.max_steps, in the order of the module's docstring."""
        t, group = self.t, self.group
        while self.step < t.max_steps:
            self.hangs.at(step=self.step + 1, phase="start of step")
            self.profiler.before_step(self.step + 1)
            self.record.before_step()
            try:
                self.step, shares = group.begin_step(self.step)  # a healing group's step jumps
            except QuorumLost:  # the lighthouse gone: the last committed step is kept
                if self.step > self.saved_at and group.writes_snapshots():
                    self.save(final=True)
                raise
            micro, data_ms = self.batches.take(self.step, shares, group.replicas)
            done = compute_step(self.strategy, micro, self.step, t, group, self.meter)
            if done is None:  # voted down (a replica group failed in it): redone
                continue
            self.step += 1
            last = self.step == t.max_steps
            logged = due(t.log_every, self.step, last)
            evaluated = due(t.eval_every, self.step, last)
            saved = (due(t.save_every, self.step) or last) and group.writes_snapshots()
            self.hangs.at(phase="metrics record")
            record = self.record.after_step(self.step, *done, data_ms, measured=logged or evaluated,
                                            last=last, saved=saved,
                                            sources=(group, self.meter, self.compiles))
            if evaluated:
                record.update(val_loss=self.evaluate(), **self.compiles.after_eval())
            if saved:
                self.hangs.at(phase="snapshot")
                self.save(final=last, record=record)
            self.record.write(record, self.step, console=logged or last)
            self.profiler.after_step(self.step, last)
            if not last:  # the next step's batches where known, then one all-reduce
                self.hangs.at(phase="end of step")
                error = self.batches.read_ahead(self.step, group.next_shares(), group.replicas)
                self.end_of_step.after_step(self.step, saved, error)
        return self.step

    def progress(self):
        """(steps done, trainer.max_steps, the step of the snapshot a new run would resume
        from or 0, whether this is the main rank): a second Ctrl-C's line."""
        try:
            from checkpoint.snapshot_reader import open_snapshot
            snapshot = open_snapshot(self.snapshot_path)
            committed = snapshot.meta["step"] if snapshot else 0
        except Exception:  # noqa: BLE001  (a line about stopping: the write's last start)
            committed = self.saved_at
        return self.step, self.t.max_steps, committed, self.grid.is_main

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
        background. Adds its figures to `record`, the step's metrics record (None: none).

        The snapshot carries that record as it stands, because it is written to
        metrics.jsonl only after the snapshot commits: a kill in between would otherwise
        leave the step missing from metrics.jsonl (the resumed run starts after it), and
        MetricsLog writes it back from here."""
        started, self.saved_at = time.perf_counter(), self.step
        pieces = self.strategy.shard_pieces()
        meta = self._snapshot_meta()
        if record is not None:
            meta["metrics_record"] = dict(record)
        waited = self.snapshots.save_step(self.step, pieces, meta, final)
        if record is not None:
            record.update(snapshot_ms=1000 * (time.perf_counter() - started), **waited)

    def _snapshot_meta(self):
        """What a snapshot records besides the tensors (the manifest)."""
        g, t = self.grid, self.t
        return {
            "samples_seen": self.step * t.batch_size, "wandb_id": self.wandb_id,
            "data_order": data_order(self.cfg.data), "data": data_identity(self.train_set),
            **self.snapshot_meta,
            "layout": {"world_size": g.world_size, **g.sizes, "strategy": self.strategy.name},
            "precision": self.strategy.precision.state(),  # fp16: the loss scaler's state
            **({"moe_bias": self.strategy.balancer.state()} if self.strategy.balancer else {}),
            "lr_schedule": {"warmup_steps": t.warmup_steps, "max_steps": t.max_steps,
                            "lr": t.lr, "min_lr": t.min_lr},
            "rng": {"scheme": "torch.manual_seed((seed*1000003 + step)*1009 + dp_rank) "
                              "at the start of each step; pipeline stages and TP ranks derive "
                              "their streams from it (Strategy.reseed, parallel/grid.derive_seed)",
                    "seed": t.seed},
        }

    def close(self):
        """What the run stopped inside of: the profiler's window, wandb, a background save
        (said in one line: no step's all-reduce will report it any more), the group."""
        self.profiler.close()
        self.record.close()
        lost = self.snapshots.close()  # a save the run stopped in the middle of
        if lost:
            where = f" on rank {self.grid.rank}" if self.grid.world_size > 1 else ""
            sys.stderr.flush()  # one write of the whole line, as main.py's error line
            os.write(2, f"warning{where}: {lost}\n".encode())
        self.group.close()
