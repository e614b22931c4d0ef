"""`parallel.pp=P`: pipeline parallelism, applied to the GPT from outside.

`Pipeline` cuts the model in place, so this rank keeps only its chunks: the
transformer blocks of each chunk it runs (pipeline_parallel/schedules.py says which
chunk runs where, and balances blocks, or follows `parallel.pp_layers`), the
token and position embeddings if it runs the first chunk, the final LayerNorm
and LM head if it runs the last (the model plan, parallel/model_plan.py,
says which modules those are). Parameter names stay canonical, so
placements, snapshots and the optimizer groups work unchanged.

The token embedding stays tied to the LM head although they live on the first
and last stage: both hold the weight (model_plan.TIED), their
gradients are summed between the two after every step's backward (the
embedding group, Megatron's), and identical updates keep the copies bitwise
equal. The last stage's copy is marked `tied="last"`: it is not counted in
the gradient norm and not written to snapshots (the first stage's is).

`run` executes one schedule over M micro-batches. Activations go forward and
gradients backward by non-blocking point-to-point sends and receives through
the counted `comm.exchange`, batched as pipeline_parallel/p2p_plan.py lays
out (the simulator, simulator.py, runs that very plan under gloo's and
NCCL's rules); an action waits only for its own input. Each
micro-batch's loss is divided by the number of micro-batches of the whole
step, so gradients equal one process's on the global batch. Per step it
records every action's start and end, so busy and idle time (the bubble) can
be reported per stage.
"""

from dataclasses import dataclass, replace

import torch

from parallel import model_plan as plan
from parallel.grid import DIMS
from parallel.pipeline_parallel import p2p_plan
from parallel.pipeline_parallel.clock import DeviceClock
from parallel.pipeline_parallel.schedules import chunk_blocks
from parallel.precision import Precision


KINDS = ("F", "B")  # an action's kind, as a number in step_stats' table


@dataclass
class Chunk:
    index: int       # global chunk number, 0 .. P*V - 1
    blocks: list     # canonical block indices
    first: bool      # holds the embeddings
    last: bool       # holds the final LayerNorm, LM head and loss


class Pipeline:
    def __init__(self, model, grid, cfg, comm, placements):
        """Cut `model` to this rank's chunks; returns via self.placements the placements
        of what stays (the tied copy marked)."""
        self.grid, self.comm, self.model = grid, comm, model
        # under sequence parallelism the activations between stages are sequence shards
        self.seq_shards = grid.tp_size if cfg.sequence_parallel else 1
        P, V = grid.pp_size, cfg.pp_virtual_stages
        self.P, self.V, self.M, self.schedule = P, V, cfg.microbatches, cfg.pp_schedule
        layout = chunk_blocks(model.config.n_layer, P * V, cfg.pp_layers)
        self.chunks = {c: Chunk(c, layout[c], c == 0, c == P * V - 1)
                       for c in range(P * V) if c % P == grid.pp_rank}
        self.has_first = any(ch.first for ch in self.chunks.values())
        self.has_last = any(ch.last for ch in self.chunks.values())
        plan.keep_for_stage(model, [i for ch in self.chunks.values() for i in ch.blocks],
                            self.has_first, self.has_last)
        self.blocks = dict(plan.blocks(model))  # canonical index -> block
        names = {n for n, _ in model.named_parameters()}
        self.placements = {n: pl for n, pl in placements.items() if n in names}
        if P > 1 and plan.TIED in self.placements:
            self.placements[plan.TIED] = replace(self.placements[plan.TIED],
                                                 tied="first" if self.has_first else "last")
        # when each send and receive is posted: p2p_plan.py, the batching the simulator checks
        self.steps = p2p_plan.plan(self.schedule, P, self.M, V)[grid.pp_rank]
        # each action's start and end on the device's timeline (CUDA events on CUDA)
        self.clock = DeviceClock(grid.device)
        self.timeline, self.step_started = [], None
        # every chunk forward runs under the strategy's precision (Strategy.configure_compute)
        self.precision = Precision("fp32", grid.device)
        # what crosses a stage boundary: the residual stream, which stays in the parameters'
        # dtype (fp32) under autocast too -- only matmul outputs are bf16/fp16, and the
        # residual adds promote them back; the receive buffers take this dtype, and a chunk
        # whose output had another would be cast to it (autograd casts its gradient back)
        self.wire_dtype = next(model.parameters()).dtype
        # the two ranks (first and last stage) holding the tied embedding, one pair for
        # each pipeline of the grid (every rank passes every pair, in the same order)
        if P > 1:
            axis = grid.ranks.dim() - 1  # pp moved last: pairs (first, last) of each pipeline
            ends = grid.ranks.movedim(DIMS.index("pp"), axis)[..., [0, P - 1]].reshape(-1, 2)
            self.embedding_group = grid.group_of_lines(ends.tolist())
        else:
            self.embedding_group = None

    def chunk_units(self):
        """{chunk index: [canonical parameter-name prefixes it owns]} (for fsdp's units)."""
        return {c: plan.chunk_prefixes(ch.blocks, ch.first, ch.last) for c, ch in self.chunks.items()}

    # ------------------------------------------------ one chunk's compute

    def _forward(self, chunk, x, y):
        with self.precision.autocast():
            if chunk.first:
                x = self.model.embed(x)
            for i in chunk.blocks:
                x = self.blocks[i](x)
            if chunk.last:
                return self.model.head(x, y)[1]
        return x.to(self.wire_dtype)

    def _peer(self, pp_rank):
        return self.grid.rank_at(pp=pp_rank % self.P)

    def _activation_shape(self, x):
        b, T = x.shape
        return (b, T // self.seq_shards, self.model.config.n_embd)

    # ------------------------------------------------ the schedule

    def run(self, micro_batches, scale, backward_scope):
        """One pass of the schedule over len(micro_batches) == M micro-batches (on the
        device already: Strategy.to_device, once per step). Returns
        the sum of the micro-batches' losses on the last stage (else 0).
        backward_scope(chunk, last) wraps each backward: `last` is the chunk's last
        backward of this pass (data-parallel sync hooks key on it)."""
        device = next(self.model.parameters()).device
        inputs, outputs = {}, {}
        ready = {}     # message -> tensor computed here, until its step sends it
        arriving = {}  # message -> (receive buffer, work to wait on before using it)
        sending = []   # (work, tensor): each tensor kept alive until its send is done
        loss_sum = torch.zeros((), device=device)
        if self.step_started is None:
            self.step_started = self.clock.mark()

        def take(msg):
            buf, work = arriving.pop(msg)
            work.wait()
            return buf

        for step in self.steps:
            if step.action is not None:
                kind, c, m = step.action
                chunk = self.chunks[c]
                x, y = micro_batches[m]
                if kind == "F":
                    inp = x if chunk.first else take(("act", c, m)).requires_grad_()
                    started = self.clock.mark()
                    out = self._forward(chunk, inp, y)
                    self._record("F", c, m, started)
                    inputs[c, m], outputs[c, m] = inp, out
                    if chunk.last:
                        loss_sum += out.detach()
                    else:
                        ready["act", c + 1, m] = out.detach().contiguous()
                else:
                    grad = None if chunk.last else take(("grad", c, m))
                    started = self.clock.mark()
                    with backward_scope(c, m == self.M - 1):
                        if chunk.last:
                            (outputs[c, m] * scale).backward()
                        else:
                            outputs[c, m].backward(grad)
                    self._record("B", c, m, started)
                    inp = inputs.pop((c, m))
                    outputs.pop((c, m))
                    if not chunk.first:
                        ready["grad", c - 1, m] = inp.grad.contiguous()
            sends = [(ready.pop(msg), self._peer(dst)) for dst, msg in step.sends]
            recvs = [(torch.empty(self._activation_shape(micro_batches[msg[2]][0]), device=device,
                                  dtype=self.wire_dtype), self._peer(src))
                     for src, msg in step.recvs]
            works = self.comm.exchange(sends, recvs)
            for (_, msg), (buf, _), work in zip(step.recvs, recvs, works):
                arriving[msg] = (buf, work)
            sending += [(work, tensor) for (tensor, _), work in zip(sends, works[len(recvs):])]
        for work, _ in sending:
            work.wait()
        return loss_sum

    def _record(self, kind, c, m, started):
        self.timeline.append((kind, c, m, started, self.clock.mark()))

    def step_stats(self, with_timeline=False):
        """Busy and idle time of every stage of this rank's pipeline in the last step
        (idle: time inside the schedule not spent computing -- waiting for a neighbour,
        the bubble), on every rank; with_timeline: also every stage's actions
        (kind, chunk, micro-batch, start ms, end ms). Then start the next step's record.
        One all-gather of every stage's table of actions (each stage runs the same
        number); not training traffic: uncounted."""
        seconds = self.clock.seconds(self.step_started, [t for *_, t0, t1 in self.timeline
                                                         for t in (t0, t1)])
        # on the grid's device: an NCCL group has no CPU backend
        mine = torch.tensor([[KINDS.index(k), c, m, 1000 * seconds[2 * i], 1000 * seconds[2 * i + 1]]
                             for i, (k, c, m, _, _) in enumerate(self.timeline)],
                            dtype=torch.float64, device=self.grid.device).reshape(-1, 5)
        every = torch.empty(self.P * mine.numel(), dtype=mine.dtype, device=mine.device)
        with self.comm.uncounted():
            self.comm.all_gather(every, mine.view(-1), group=self.grid.pp_group)
        every = every.view(self.P, -1, 5)
        stats, timelines, bubble = {}, [], 0.0
        for s, table in enumerate(every.tolist()):
            busy = sum(t1 - t0 for *_, t0, t1 in table)
            idle = max(0.0, max((t1 for *_, t1 in table), default=0.0) - busy)
            stats[f"pp_busy_ms_stage{s}"], stats[f"pp_idle_ms_stage{s}"] = busy, idle
            bubble += idle / max(busy + idle, 1e-9) / self.P
            timelines.append([(KINDS[int(k)], int(c), int(m), round(t0, 3), round(t1, 3))
                              for k, c, m, t0, t1 in table])
        stats["pp_bubble"] = bubble
        self.timeline, self.step_started = [], None
        return stats, (timelines if with_timeline else None)

    # ------------------------------------------------ loss and evaluation

    def last_stage_value(self, value):
        """Broadcast a scalar from the last stage to this rank's whole pipeline (not
        training traffic: uncounted)."""
        value = value.detach().clone().reshape(1)
        with self.comm.uncounted():
            self.comm.broadcast(value, src=self._peer(self.P - 1), group=self.grid.pp_group)
        return value[0]

    @torch.no_grad()
    def eval_loss(self, x, y):
        """Forward only, the whole batch as one micro-batch through every chunk in order."""
        device = next(self.model.parameters()).device
        x, y = x.to(device), y.to(device)
        out = torch.zeros((), device=device)
        with self.comm.uncounted():
            act = None
            for c in range(self.P * self.V):
                if c not in self.chunks:
                    continue
                chunk = self.chunks[c]
                if not chunk.first:
                    act = torch.empty(self._activation_shape(x), device=device, dtype=self.wire_dtype)
                    for w in self.comm.exchange(recvs=[(act, self._peer(c - 1))]):
                        w.wait()
                result = self._forward(chunk, x if chunk.first else act, y)
                if chunk.last:
                    out = result
                else:
                    for w in self.comm.exchange(sends=[(result.contiguous(), self._peer(c + 1))]):
                        w.wait()
        return self.last_stage_value(out)
