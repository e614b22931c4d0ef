"""`parallel.pp=P`: pipeline parallelism, applied to the GPT from outside.

`Pipeline` cuts the model in place, so this rank keeps only its chunks: the
transformer blocks of each chunk it runs (pipeline_parallel/schedules/ says which
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
from parallel.pipeline_parallel.schedules import SCHEDULES, chunk_blocks, chunk_ranks, virtual_stages
from parallel.pipeline_parallel.split_backward import backward_input, backward_weight
from parallel.precision import Precision


KINDS = ("F", "B", "W")  # an action's kind, as a number in step_stats' table


@dataclass
class Chunk:
    index: int       # global chunk number, 0 .. P*V - 1
    blocks: list     # canonical block indices
    first: bool      # holds the embeddings
    last: bool       # holds the final LayerNorm, LM head and loss


class Pipeline:
    def __init__(self, model, grid, cfg, comm, placements, precision=None):
        """Cut `model` to this rank's chunks; returns via self.placements the placements
        of what stays (the tied copy marked). precision: what every chunk's forward runs
        under (parallelize's step 6 sets it)."""
        self.grid, self.comm, self.model = grid, comm, model
        # under sequence parallelism the activations between stages are sequence shards
        self.seq_shards = grid.tp_size if cfg.sequence_parallel else 1
        P, V = grid.pp_size, virtual_stages(cfg.pp_schedule, cfg.pp_virtual_stages)
        self.P, self.V, self.M, self.schedule = P, V, cfg.microbatches, cfg.pp_schedule
        self.split = SCHEDULES[cfg.pp_schedule].split_backward  # B and W apart (zero bubble)
        self.ranks = chunk_ranks(cfg.pp_schedule, P, V)  # the pipeline rank of each chunk
        layout = chunk_blocks(model.config.n_layer, P * V, cfg.pp_layers)
        self.chunks = {c: Chunk(c, layout[c], c == 0, c == P * V - 1)
                       for c in range(P * V) if self.ranks[c] == grid.pp_rank}
        self.has_first = any(ch.first for ch in self.chunks.values())
        self.has_last = any(ch.last for ch in self.chunks.values())
        plan.keep_for_stage(model, [i for ch in self.chunks.values() for i in ch.blocks],
                            self.has_first, self.has_last)
        self.blocks = dict(plan.blocks(model))  # canonical index -> block
        named = dict(model.named_parameters())  # the tied weight once
        self.placements = {n: pl for n, pl in placements.items() if n in named}
        # both ends of the tie on one rank (zbv): one parameter, as on a single device
        self.tie_across_ranks = P > 1 and self.ranks[0] != self.ranks[-1]
        if self.tie_across_ranks and plan.TIED in self.placements:
            self.placements[plan.TIED] = replace(self.placements[plan.TIED],
                                                 tied="first" if self.has_first else "last")
        # each chunk's parameters, for its W (the tied weight in both end chunks)
        self.chunk_params = {c: [p for n, p in named.items()
                                 if n.startswith(tuple(plan.chunk_prefixes(ch.blocks, ch.first, ch.last)))]
                             for c, ch in self.chunks.items()}
        # zbv's rank 0 runs the LM head's W and later the embedding's: the tied weight's
        # gradient hooks must fire only once all of its step's gradient is in, so the
        # head's part is added without them (split_backward.backward_weight's `quiet`)
        self.quiet = {}
        if self.split and self.has_first and self.has_last and plan.TIED in named:
            self.quiet = {c: [named[plan.TIED]] for c, ch in self.chunks.items() if ch.last}
        # when each send and receive is posted: p2p_plan.py, the batching the simulator checks
        self.steps = p2p_plan.plan(self.schedule, P, self.M, V)[grid.pp_rank]
        if self.quiet:
            self._check_tied_order()
        # each action's start and end on the device's timeline (CUDA events on CUDA)
        self.clock = DeviceClock(grid.device)
        self.timeline, self.step_started = [], None
        self.precision = precision or Precision("fp32", grid.device)
        # what crosses a stage boundary: the residual stream, which stays in the parameters'
        # dtype (fp32) under autocast too -- only matmul outputs are bf16/fp16, and the
        # residual adds promote them back; the receive buffers take this dtype, and a chunk
        # whose output had another would be cast to it (autograd casts its gradient back)
        self.wire_dtype = next(model.parameters()).dtype
        # the two ranks (first and last stage) holding the tied embedding, one pair for
        # each pipeline of the grid (every rank passes every pair, in the same order)
        if self.tie_across_ranks:
            axis = grid.ranks.dim() - 1  # pp moved last: pairs (first, last) of each pipeline
            ends = grid.ranks.movedim(DIMS.index("pp"), axis)[..., [self.ranks[0], self.ranks[-1]]]
            self.embedding_group = grid.group_of_lines(ends.reshape(-1, 2).tolist())
        else:
            self.embedding_group = None

    def chunk_units(self):
        """{chunk index: [canonical parameter-name prefixes it owns]} (for fsdp's units)."""
        return {c: plan.chunk_prefixes(ch.blocks, ch.first, ch.last) for c, ch in self.chunks.items()}

    # ------------------------------------------------ one chunk's compute

    def _forward(self, chunk, x, y, seam=None):
        """The chunk's output (its loss on the last chunk). seam: a list that, on the first
        chunk, receives (embedding output, the leaf the blocks start from): the split
        backward's B stops at that leaf, and W runs the embedding's backward after the
        blocks' weights (split_backward.py needs an input to split at)."""
        with self.precision.autocast():
            if chunk.first:
                x = self.model.embed(x)
                if seam is not None:
                    embedded, x = x, x.detach().requires_grad_()
                    seam += [embedded, x]
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
        device already: forward_backward.to_device, once per step). Returns
        the sum of the micro-batches' losses on the last stage (else 0).
        backward_scope(chunk, last) wraps each backward that accumulates into .grad (B,
        or W under a split schedule): `last` is the chunk's last of this pass
        (data-parallel sync hooks key on it)."""
        device = next(self.model.parameters()).device
        inputs, outputs = {}, {}
        seams = {}     # (chunk, micro-batch) -> (embedding output, blocks' input): split, first chunk
        deferred = {}  # (chunk, micro-batch) -> what its W needs (split_backward.py)
        ready = {}     # message -> tensor computed here, until its step sends it
        arriving = {}  # message -> (receive buffer, work to wait on before using it)
        local = {}     # message -> tensor from another chunk of this rank (zbv)
        sending = []   # (work, tensor): each tensor kept alive until its send is done
        loss_sum = torch.zeros((), device=device)
        if self.step_started is None:
            self.step_started = self.clock.mark()

        def take(msg):
            if msg in local:
                return local.pop(msg)
            buf, work = arriving.pop(msg)
            work.wait()
            return buf

        def hand_over(msg, chunk, tensor):
            """Give a result to the rank of `chunk`: in memory if it is this one."""
            (local if chunk in self.chunks else ready)[msg] = tensor

        for step in self.steps:
            if step.action is not None:
                kind, c, m = step.action
                chunk = self.chunks[c]
                x, y = micro_batches[m]
                started = self.clock.mark()
                if kind == "F":
                    inp = x if chunk.first else take(("act", c, m)).requires_grad_()
                    started = self.clock.mark()
                    seam = [] if self.split and chunk.first else None
                    out = self._forward(chunk, inp, y, seam)
                    if seam:
                        seams[c, m] = seam[0]
                        inp = seam[1]
                    inputs[c, m], outputs[c, m] = inp, out
                    if chunk.last:
                        loss_sum += out.detach()
                    else:
                        hand_over(("act", c + 1, m), c + 1, out.detach().contiguous())
                elif kind == "B":
                    grad = None if chunk.last else take(("grad", c, m))
                    started = self.clock.mark()
                    out, inp = outputs.pop((c, m)), inputs.pop((c, m))
                    if chunk.last:
                        out = out * scale
                    if self.split:  # the input's gradient now, the weights' at this chunk's W
                        inp_grad, deferred[c, m] = backward_input(out, grad, inp, self.chunk_params[c])
                        if chunk.first:
                            deferred[c, m].then = (seams.pop((c, m)), inp_grad)
                    else:
                        with backward_scope(c, m == self.M - 1):
                            out.backward(grad)
                        inp_grad = None if chunk.first else inp.grad
                    if not chunk.first:
                        hand_over(("grad", c - 1, m), c - 1, inp_grad.contiguous())
                else:  # W
                    with backward_scope(c, m == self.M - 1):
                        backward_weight(deferred.pop((c, m)), quiet=self.quiet.get(c, ()))
                self._record(kind, c, m, started)
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
        assert not deferred, f"W never ran for {sorted(deferred)}"  # a schedule without them
        return loss_sum

    def chunks_by_last_backward(self):
        """This rank's chunks in the order their last gradient-accumulating action of a
        pass runs (B, or W under a split schedule)."""
        kind = "W" if self.split else "B"
        last = {st.action[1]: i for i, st in enumerate(self.steps)
                if st.action and st.action[0] == kind}
        return sorted(last, key=last.get)

    def _check_tied_order(self):
        """zbv, rank 0: the embedding chunk's last W must come after the LM head's (see
        self.quiet): the tied weight's hooks then fire with all of its gradient in."""
        order = self.chunks_by_last_backward()
        first = next(c for c, ch in self.chunks.items() if ch.first)
        head = next(c for c, ch in self.chunks.items() if ch.last)
        if order.index(first) < order.index(head):
            raise RuntimeError(f"pipeline schedule {self.schedule}: the embedding chunk's last W "
                               "runs before the LM head's; the tied weight's gradient would be "
                               "synced before it is complete")

    def _record(self, kind, c, m, started):
        self.timeline.append((kind, c, m, started, self.clock.mark()))

    def stats(self, last=False, measure=True):
        """(figures for this step's metrics record, {file name: JSON-able} the main rank
        writes into the run directory): busy and idle time of every stage of this rank's
        pipeline in the step (idle: time inside the schedule not spent computing --
        waiting for a neighbour, the bubble), on every rank; on the last step also every
        stage's actions (kind, chunk, micro-batch, start ms, end ms). Then start the next
        step's record. One all-gather of every stage's table of actions (each stage runs
        the same number); not training traffic: uncounted. measure=False (a step nobody
        logs; every rank measures the same steps): forget the actions unread, as reading
        them would wait for the device."""
        if not measure:
            self.timeline, self.step_started = [], None
            return {}, {}
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
        return stats, {"pipeline_timeline.json": {"stages": timelines, "schedule": self.schedule,
                                                  "microbatches": self.M,
                                                  "virtual_stages": self.V}} if last else {}

    # ------------------------------------------------ loss and evaluation

    def last_stage_value(self, value):
        """Broadcast a scalar from the last stage to this rank's whole pipeline (not
        training traffic: uncounted)."""
        value = value.detach().clone().reshape(1)
        with self.comm.uncounted():
            self.comm.broadcast(value, src=self._peer(self.ranks[-1]), group=self.grid.pp_group)
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
                if not chunk.first and c - 1 not in self.chunks:  # else `act` is still here
                    act = torch.empty(self._activation_shape(x), device=device, dtype=self.wire_dtype)
                    for w in self.comm.exchange(recvs=[(act, self._peer(self.ranks[c - 1]))]):
                        w.wait()
                result = self._forward(chunk, x if chunk.first else act, y)
                if chunk.last:
                    out = result
                elif c + 1 in self.chunks:
                    act = result
                else:
                    for w in self.comm.exchange(sends=[(result.contiguous(), self._peer(self.ranks[c + 1]))]):
                        w.wait()
        return self.last_stage_value(out)
