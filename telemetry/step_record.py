"""A step's metrics record (metrics.jsonl, the console line, wandb), from its sources, asked
every step (their figures count from one step to the next). Written at the steps every
rank measures alike (logged or evaluated: their figures take collectives) and at one that
compiled or changed the replica groups; the loss is read (LossWatch) only then or at a save.
"""

from telemetry import mfu
from telemetry.expert_load import expert_load
from telemetry.loss_watch import LossWatch
from telemetry.stragglers import straggler_figures
from telemetry.metrics import MetricsLog, peak_memory, peak_rss_kib


class StepRecord:
    def __init__(self, t, grid, strategy, clock, tokens_per_step, flops_per_token):
        """clock: a DeviceClock (step_ms: CUDA events on a GPU, else the host's)."""
        self.t, self.grid, self.strategy, self.clock = t, grid, strategy, clock
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        # the strategy is built (this rank's parameters materialized) and nothing trained
        # yet: the fullest rank's peak host memory so far, for the first record written
        self.setup = {"setup_peak_rss_mb": grid.max_over_ranks([peak_rss_kib()])[0] / 1024}
        # model FLOPs utilisation where the device's peak is known (never on CPU: mfu.py)
        self.peak_flops = mfu.device_peak(grid.device, t.precision)
        self.losses = LossWatch(grid.device, t.max_skipped_steps,
                                count_skips=t.precision != "fp16")  # fp16: the scaler's
        self.log, self.started = None, None

    def open(self, cfg, config_dict, step, wandb_id, resumed_record):
        self.log = MetricsLog(cfg, config_dict, self.grid.is_main, step, wandb_id, resumed_record)

    def before_step(self):
        self.started = self.clock.mark()

    def after_step(self, step, loss, grad_norm, lr, data_ms, measured, last, saved, sources):
        """The record of step `step` (from 1), or None. saved: it writes a snapshot (never of
        a model a non-finite loss trained); sources: their figures() give (fields, whether
        the step must be written)."""
        ended = self.clock.mark()  # after the optimizer's kernels, not before them
        self.losses.watch(loss, grad_norm, step)
        comm = self.strategy.comm_stats()
        # this step's waits (on CUDA the device's, read only at a measured step)
        waited_ms = 1000 * self.strategy.comm.take_waited_s(read=measured)
        stats, files = self.strategy.step_stats(last, measure=measured or last)
        if measured or last:  # mixture of experts: the balance losses and the load
            stats = {**stats, **expert_load(self.strategy)}
        figures = [source.figures() for source in sources]
        written = measured or any(eventful for _, eventful in figures)
        record = None
        if written or saved:
            loss, grad_norm, skips = self.losses.read(loss, grad_norm, step)  # may raise
        if written:
            # the whole step on the device's timeline, optimizer included (data: read before it)
            elapsed = self.clock.seconds(self.started, [ended])[0] + data_ms / 1000
            if measured:  # every rank's busy time: which one the others wait for
                stats = {**stats, **straggler_figures(self.grid, 1000 * elapsed, waited_ms)}
            record = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                      "tokens_per_s": self.tokens_per_step / elapsed,
                      "step_ms": 1000 * elapsed, "data_ms": data_ms,
                      **peak_memory(self.grid.device),
                      # state_bytes (and host_state_bytes): a collective, at measured steps
                      **(self.strategy.state_figures() if measured else {}),
                      **comm, **stats, **self.strategy.precision.metrics(), **skips}
            if self.peak_flops:
                record["mfu"] = mfu.mfu(self.flops_per_token, record["tokens_per_s"],
                                        self.peak_flops, self.grid.world_size)
            for fields, _ in figures:
                record.update(fields)
        self.log.write_files(files)
        return record

    def write(self, record, step, console):
        """The step's record (None: the progress bar only); console: its line too."""
        if record is None:
            return self.log.progress(step, self.t.max_steps)
        record.update(self.setup)  # the first record only
        self.setup = {}
        self.log.write(record, self.t.max_steps, console=console)

    def close(self):
        if self.log is not None:
            self.log.close()
