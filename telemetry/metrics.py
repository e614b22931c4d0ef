"""What a run reports: metrics.jsonl (one JSON object per logged step, written by the
main rank only; a resumed run keeps the records up to its snapshot and appends),
the console line, wandb (offline by default) and TensorBoard (metrics.tensorboard)."""

import json
import os
import sys

import torch


def peak_memory(device) -> dict:
    """Peak memory of this process, in MiB. CUDA: `peak_mem_mb`, the most the caching
    allocator had handed to tensors at once (max_memory_allocated), and
    `peak_mem_reserved_mb`, the most it held from the driver (max_memory_reserved: what
    nvidia-smi shows, minus the CUDA context) -- an out-of-memory comes when reserved
    memory cannot grow. CPU: `peak_mem_mb` is the process's max RSS."""
    if device.type == "cuda":
        return {"peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20,
                "peak_mem_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20}
    return {"peak_mem_mb": peak_rss_kib() / 1024}


def peak_rss_kib() -> int:
    """This process's peak resident memory so far (host memory, on CUDA too), in KiB."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB


class MetricsLog:
    """metrics.jsonl, the console and wandb; active on the main rank only."""

    def __init__(self, cfg, config_dict, active, resumed_step, wandb_id, resumed_record=None):
        """resumed_record: the metrics record the snapshot of resumed_step carries
        (Trainer.save), written back if a kill came between the commit and its line."""
        self.active, self.run, self.tensorboard = active, None, None
        self.tty = active and sys.stdout.isatty()
        if not active:
            return
        os.makedirs(cfg.trainer.run_dir, exist_ok=True)
        self.path = os.path.join(cfg.trainer.run_dir, "metrics.jsonl")
        restored = self._keep_steps_up_to(resumed_step, resumed_record)  # a fresh run starts empty
        if cfg.metrics.tensorboard:  # from the first step this run writes (restored's included)
            from telemetry.tensorboard import TensorBoardLog
            self.tensorboard = TensorBoardLog(cfg.trainer.run_dir,
                                              resumed_step + (restored is None))
            if restored is not None:
                self.tensorboard.write(restored)
        if cfg.wandb.mode != "disabled":
            import wandb
            # silent: wandb's own banner, hints and end-of-run summary (some 30 lines) would
            # bury the program's; what a user needs from it is one line of ours
            self.run = wandb.init(
                project=cfg.wandb.project, id=wandb_id, resume="allow", mode=cfg.wandb.mode,
                name=cfg.wandb.name or os.path.basename(os.path.normpath(cfg.trainer.run_dir)),
                dir=cfg.trainer.run_dir, config=config_dict, settings=wandb.Settings(silent=True))
            if cfg.wandb.mode == "online":
                print(f"wandb: {self.run.url}", flush=True)
            if restored is not None:
                self.run.log(restored, step=restored["step"])

    def _keep_steps_up_to(self, step, snapshot_record=None):
        """Drop records past the snapshot (the resumed run writes those steps again) and
        any line a crash left half-written, add the snapshot step's own record if the file
        lacks it (and return that record; a new run directory starts after the snapshot,
        without it); replace the file atomically."""
        lines, last, continued = [], 0, os.path.exists(self.path)
        if continued:  # this run directory's own run goes on (not a new one from a snapshot)
            with open(self.path) as f:
                for line in f:
                    try:
                        logged = json.loads(line)["step"]
                        if logged <= step:
                            lines.append(line if line.endswith("\n") else line + "\n")
                            last = max(last, logged)
                    except (ValueError, KeyError, TypeError):
                        pass
        restored = snapshot_record if continued and snapshot_record is not None and last < step \
            else None
        if restored is not None:
            lines.append(json.dumps(restored) + "\n")
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(lines)
        os.replace(tmp, self.path)
        return restored

    def write(self, record, total_steps, console):
        if not self.active:
            return
        note = record.pop("skipped_note", None)  # the console's, not a metric
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.run is not None:
            self.run.log(record, step=record["step"])
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        if note:
            print(f"step {record['step']}: {note}", flush=True)
        if console:
            line = (f"step {record['step']}/{total_steps} | loss {record['loss']:.4f} | "
                    f"lr {record['lr']:.2e} | {record['tokens_per_s']:.0f} tok/s | "
                    f"{record['step_ms']:.1f} ms/step")
            if "mfu" in record:
                line += f" | mfu {100 * record['mfu']:.1f}%"
            if record.get("step_skipped") and "loss_scale" in record:
                line += f" | skipped (fp16 overflow; loss scale now {record['loss_scale']:g})"
            elif record.get("step_skipped"):
                line += " | skipped (gradients not finite)"
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
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.run is not None:
            offline = self.run.settings.mode == "offline"
            self.run.finish()
            if offline:
                where = self.run.settings.sync_dir
                print(f"wandb: offline run in {where}; upload it with `wandb sync {where}`",
                      flush=True)
