"""How much memory autograd holds for backward: the live and peak bytes of saved
activations on this rank, measured with torch's saved-tensor hooks.

Process memory (RSS) mixes activations with Python, the allocator's cache and
parameters, and on CPU torch has no allocator statistics; this meter sees
exactly the tensors autograd saves. A tensor counts from the moment it is
saved until the last saved reference to its storage is released (after its
backward), each storage once; parameters and views of them are left out.
That is the number sequence parallelism (activations 1/tp between blocks),
pipeline schedules (1F1B holds at most P micro-batches, GPipe all M) and
activation checkpointing change. Selective checkpointing keeps the matmul
outputs in its own cache, outside autograd's saved tensors: it hands them to
the meter entered now (`ActivationMeter.active`) through `hold`.

    meter = ActivationMeter()
    with meter:          # forward and backward of one step
        ...
    meter.peak_bytes     # max live bytes seen inside
"""

import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks


class ActivationMeter:
    active = None  # the meter inside whose `with` this process is, if any

    def __init__(self, meta=False, on=True):
        """meta: count tensors on the meta device too (mode=dryrun's shapes-only ranks),
        each storage once by its identity (meta storages have no address). on=False
        (trainer.measure_activations off): no hooks, no field in the metrics record."""
        self.live, self.current, self.peak_bytes = {}, 0, 0  # storage key -> [bytes, refs]
        self._hooks = None
        self.meta, self.on = meta, on

    def __enter__(self):
        if self.on:
            self.peak_bytes = self.current
            self._hooks = saved_tensors_hooks(self._pack, lambda t: t)
            self._hooks.__enter__()
            ActivationMeter.active = self
        return self

    def __exit__(self, *exc):
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
            ActivationMeter.active = None

    def figures(self):
        """(fields for the step's metrics record, False: they never make it written)."""
        return ({"activation_peak_mb": self.peak_bytes / 2**20} if self.on else {}), False

    def hold(self, t):
        """Count t as saved for backward until the alias returned is released."""
        return self._pack(t)

    def _pack(self, t):
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) \
                or (t.device.type == "meta" and not self.meta):
            return t  # a weight (or its transpose) saved for backward is not an activation
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        try:
            storage = local.untyped_storage()
            ptr = ("meta", storage._cdata) if local.device.type == "meta" else storage.data_ptr()
        except RuntimeError:  # a tensor subclass with no storage of its own
            return t
        if ptr == 0:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [storage.nbytes(), 0]
            self.current += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.current)
        entry[1] += 1
        # hand autograd a detached alias, not `t`: a saved output returned as itself
        # (its grad_fn included) makes a cycle through autograd's C++ graph (tensor ->
        # node -> saved tensor) that only a backward through that node breaks; a graph
        # dropped without one (the split backward's W skips the input-gradient nodes)
        # would never be freed while measured
        saved = t.detach()
        weakref.finalize(saved, self._release, ptr)
        return saved

    def _release(self, ptr):
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]
