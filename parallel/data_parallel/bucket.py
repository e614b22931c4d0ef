"""`ddp_bucket`: data parallelism with gradient buckets that overlap backward.

Like ddp_naive, every rank holds the model and gradients are averaged, but:

- Gradients live in a few flat buckets of about `parallel.bucket_cap_mb`,
  filled in *reverse* parameter order (roughly the order backward produces
  them). Each `param.grad` is a view into its bucket, so gradients are never
  copied and there is no second full copy of them (DDP's
  gradient_as_bucket_view).
- A post-accumulate-grad hook on every parameter marks its gradient ready;
  when a bucket's last gradient is ready, its all-reduce starts at once,
  asynchronously, while backward goes on computing earlier layers. After
  backward we only wait for what is still in flight, then divide by the
  group size.
- With gradient accumulation, the hooks do nothing on all but the last
  micro-step (`backward_scope`): gradients just accumulate in the buckets. Under
  pipeline parallelism that is each chunk's last backward of the step, so
  buckets start during the schedule's cool-down.

Per step it communicates: one all-reduce per bucket, 4 bytes x parameter
count in all (with `parallel.allreduce=ring`, each bucket's all-reduce is
our ring of point-to-point sends, run on a background thread). With
`parallel.reduce_dtype=bf16` a full bucket is cast to a bf16 copy, that copy
is all-reduced (half the bytes), and the sum is copied back into the fp32
bucket before the division: gradients stay fp32 in memory. Once at
start: rank 0 of the data-parallel group broadcasts parameters and buffers.

A parameter whose hook never fires in a step (it took no part in the loss)
would leave its bucket waiting forever; we raise a UserError naming it.
"""

from contextlib import contextmanager

import torch

from parallel.data_parallel.grad_hooks import on_grad_accumulated
from parallel.data_parallel.naive import DDPNaive, unused_parameter_error
from parallel.data_parallel.ring import DoneHandle, RingRunner


def plan_buckets(named_params, cap_bytes, group_of=lambda name: None):
    """Split (name, param) pairs, in the order given, into consecutive buckets of at
    most `cap_bytes`; a parameter larger than the cap gets a bucket of its own.
    A bucket holds one dtype on one device, since it is one flat tensor, and parameters
    averaged over one group (`group_of(name)`: experts' differs from the rest)."""
    buckets, size = [], 0
    for name, p in named_params:
        nbytes = p.numel() * p.element_size()
        last = buckets[-1][-1][1] if buckets else None
        if (last is None or size + nbytes > cap_bytes
                or (p.dtype, p.device) != (last.dtype, last.device)
                or group_of(name) != group_of(buckets[-1][-1][0])):
            buckets.append([])
            size = 0
        buckets[-1].append((name, p))
        size += nbytes
    return buckets


class Bucket:
    """One flat gradient buffer and the parameters whose .grad are views into it."""

    def __init__(self, named_params, group=None, group_size=1):
        self.group, self.group_size = group, group_size  # what its all-reduce sums over
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        first = self.params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in self.params),
                                  dtype=first.dtype, device=first.device)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.ready = [False] * len(self.params)
        self.handle = None
        self.wire = None  # the reduce_dtype copy in flight, when it differs from the buffer


class DDPBucket(DDPNaive):
    name = "ddp_bucket"

    def __init__(self, local, grid, cfg):
        super().__init__(local, grid, cfg)  # broadcasts rank 0's weights
        trainable = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        cap = int(cfg.bucket_cap_mb * 2**20)
        expert = self.expert_names()
        self.buckets = [Bucket(b, *self.sum_group(b[0][0] in expert))
                        for b in plan_buckets(reversed(trainable), cap, lambda n: n in expert)]
        self.slot = {}  # param -> (bucket, index in bucket)
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                self.slot[p] = (bucket, i)
                # named_parameters lists the tied embedding / LM head weight once, so it gets one
                # hook, which fires once, after both of its uses have accumulated
                on_grad_accumulated(p, self._on_grad_ready)  # held weakly (grad_hooks.py)
        self.ring = RingRunner(self.comm, self.group, self.device) if self.use_ring else None
        self.syncing, self.grads_copied = False, 0
        self._point_grads_at_buckets()

    def drop_gradients(self):
        held = super().drop_gradients()  # every .grad dropped (zero_grad(set_to_none=True))
        self._point_grads_at_buckets()
        return held

    def _point_grads_at_buckets(self):
        """Every .grad a view of its zeroed slot, so that the next backward accumulates
        straight into the buckets."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.ready = [False] * len(bucket.params)
            bucket.handle = None
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view
        self.next_launch = 0

    @contextmanager
    def backward_scope(self, chunk, last):
        """Hooks launch all-reduces only during the last micro-step's backward (with a
        pipeline: each chunk's last backward of the step)."""
        self.syncing = last
        try:
            yield
        finally:
            self.syncing = False

    def _on_grad_ready(self, p):
        if not self.syncing:
            return
        bucket, i = self.slot[p]
        view = bucket.views[i]
        if p.grad.data_ptr() != view.data_ptr():
            # autograd replaced .grad instead of accumulating in place (e.g. create_graph=True):
            # the bucket must hold what the optimizer will read
            view.copy_(p.grad)
            p.grad = view
            self.grads_copied += 1  # should stay 0: tests check it
        bucket.ready[i] = True
        # Launch strictly in bucket order, even if hooks fire in another order: every rank
        # must issue its collectives in the same sequence or they would pair up wrongly
        while (self.next_launch < len(self.buckets)
               and all(self.buckets[self.next_launch].ready)):
            bucket = self.buckets[self.next_launch]
            # one dp rank sends nothing: no rounding to the wire dtype either
            bucket.wire = bucket.buffer if (bucket.buffer.dtype == self.reduce_dtype
                                            or bucket.group_size == 1) \
                else bucket.buffer.to(self.reduce_dtype)
            bucket.handle = self.start_all_reduce(bucket.wire, bucket)
            self.next_launch += 1

    def start_all_reduce(self, flat, bucket):
        """SUM over the bucket's group, asynchronously; returns a handle with .wait()."""
        if bucket.group_size == 1:
            return DoneHandle()
        if self.ring is not None:  # (parallel/rules.py: not with experts' groups)
            return self.ring.submit(flat)
        return self.comm.all_reduce(flat, group=bucket.group, async_op=True)

    @torch.no_grad()
    def sync_gradients(self):
        # Wait for what is in flight first, so no collective is left dangling if we raise
        for bucket in self.buckets[:self.next_launch]:
            bucket.handle.wait()
            if bucket.wire is not bucket.buffer:
                bucket.buffer.copy_(bucket.wire)  # the bf16 sum back into the fp32 bucket
            bucket.wire = None
            bucket.buffer.div_(self.dp_size)
        if self.next_launch < len(self.buckets):
            missing = [name for b in self.buckets[self.next_launch:]
                       for name, ready in zip(b.names, b.ready) if not ready]
            raise unused_parameter_error(missing)
