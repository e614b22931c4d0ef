"""Our own ring all-reduce over point-to-point isend/irecv (`parallel.allreduce=ring`).

The W ranks of a group form a logical ring: each sends to rank+1 and
receives from rank-1. The flat tensor is cut into W chunks (uneven when W
does not divide its size; some chunks are empty when it has fewer than W
elements). Then

  reduce-scatter, W-1 steps: in step s rank r sends chunk (r-s) and adds the
      chunk (r-s-1) it receives into its own copy; afterwards rank r holds
      the complete sum of chunk (r+1);
  all-gather, W-1 steps: in step s rank r sends chunk (r+1-s) and stores the
      chunk (r-s) it receives; afterwards every rank holds every sum.

Each rank sends 2(W-1)/W of the tensor, the textbook minimum, and every
element of the result is summed on exactly one rank and copied to the others,
so all ranks end with bit-identical values (summation order differs from
gloo's own all_reduce, hence equal to it up to float rounding).

Every send goes through a CommCounter (parallel/comm.py), so it is counted.
`RingRunner` gives the async flavour the bucket hooks need: rings run one at
a time, in submission order, on one background thread, and `submit` returns
a handle whose wait() blocks until that ring is done (or re-raises its error).

On CUDA the thread makes the rank's own device current (a new thread starts on
device 0, and NCCL's batched point-to-point needs the right one) and runs the
ring on a side stream: it starts after an event recorded on the compute stream
when the bucket was handed over, and wait() makes the compute stream wait for
the ring's end event, so backward keeps computing while rings run. Two host
threads driving two NCCL communicators (the ring's, and tensor or pipeline
parallelism's from autograd) can order them differently on different ranks, a
documented NCCL deadlock: ddp_bucket refuses the ring with tp or pp > 1 on CUDA.
"""

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist


def ring_all_reduce(tensor, comm, group=None):
    """Sum `tensor` in place across `group` (like dist.all_reduce with SUM)."""
    world = dist.get_world_size(group)
    if world == 1 or tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    rank = dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)  # isend/irecv address global ranks
    right, left = ranks[(rank + 1) % world], ranks[(rank - 1) % world]
    chunks = torch.tensor_split(flat, world)  # views; sizes differ by at most one element
    scratch = torch.empty_like(chunks[0])     # chunk 0 is the largest

    def exchange(send_idx, recv_into):
        """Send chunks[send_idx] right while receiving into `recv_into` from the left.
        Both sides know every chunk's size, so empty chunks are skipped on both."""
        sends = [(chunks[send_idx], right)] if chunks[send_idx].numel() else []
        recvs = [(recv_into, left)] if recv_into.numel() else []
        for w in comm.exchange(sends, recvs, group=group):
            w.wait()

    for s in range(world - 1):  # reduce-scatter
        recv_idx = (rank - s - 1) % world
        incoming = scratch[:chunks[recv_idx].numel()]
        exchange((rank - s) % world, incoming)
        chunks[recv_idx].add_(incoming)
    for s in range(world - 1):  # all-gather: receive straight into place
        exchange((rank + 1 - s) % world, chunks[(rank - s) % world])

    if flat.data_ptr() != tensor.data_ptr():  # non-contiguous input: copy the result back
        tensor.copy_(flat.view_as(tensor))
    return tensor


class DoneHandle:
    """Handle of work that needed no communication."""

    def wait(self):
        return True


class _RingHandle:
    def __init__(self, future, on_side_stream=False):
        self.future, self.on_side_stream = future, on_side_stream

    def wait(self):
        done = self.future.result()  # re-raises whatever the ring raised
        if self.on_side_stream:  # CUDA: the compute stream waits for the ring, the host does not
            torch.cuda.current_stream().wait_event(done)
        return True


class RingRunner:
    """Runs ring all-reduces in the background, strictly one after another.

    One thread, FIFO: every rank submits its buckets in the same order, so the
    point-to-point messages of different rings can never be matched with one
    another (they share peers and tags).
    """

    def __init__(self, comm, group=None, device=torch.device("cpu")):
        self.comm, self.group = comm, group
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ring-allreduce",
                                       initializer=torch.cuda.set_device if cuda else None,
                                       initargs=(device,) if cuda else ())

    def submit(self, tensor):
        if dist.get_world_size(self.group) == 1:
            return DoneHandle()
        if self.stream is None:
            return _RingHandle(self.pool.submit(ring_all_reduce, tensor, self.comm, self.group))
        filled = torch.cuda.Event()
        filled.record()  # on the compute stream: the bucket's gradients are written then
        tensor.record_stream(self.stream)  # the allocator must not reuse it before the ring ends
        return _RingHandle(self.pool.submit(self._on_side_stream, tensor, filled), on_side_stream=True)

    def _on_side_stream(self, tensor, filled):
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(filled)
            ring_all_reduce(tensor, self.comm, self.group)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done
