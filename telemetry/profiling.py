"""`trainer.profile_from=N trainer.profile_steps=K`: torch.profiler over steps N..N+K-1.

Every rank records those optimizer steps (CPU activity, and CUDA kernels on a GPU) and
writes one Chrome trace, `<run_dir>/profile/trace-rank<R>.json` (R: the global rank,
five digits), which Perfetto (ui.perfetto.dev) and chrome://tracing open. Collectives
show in it as torch.distributed's ops (`c10d::allreduce_`, `gloo:all_reduce`,
`nccl:all_reduce`, ... and their kernels on a GPU), beside the matmuls, so one rank's
trace shows where it waited. The window is the step's whole body: forward, backward,
clipping, the optimizer, evaluation and a snapshot if the step has them, and the
end-of-step agreement; each step is one range named `train step <n>`.

`trainer.memory_snapshot=true` (CUDA only): the caching allocator's history over the
same steps (steps 1..K when profile_from is 0), dumped per rank to
`<run_dir>/profile/memory-rank<R>.pickle` for PyTorch's memory viewer
(pytorch.org/memory_viz). On another device the main rank says once that it is CUDA only.
When the window closes the main rank prints one line saying where the files went.

Each rank writes its own files (every node has its own ranks' files when run_dir is
not shared); nothing here is a collective.
"""

import os

import torch

MEMORY_EVENTS = 100_000  # allocator events kept (torch's own default)


def trace_name(rank):
    return f"trace-rank{rank:05d}.json"


def memory_snapshot_name(rank):
    return f"memory-rank{rank:05d}.pickle"


class StepProfiler:
    def __init__(self, tcfg, grid):
        self.rank, self.device, self.is_main = grid.rank, grid.device, grid.is_main
        self.world_size = grid.world_size
        self.dir = os.path.join(tcfg.run_dir, "profile")
        self.first = tcfg.profile_from
        self.steps = max(1, tcfg.profile_steps)
        self.memory = tcfg.memory_snapshot and self.device.type == "cuda"
        if tcfg.memory_snapshot and not self.memory and grid.is_main:
            print(f"note: trainer.memory_snapshot is CUDA only: no memory snapshot on "
                  f"{self.device.type}", flush=True)
        if self.memory and not self.first:
            self.first = 1  # the memory snapshot's window
        self.profile = tcfg.profile_from > 0
        self.prof = None
        self.recording = False
        self.range = None  # the current step's record_function
        self.in_step = False  # between before_step and after_step
        self.current = None  # the step running (before_step's)
        self.stopped_at = None  # the last step in the window (close: the one it ended in)

    def before_step(self, step):
        """Called with the number of the step about to run (1 = the first); again for a
        redone try of it (a replica group failed in it), which stays in the first one's."""
        if self.in_step:
            return
        self.in_step, self.current = True, step
        if self.prof is not None:
            self.range = torch.profiler.record_function(f"train step {step}")
            self.range.__enter__()
        if not self.first or step != self.first:
            return
        os.makedirs(self.dir, exist_ok=True)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS)
        if self.profile:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.__enter__()
            self.range = torch.profiler.record_function(f"train step {step}")
            self.range.__enter__()
        self.recording = True

    def after_step(self, step, last=False):
        """Called after step `step` (and its record, evaluation and snapshot)."""
        self.in_step = False
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if self.recording and (step >= self.first + self.steps - 1 or last):
            self.stopped_at = step
            self._stop()

    def _stop(self):
        self.recording = False
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if self.prof is not None:
            self.prof.__exit__(None, None, None)  # waits for the device's events
            self.prof.export_chrome_trace(os.path.join(self.dir, trace_name(self.rank)))
            self.prof = None
        if self.memory:
            torch.cuda.memory._dump_snapshot(os.path.join(self.dir, memory_snapshot_name(self.rank)))
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.is_main:  # where the files went: each rank writes its own, the same names
            print(self.written(), flush=True)

    def written(self):
        """The line that says where the window's files went."""
        last = self.world_size - 1
        names = ([trace_name(0)] if self.profile else []) + \
            ([memory_snapshot_name(0)] if self.memory else [])
        each = "" if not last else f" (one per rank, rank00000 to rank{last:05d})"
        what = " and ".join(os.path.join(self.dir, n) for n in names)
        return f"profile: steps {self.first} to {self.stopped_at} written to {what}{each}"

    def close(self):
        """A run that ends (or fails) inside the window still leaves what it recorded."""
        if self.recording:
            self.stopped_at = self.current
            self._stop()
