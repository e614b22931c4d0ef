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
    def __init__(self, future):
        self.future = future

    def wait(self):
        self.future.result()  # re-raises whatever the ring raised
        return True


class RingRunner:
    """Runs ring all-reduces in the background, strictly one after another.

    One thread, FIFO: every rank submits its buckets in the same order, so the
    point-to-point messages of different rings can never be matched with one
    another (they share peers and tags).
    """

    def __init__(self, comm, group=None):
        self.comm, self.group = comm, group
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ring-allreduce")

    def submit(self, tensor):
        if dist.get_world_size(self.group) == 1:
            return DoneHandle()
        return _RingHandle(self.pool.submit(ring_all_reduce, tensor, self.comm, self.group))
