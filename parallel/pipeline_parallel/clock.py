"""Marks on the device's own timeline, for the pipeline's busy / idle time.

On CUDA, kernels and NCCL waits run asynchronously: the host returns from a
forward long before the GPU has run it, so host timers around it would time
launches. There a mark is a CUDA event recorded on the current stream, and a
span is the time the GPU took between two events, read once per step after
synchronizing on the last one. Elsewhere (CPU) a mark is the host clock, which
is the device's. Either way `pp_bubble` and the timeline mean the same thing:
how long the device computed each action, and how long it idled.
"""

import time

import torch


class DeviceClock:
    def __init__(self, device, event_class=None):
        """event_class: the timing event type of the device (torch.cuda.Event on CUDA;
        tests pass a stand-in); None: the host clock."""
        if event_class is None and device.type == "cuda":
            event_class = torch.cuda.Event
        self.event_class = event_class

    def mark(self):
        if self.event_class is None:
            return time.perf_counter()
        event = self.event_class(enable_timing=True)
        event.record()
        return event

    def seconds(self, origin, marks):
        """Seconds from `origin` to each of `marks` (all taken by mark()). Blocks until
        the device has passed the last mark."""
        if self.event_class is None:
            return [m - origin for m in marks]
        if marks:
            marks[-1].synchronize()  # events complete in stream order: all are done then
        return [origin.elapsed_time(m) / 1000 for m in marks]
