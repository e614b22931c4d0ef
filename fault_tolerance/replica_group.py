"""One replica group's side of fault tolerance: quorum, sum across groups, commit.

Per step the trainer calls (as it calls one_group.OneGroup, the plain run's)

    step, shares = group.begin_step(step) # quorum (torchft Manager.start_quorum): who is
                                          # live; a group behind the others heals here
                                          # (started early: stepped, as a step ends)
    ... this group's shares of the global batch, reduced inside it by its strategy ...
    loss = group.sum_across(loss, strategy.grads())   # weighted sum over torchft's group
    if group.commit(): optimizer step     # torchft's vote: not if any group failed

A group that computed k of the R shares holds the mean over its k/R of the batch: scaled
by k/R and summed over the live groups, the gradients and the loss are the global batch's
mean, as one process would compute it. What crosses groups is one all-reduce of the
flattened gradients this rank holds (a shard, under fsdp) with the loss and, at the
group's ft.replica_id, a token of this start of the group appended (so every group learns
who took part, and tells a restarted group from the one it replaces).
"""

import logging
import os
import random
import threading
import time
from datetime import timedelta

import torch

from errors import UserError
from fault_tolerance import lighthouse, logs
from fault_tolerance.buckets import buckets, in_place, part
from fault_tolerance.one_group import OneGroup
from fault_tolerance.shares import shares_of
from fault_tolerance.state_transfer import (damage_in, differences, held_state,
                                            load_held_state, numbers_of, wait_for_device)


class QuorumLost(UserError):
    """No quorum within ft.timeout_s (the lighthouse gone, or too few groups): the trainer
    writes the last committed step's snapshot, then the run ends with this line."""


class ReplicaGroup:
    def __init__(self, ft, grid, strategy, run_dir, step, manager=None, numbers=None):
        """Waits for the lighthouse (at most ft.timeout_s), then starts torchft's Manager:
        this rank's end of the process group that spans the groups. step: where this
        group starts (a snapshot's step, or 0). manager: a stand-in for torchft's Manager
        (tests), called as manager(load_state_dict, state_dict) with this group's two state
        callbacks; None: torchft's. numbers: state_transfer.numbers_of(cfg), which a group
        that heals from this one must share."""
        self.ft, self.grid, self.strategy = ft, grid, strategy
        self.log = logs.to_file(run_dir, grid.rank)
        self.store = None
        self.healed_from = None
        self.sent = None            # a live group's state, received at the quorum (_load)
        self.quorum = None          # the next step's quorum, started early (stepped)
        self.vote = None            # the step's commit vote, started by sum_across
        self.quorum_rank = None  # this group's place in the last quorum (begin_step)
        self.numbers, self.refused = numbers, None  # numbers_of(cfg); a refusal (_load)
        self.manager = (manager or self._torchft_manager)(self._load, self._state)
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.live = None            # {ft.replica_id: start token} of the last committed step
        # tells this start of the group from an earlier one with the same ft.replica_id (a
        # group killed and started again between two steps is a leave and a join)
        self.token = random.SystemRandom().randrange(1, 2**20)  # exact in fp32 sums
        self.shares = []
        self.failed_at = None       # when the first uncommitted step of a failure started
        self.started = None
        self.uncommitted = 0        # steps not committed since the start, each redone
        self.events = {}            # figures for the next committed step's metrics record

    def _torchft_manager(self, load_state_dict, state_dict):
        ft, grid = self.ft, self.grid
        lighthouse.wait_for(ft.lighthouse, ft.timeout_s,
                            say=(lambda line: print(line, flush=True)) if grid.is_main else None)
        # torchft's Rust side logs every quorum to stderr: warnings only on the console (its
        # Python side's lines go to the run directory's file: logs.py); RUST_LOG overrides
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft.checkpointing import HTTPTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
        timeout = timedelta(seconds=ft.timeout_s)
        store = {}
        if "MASTER_ADDR" not in os.environ:  # plain `python main.py`: the group's store is ours
            self.store = torch.distributed.TCPStore("localhost", 0, is_master=True,
                                                    wait_for_workers=False)
            store = {"store_addr": "localhost", "store_port": self.store.port}
        pg = ProcessGroupNCCL(timeout) if grid.device.type == "cuda" else ProcessGroupGloo(timeout)
        # the live state goes to a joining group over HTTP; its server's access line per
        # request would land on the console: into torchft's log file instead
        transport = HTTPTransport(timeout=timeout, num_chunks=0)
        transport._server.RequestHandlerClass.log_message = \
            lambda _, fmt, *args: logging.getLogger("torchft").info(fmt % args)
        return Manager(
            pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=ft.min_replicas, use_async_quorum=False,  # heal before the forward
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=grid.rank, world_size=grid.world_size, lighthouse_addr=f"http://{ft.lighthouse}",
            replica_id=f"replica_{ft.replica_id}", init_sync=False,  # weights from the seed
            checkpoint_transport=transport, **store)

    # ------------------------------------------------------------------ the step

    replicas = property(lambda self: self.ft.replicas)  # the shares of a step's global batch

    def begin_step(self, step=None):
        """The quorum of the next step (started by stepped, or now). Returns (step,
        shares): the step to compute (the quorum's, not the trainer's `step`: a group that
        healed jumps to the live groups') and the shares this group computes."""
        self.started = time.perf_counter()
        early, self.quorum = self.quorum, None
        quorum = early or self._start_quorum()
        try:
            try:
                self._result(quorum)
            except Exception:
                if early is None or not lighthouse.answers(self.ft.lighthouse):
                    raise
                # asked as the step before ended, by a group stopped since (SIGSTOP, a paused
                # VM), the lighthouse still there: once more now (torchft re-raises a failed one)
                self.manager._quorum_future = None
                quorum = self._start_quorum()
                self._result(quorum)
        except Exception as e:  # the lighthouse gone, or no quorum within ft.timeout_s
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise QuorumLost(f"no quorum of replica groups from the lighthouse at ft.lighthouse="
                            f"{self.ft.lighthouse} within ft.timeout_s={self.ft.timeout_s:g} s "
                            f"({first}): is it running, with ft.min_replicas groups up?") from None
        if self.sent is not None:  # healing: the live state, taken here, before the forward
            sent, self.sent = self.sent, None
            self._take(sent)
        if self.refused:  # healing found another config: leave (the live groups redo the step)
            raise UserError(self.refused)
        if self.manager.errored():  # the quorum could not reconfigure the group: the step is
            self.shares = [0]           # computed on some share and voted down (commit)
            return self.manager.current_step(), self.shares
        rank, live = self.manager.participating_rank(), self.manager.num_participants()
        self.quorum_rank = rank  # kept: a lost quorum's manager raises when asked again
        if self.healed_from is not None:
            seconds = time.perf_counter() - quorum.started
            self._say(f"ft: group {self.ft.replica_id} healed from group {self.healed_from} at "
                      f"step {self.manager.current_step()} in {seconds:.2f} s (weights, optimizer "
                      "state, step; the data position and random state follow from the step)")
            self.events["ft_heal_s"] = seconds
            self.healed_from = None
        self.shares = shares_of(self.ft.replicas, rank, live)
        return self.manager.current_step(), self.shares

    def stepped(self, more):
        """This step is committed and the optimizer has stepped (compute_step): if `more`
        steps follow, the next step's quorum starts now, in the background, so that its
        round trips (to the group's torchft server, to the lighthouse) overlap the end of
        this step (the metrics record, evaluation, snapshot, read ahead, the stop signal's
        all-reduce) instead of starting the next; begin_step waits for it. A group that
        heals from this one is sent these weights, final now."""
        if more:
            self.quorum = self._start_quorum()

    def next_shares(self):
        """This step's shares: the next step's unless its quorum changes the groups, and
        then begin_step deals others (training/batches.py uses a read ahead only for the
        shares it was read for)."""
        return self.shares

    def _start_quorum(self):
        """torchft's start_quorum (it waits for the quorum and, healing, the live state), on
        a thread (begin_step waits for it)."""
        return self._background(self.manager.start_quorum, "ft-quorum")

    @staticmethod
    def _background(fn, name):
        """fn() on a thread, started now: its .started, and _result(thread) waits for it."""
        # the caller's accelerator: torchft's quorum and vote use the thread's current one
        on = torch.accelerator.is_available()
        device = torch.accelerator.current_device_index() if on else None

        def run():
            if device is not None:
                torch.accelerator.set_device_index(device)
            try:
                thread.result = fn()
            except Exception as e:
                thread.error = e
        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.result, thread.error, thread.started = None, None, time.perf_counter()
        thread.start()
        return thread

    @staticmethod
    def _result(thread):
        """What the thread's fn returned, once it ended; what it raised is raised here."""
        thread.join()
        if thread.error is not None:
            raise thread.error
        return thread.result

    def sum_across(self, loss, grads):
        """The global batch's loss and gradients from this group's (each the mean over its
        shares): scaled by shares/R, summed over the live groups, in place. The gradients
        cross in buckets of at most BUCKET_MB, each of one dtype (one buffer, reused, taken
        anew in the dtype of a bucket of another; a bucket that is one whole gradient on
        the device is reduced where it lies), the loss and the start tokens in fp32 only:
        in the last fp32 bucket, else apart. Beyond the gradients this holds at most one
        bucket, never a copy of them all. Then torchft's vote starts (commit)."""
        from torch.distributed import ReduceOp
        device = self.grid.device
        weight = len(self.shares) / self.ft.replicas
        # the loss and who took part, in fp32 (a token is exact below 2**24)
        figures = torch.zeros(1 + self.ft.replicas, dtype=torch.float32, device=device)
        figures[0] = loss.detach().to(device) * weight
        figures[1 + self.ft.replica_id] = self.token
        cap = max(1, min(int(BUCKET_MB * 2**20) // 4, sum(g.numel() for g in grads)))
        cut = list(buckets(grads, cap, device))
        # the figures ride with the last bucket that is copied anyway (one all-reduce fewer:
        # each is a round trip across groups), if it is fp32 (a token is exact below 2**24)
        rides = max((i for i, pieces in enumerate(cut) if not in_place(pieces[0], cap, device)
                     and pieces[0][0].dtype == torch.float32), default=None)
        bucket = None
        for i, pieces in enumerate(cut):
            if len(pieces) == 1 and in_place(pieces[0], cap, device):
                g = pieces[0][0]
                g.mul_(weight)
                self.manager.allreduce(g, reduce_op=ReduceOp.SUM).wait()
                continue
            parts = [part(p) for p in pieces]
            size = sum(t.numel() for t in parts)
            dtype = parts[0].dtype  # the bucket's every piece's (buckets())
            if bucket is None or bucket.dtype != dtype or bucket.numel() < size + figures.numel():
                bucket = None  # freed before the next is taken (> cap: non-contiguous)
                bucket = torch.empty(max(cap, size) + figures.numel(), dtype=dtype, device=device)
            at = 0
            for t in parts:
                bucket[at:at + t.numel()].view(t.shape).copy_(t)
                at += t.numel()
            bucket[:at].mul_(weight)
            if i == rides:
                bucket[at:at + figures.numel()].copy_(figures)
            self.manager.allreduce(bucket[:at + (figures.numel() if i == rides else 0)],
                                   reduce_op=ReduceOp.SUM).wait()
            if i == rides:
                figures.copy_(bucket[at:at + figures.numel()])
            at = 0
            for t in parts:
                t.copy_(bucket[at:at + t.numel()].view(t.shape))
                at += t.numel()
        if rides is None:
            self.manager.allreduce(figures, reduce_op=ReduceOp.SUM).wait()
        self._who = figures[1:]
        # the vote needs only the all-reduces done: its round trip to the group's torchft
        # server overlaps the gradient clip (its norm's own all-reduce) until commit()
        self.vote = self._background(self.manager.should_commit, "ft-vote")
        return figures[0]

    def commit(self):
        """torchft's vote: True if every rank of every live group finished the step (then
        step the optimizer); False: a group failed during it, the step is redone."""
        if self._result(self.vote):
            self._membership({i: int(n) for i, n in enumerate(self._who.round().tolist()) if n > 0})
            if self.failed_at is not None:
                self.events["ft_recovery_s"] = time.perf_counter() - self.failed_at
                self.failed_at = None
            return True
        self.uncommitted += 1
        if self.failed_at is None:
            self.failed_at = self.started
        error = self.manager.errored()
        why = str(getattr(error, "original_exception", error) or "a group failed").splitlines()[0]
        self._say(f"ft: step {self.manager.current_step() + 1} not committed ({why[:160]}); "
                  "redoing it with the next quorum")
        return False

    def figures(self):
        """(fields for the committed step's metrics record, whether something happened
        that the record must show): the live groups, steps redone so far, when it was
        committed, and once each the membership change, recovery and healing times."""
        out = {"ft_live_groups": len(self.live or ()), "ft_uncommitted_steps": self.uncommitted,
               "ft_committed_at": time.time(), **self.events}
        eventful, self.events = bool(self.events), {}
        return out, eventful

    def writes_snapshots(self):
        """Whether this group writes the step's snapshot: the first of the quorum does, so
        a trainer.snapshot_path shared by the groups has one writer."""
        return self.quorum_rank == 0

    def close(self):
        self.manager.shutdown(wait=False)
        logs.close_file(self.log)

    # ------------------------------------------------------------------ membership

    def _membership(self, live):
        """live: {ft.replica_id: start token} of the groups that committed this step."""
        if live == self.live:
            return
        step = self.manager.current_step()
        shares = f"{self.ft.replicas} shares of the batch over {len(live)} live group" + \
            ("s" if len(live) > 1 else "")
        if self.live is None:
            line = f"ft: group {self.ft.replica_id} in the quorum at step {step}: groups " \
                   f"{sorted(live)} live, " + shares
        else:
            left = sorted(i for i in self.live if live.get(i) != self.live[i])
            joined = sorted(i for i in live if self.live.get(i) != live[i])
            said = ([f"group{'s' if len(left) > 1 else ''} {left} left"] if left else []) + \
                ([f"group{'s' if len(joined) > 1 else ''} {joined} joined"] if joined else [])
            line = f"ft: {' and '.join(said)} at step {step}: " + shares
        self.events["ft_membership_changed"] = 1
        self.live = live
        self._say(line)

    def _say(self, line):
        if self.grid.is_main:
            print(line, flush=True)

    # ------------------------------------------------------------------ state transfer

    def _state(self):
        # torchft calls this on its own thread (and stream) when a group joins, at the start
        # of a step: the last optimizer step's kernels may still be queued on the device
        wait_for_device(self.grid.device)
        return held_state(self.strategy, self.manager.current_step(), self.ft.replica_id,
                          self.numbers)

    def _load(self, sent):
        """A live group's state, as the quorum receives it (on the quorum's thread, maybe
        while this group's step before is still ending): kept for begin_step's _take."""
        self.sent = sent

    def _take(self, sent):
        """The live state: taken only if its settings are this group's; else noted, and
        begin_step ends this group with one line. Taken only if every tensor every rank of
        this group received matches its checksum (each rank checks its own, then all
        agree, before any loads): else every rank stops with the line of one that found
        damage."""
        theirs = sent.get("numbers")
        differ = differences(self.numbers, theirs) if self.numbers and theirs else []
        if differ:
            self.refused = (f"replica group {self.ft.replica_id} does not match the live groups "
                            f"(group {sent['replica_id']}'s): {', '.join(differ)} differ, which "
                            "changes the numbers; it is refused: start it with their settings")
            return
        damage = damage_in(sent)
        line = self.grid.first_line(None if damage is None else (
            f"replica group {self.ft.replica_id} could not heal: the state rank {self.grid.rank} "
            f"received from group {sent.get('replica_id')} is damaged ({damage}); nothing was "
            "loaded: start this group again to heal from a live group anew"))
        if line is not None:
            raise UserError(line)
        load_held_state(self.strategy, sent)
        self.healed_from = sent["replica_id"]


# the most the sum across groups holds beyond the gradients (the bucket they cross in)
BUCKET_MB = 32


def start(cfg, grid, strategy, step):
    """This launch's replica group: a ReplicaGroup, or without ft.enabled a OneGroup."""
    if not cfg.ft.enabled:  # (what ft.enabled cannot run is refused with the config: config.refuse)
        return OneGroup()
    return ReplicaGroup(cfg.ft, grid, strategy, cfg.trainer.run_dir, step, numbers=numbers_of(cfg))
