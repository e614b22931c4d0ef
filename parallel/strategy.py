"""The interface between the trainer and every way of training across processes.

The trainer never asks which strategy it runs. Per optimizer step it calls

    loss = strategy.forward_backward(micro_batches)  # grads ready and synced
    norm = strategy.clip_grad_norm_(max_norm)         # global norm, across shards
    strategy.optimizer_step(lr)                       # update, then zero grads

and for evaluation and snapshots `eval_loss`, `shard_pieces` / `load_shards`
(each rank writes and reads only what it holds) and `state_dict`, all in
*canonical* form: the names and full shapes of the single-device model
(`GPT.named_parameters()`, which names the tied embedding/LM-head weight once
as `transformer.wte.weight`). That is what lets a snapshot written under one
layout resume under another.

The strategy, not the trainer, owns forward, backward and gradient sync of a
step, because tensor parallelism rewrites layers and pipeline parallelism
runs its own micro-batch schedule inside the step.

`ReplicatedStrategy` is the shared base for strategies where every rank
holds the whole model (single, torch_ddp, ddp_naive, ddp_bucket): they differ
only in how gradients get averaged.
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist

from errors import UserError
from parallel.comm import CommCounter


class Strategy:
    """One instance per rank. Subclasses implement every method below."""

    def __init__(self, model, grid, cfg):
        self.grid, self.cfg, self.device = grid, cfg, grid.device
        self.comm = CommCounter()  # training traffic goes through it, so it is counted
        self.last_state_bytes = 0  # set by optimizer_step, see state_bytes()

    def configure_optimizer(self, tcfg):
        raise NotImplementedError

    def forward_backward(self, micro_batches) -> float:
        """Forward and backward over this rank's micro-batches; gradients end up
        as if one process had run the whole global batch. Returns the mean
        loss over the global batch, on every rank."""
        raise NotImplementedError

    def eval_loss(self, x, y) -> float:
        """Mean loss over the global eval batch (x, y is this rank's share)."""
        raise NotImplementedError

    def clip_grad_norm_(self, max_norm) -> float:
        raise NotImplementedError

    def optimizer_step(self, lr):
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Canonical model parameters (CPU tensors, full shapes), complete at least on
        grid.is_main (for the sample printed after training). Collective."""
        raise NotImplementedError

    def shard_pieces(self) -> list:
        """What this rank writes into a sharded snapshot: [(canonical key, full shape,
        flat start, 1-D tensor)], keys "model/<name>" and "optim/<name>/<state>".
        Across ranks every element of every key is covered exactly once."""
        raise NotImplementedError

    def load_shards(self, reader):
        """Take what this rank holds from a snapshot.SnapshotReader (ranged reads
        of canonical keys), whatever layout wrote it."""
        raise NotImplementedError

    def comm_stats(self) -> dict:
        """Collective calls/bytes since the last call (see parallel/comm.py)."""
        return self.comm.pop()

    def state_bytes(self) -> int:
        """Bytes of parameters + gradients + optimizer state resident on this rank,
        measured at the end of the last optimizer step (before grads are freed)."""
        return self.last_state_bytes

    def dp_mean(self, value: torch.Tensor) -> float:
        """Average a scalar over the data-parallel group (losses, for logging;
        deliberately not counted as training traffic)."""
        value = value.detach().clone()
        if self.grid.dp_size > 1:
            dist.all_reduce(value, group=self.grid.dp_group)
            value /= self.grid.dp_size
        return value.item()


# ---------------------------------------------------------------- canonical helpers

def check_state_names(expected: dict, state: dict, what: str):
    """Raise a UserError listing missing / unexpected / mis-shaped entries."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{n}: {tuple(state[n].shape)} vs {tuple(expected[n].shape)}"
              for n in sorted(set(expected) & set(state))
              if tuple(state[n].shape) != tuple(expected[n].shape)]
    if missing or unexpected or shapes:
        parts = [f"missing {missing[:4]}" if missing else "",
                 f"unexpected {unexpected[:4]}" if unexpected else "",
                 f"shape mismatch {shapes[:4]}" if shapes else ""]
        raise UserError(f"{what} does not fit this model: " + "; ".join(p for p in parts if p))


@torch.no_grad()
def load_named_parameters(module, state, what="snapshot model state"):
    """Copy a canonical state dict into a full (unsharded) GPT."""
    params = dict(module.named_parameters())
    check_state_names(params, state, what)
    for name, p in params.items():
        p.copy_(state[name])


def keyed_tensors(model_state, optimizer_state):
    """Flat {snapshot key: tensor} of a canonical model + optimizer state."""
    out = {f"model/{name}": t for name, t in model_state.items()}
    for name, fields in optimizer_state["state"].items():
        for field, t in fields.items():
            out[f"optim/{name}/{field}"] = t
    return out


def optimizer_state_from(reader):
    """{name: {field: tensor}} from a snapshot's "optim/<name>/<field>" keys (full tensors)."""
    state = {}
    for key in reader.keys():
        if key.startswith("optim/"):
            name, field = key[len("optim/"):].rsplit("/", 1)
            state.setdefault(name, {})[field] = reader.read_full(key)
    return state


def resident_bytes(params, optimizer):
    """Parameters + their gradients + optimizer state tensors, in bytes (each tensor once)."""
    seen, total = set(), 0
    tensors = []
    for p in params:
        tensors += [p, p.grad]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def build_adamw(named_params: dict, groups, tcfg, **kwargs):
    """AdamW over `named_params`, grouped by name as GPT.optim_groups says."""
    return torch.optim.AdamW(
        [{**g, "params": [named_params[n] for n in g["params"] if n in named_params]}
         for g in groups],
        lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay, **kwargs)


def optimizer_state_by_name(optimizer, names_by_group):
    """torch's optimizer state_dict (params as ints) -> keyed by parameter name."""
    sd = optimizer.state_dict()
    state, groups = {}, []
    for group, names in zip(sd["param_groups"], names_by_group):
        for idx, name in zip(group["params"], names):
            if idx in sd["state"]:
                state[name] = {k: v.detach().cpu().clone() for k, v in sd["state"][idx].items()}
        groups.append({**group, "params": list(names)})
    return {"state": state, "param_groups": groups}


def optimizer_state_from_names(canonical, names_by_group, device):
    """Inverse of optimizer_state_by_name, for optimizer.load_state_dict."""
    state, groups, idx = {}, [], 0
    for group, names in zip(canonical["param_groups"], names_by_group):
        ids = []
        for name in names:
            if name in canonical["state"]:
                state[idx] = {k: v.to(device) if k != "step" else v
                              for k, v in canonical["state"][name].items()}
            ids.append(idx)
            idx += 1
        groups.append({**group, "params": ids})
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------- full replicas

class ReplicatedStrategy(Strategy):
    """Every rank holds the whole GPT; subclasses say how gradients are averaged.

    Hooks for subclasses: `self.model` is what forward runs through (the GPT
    or a wrapper), `no_sync(last)` is a context for each micro-step, and
    `sync_gradients()` runs once after the last backward.
    """

    def __init__(self, model, grid, cfg):
        super().__init__(model, grid, cfg)
        self.module = model.to(self.device)
        self.model = self.module

    def no_sync(self, last_micro_step):
        return nullcontext()

    def sync_gradients(self):
        pass

    def configure_optimizer(self, tcfg):
        self.named = dict(self.module.named_parameters())
        groups = self.module.optim_groups(tcfg.weight_decay)
        self.group_names = [g["params"] for g in groups]
        self.optimizer = build_adamw(self.named, groups, tcfg)

    def forward_backward(self, micro_batches):
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            with self.no_sync(i == len(micro_batches) - 1):
                _, loss = self.model(x.to(self.device), y.to(self.device))
                (loss / len(micro_batches)).backward()
            total += loss.detach()
        self.sync_gradients()
        return self.dp_mean(total / len(micro_batches))

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.module.eval()
        _, loss = self.module(x.to(self.device), y.to(self.device))
        self.module.train()
        return self.dp_mean(loss)

    def clip_grad_norm_(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm).item()

    def optimizer_step(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.last_state_bytes = resident_bytes(self.module.parameters(), self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self):
        return {n: p.detach().cpu().clone() for n, p in self.module.named_parameters()}

    def load_state_dict(self, state):
        load_named_parameters(self.module, state)

    def optimizer_state_dict(self):
        return optimizer_state_by_name(self.optimizer, self.group_names)

    def canonical_tensors(self):
        """{snapshot key: tensor} of parameters and AdamW state: views, no copies."""
        out = {f"model/{n}": p.detach() for n, p in self.named.items()}
        for n, p in self.named.items():
            for field, v in self.optimizer.state.get(p, {}).items():
                out[f"optim/{n}/{field}"] = v
        return out

    def shard_pieces(self):
        """Every rank holds everything: rank r writes every world-th key, so each
        tensor is written once and the writing is spread over all ranks."""
        tensors = self.canonical_tensors()
        mine = sorted(tensors)[self.grid.rank::self.grid.world_size]
        return [(k, tuple(tensors[k].shape), 0, tensors[k].reshape(-1)) for k in mine]

    def load_shards(self, reader):
        self.load_state_dict({n: reader.read_full(f"model/{n}") for n in self.named})
        state = optimizer_state_from(reader)
        groups = [{**g, "params": names}
                  for g, names in zip(self.optimizer.state_dict()["param_groups"], self.group_names)]
        self.load_optimizer_state_dict({"state": state, "param_groups": groups})

    def load_optimizer_state_dict(self, state):
        self.optimizer.load_state_dict(
            optimizer_state_from_names(state, self.group_names, self.device))
