"""`torch_tp`: PyTorch's DTensor tensor parallelism, kept as the reference for `parallel.tp`.

Not one of our strategies: it is what our TP is measured against (parity and
speed) in the same benchmark run, on the same model and layout. Pure TP only
(data-parallel degree 1), chosen as `parallel.dp=torch_tp parallel.tp=N`.

`parallelize_module` with the plan torchtitan uses for a GPT: ColwiseParallel
for c_attn and c_fc, RowwiseParallel for both c_proj, RowwiseParallel for the
token embedding (vocabulary rows, output all-reduced) and ColwiseParallel
with vocabulary-sharded output for the LM head, whose loss runs under
`loss_parallel()` (no rank holds the full logits). Two adaptations to our
model: its fused c_attn is [q | k | v], so its rows are permuted to
[q0 k0 v0 | q1 k1 v1 | ...] before sharding, making a contiguous column shard
hold whole heads (and permuted back for snapshots); and parallelize_module
replaces the embedding's weight, so the LM head is tied to it again after.

Its traffic goes through torch, so comm_* metrics do not count it.
Snapshots gather full canonical tensors (a reference, like torch_fsdp).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)

from parallel.replicated import ReplicatedStrategy
from parallel.strategy import check_state_names, optimizer_state_from


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def head_major_rows(n_embd, tp):
    """Row order of c_attn that puts each rank's q, k and v rows next to each other."""
    c = n_embd // tp
    return torch.cat([torch.arange(part * n_embd + r * c, part * n_embd + (r + 1) * c)
                      for r in range(tp) for part in range(3)])


class TorchTP(ReplicatedStrategy):
    own_tensor_parallel = False  # the model is parallelized by PyTorch instead

    def __init__(self, model, grid, cfg):
        super().__init__(model, grid, cfg)
        self.mesh = DeviceMesh.from_group(grid.tp_group, self.device.type)
        self.perm = head_major_rows(model.config.n_embd, grid.tp_size)
        self.unperm = torch.argsort(self.perm)
        with torch.no_grad():
            for block in self.module.transformer.h:
                block.attn.c_attn.weight.copy_(block.attn.c_attn.weight[self.perm])
                if block.attn.c_attn.bias is not None:
                    block.attn.c_attn.bias.copy_(block.attn.c_attn.bias[self.perm])
        plan = {"transformer.wte": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        for i in range(len(self.module.transformer.h)):
            plan.update({f"transformer.h.{i}.attn.c_attn": ColwiseParallel(),
                         f"transformer.h.{i}.attn.c_proj": RowwiseParallel(),
                         f"transformer.h.{i}.mlp.c_fc": ColwiseParallel(),
                         f"transformer.h.{i}.mlp.c_proj": RowwiseParallel()})
        parallelize_module(self.module, self.mesh, plan)
        self.module.lm_head.weight = self.module.transformer.wte.weight  # tie again

    def forward_backward(self, micro_batches):
        total = torch.zeros((), device=self.device)
        with loss_parallel():
            for x, y in micro_batches:
                _, loss = self.model(x.to(self.device), y.to(self.device))
                (loss / len(micro_batches)).backward()
                total += _full(loss).detach()
        return total.item() / len(micro_batches)

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.module.eval()
        try:
            with loss_parallel():
                _, loss = self.module(x.to(self.device), y.to(self.device))
        finally:
            self.module.train()
        return _full(loss).item()

    def optimizer_step(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t
        tensors = [local(t) for p in self.module.parameters() for t in (p, p.grad) if t is not None]
        tensors += [local(v) for s in self.optimizer.state.values() for v in s.values()
                    if torch.is_tensor(v)]
        self.last_state_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.optimizer.zero_grad(set_to_none=True)

    def clip_grad_norm_(self, max_norm):
        """Sharded gradients' squares summed over TP; replicated ones (plain tensors)
        counted once (torch's clip_grad_norm_ does not take DTensors and tensors mixed)."""
        sharded = torch.zeros((), device=self.device)
        replicated = torch.zeros((), device=self.device)
        for p in self.module.parameters():
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor):
                local = p.grad.to_local()
                if any(isinstance(pl, Shard) for pl in p.grad.placements):
                    sharded += local.pow(2).sum()
                else:
                    replicated += local.pow(2).sum()
            else:
                replicated += p.grad.pow(2).sum()
        dist.all_reduce(sharded, group=self.grid.tp_group)
        norm = (sharded + replicated).sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in self.module.parameters():
            if p.grad is not None:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(coef)
        return norm.item()

    # snapshots: full canonical tensors out (rank r writes every world-th key), shards in

    def _canonical(self, name, t):
        t = _full(t.detach()).cpu()
        return t[self.unperm] if name.endswith("attn.c_attn.weight") or \
            name.endswith("attn.c_attn.bias") else t

    def state_dict(self):
        return {n: self._canonical(n, p).clone() for n, p in self.module.named_parameters()}

    def shard_pieces(self):
        tensors = {f"model/{n}": t for n, t in self.state_dict().items()}
        for name, p in self.named.items():
            for field, v in self.optimizer.state.get(p, {}).items():
                tensors[f"optim/{name}/{field}"] = self._canonical(name, v) if field != "step" \
                    else v.cpu()
        mine = sorted(tensors)[self.grid.rank::self.grid.world_size]
        return [(k, tuple(tensors[k].shape), 0, tensors[k].reshape(-1)) for k in mine]

    def _local(self, name, full, like):
        if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
            full = full[self.perm]
        full = full.to(self.device)
        if isinstance(like, DTensor):
            return distribute_tensor(full, like.device_mesh, like.placements)
        return full

    @torch.no_grad()
    def load_shards(self, reader):
        params = self.named
        state = {n: reader.read_full(f"model/{n}") for n in params}
        check_state_names({n: self._canonical(n, p) for n, p in params.items()}, state,
                          "snapshot model state")
        for name, p in params.items():
            p.copy_(self._local(name, state[name], p))
        for name, fields in optimizer_state_from(reader).items():
            p = params[name]
            self.optimizer.state[p] = {k: v.reshape(()).clone() if k == "step" else
                                       self._local(name, v, p) for k, v in fields.items()}
