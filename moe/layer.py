"""`MoE`: the block's MLP replaced by a router and E experts, dropless: every token reaches
its k experts, however unevenly they are chosen.

forward, for the (B, T, C) input of one block:
  1. `enter`: identity here; tensor parallelism hands each TP rank its share of the
     tokens, so that no token is routed twice (parallel/expert_parallel/apply.py);
  2. the router (moe/router.py): each token's k experts and weights, the balance and
     z-losses;
  3. `exchange`: the tokens go to their experts and back (here `LocalExchange`: sorted by
     expert, one grouped product per layer; expert parallelism replaces it with an
     all-to-all to the ranks that hold the experts);
  4. each token's outputs summed with their weights, then `leave` (tensor parallelism:
     the TP ranks' shares gathered again);
  5. the losses join the backward through `AttachLoss`, which returns the output
     unchanged and gives the loss its gradient, `backward_scale` (what the step divides
     the main loss by and multiplies it with: micro-batches, the fp16 loss scale). A
     block then needs nothing from the model's head, and a pipeline stage's losses reach
     the backward on the stage that computed them.

Statistics for metrics.jsonl (`stats`): per training forward, the balance and z-losses
and the choices per expert, summed until `begin_step` clears them; a recompute
(activation checkpointing) runs inside backward and is not counted again.
"""

import torch
import torch.nn as nn
from torch.autograd import Function

from moe.experts import Experts
from moe.router import route


class MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        E, C = config.moe_experts, config.n_embd
        self.num_experts, self.top_k = E, config.moe_top_k
        self.renormalize = config.moe_renormalize
        self.balance_coef, self.z_coef = config.moe_aux_loss_coef, config.moe_z_loss_coef
        self.router = nn.Linear(C, E, bias=False)
        self.experts = Experts(E, C, config.moe_hidden or 4 * C, config.bias)
        self.dropout = nn.Dropout(config.dropout)
        # what the parallel dimensions replace (identity / one process here)
        self.enter = self.leave = _same
        self.exchange = LocalExchange()
        self.sum_counts, self.summed_ranks = None, 1
        self.choice_bias = None  # (E,) added to the scores for the choice only (router.py)
        self.backward_scale = 1.0
        self.begin_step()

    def begin_step(self, backward_scale=1.0):
        """A new optimizer step: statistics start again; the losses' gradient is
        `backward_scale` (the main loss's: 1 / micro-batches x the fp16 loss scale)."""
        self.backward_scale = backward_scale
        self.stats = {"balance": 0.0, "z": 0.0, "forwards": 0, "counts": 0}

    def forward(self, x):
        x = self.enter(x)
        B, T, C = x.shape
        with torch.autocast(x.device.type, enabled=False):  # the router in fp32
            logits = nn.functional.linear(x.float(), self.router.weight.float())
        r = route(logits.view(B, T, -1), self.top_k, self.renormalize, self.choice_bias,
                  sum_counts=self.sum_counts, summed_ranks=self.summed_ranks)
        tokens = x.reshape(B * T, C)
        out = self.exchange(tokens, r.experts, r.weights, r.counts, self.experts)
        loss = self.balance_coef * r.balance + self.z_coef * r.z
        if self.training and torch.is_grad_enabled():
            self.record(r)
            if self.balance_coef or self.z_coef:
                out = AttachLoss.apply(out, loss, self)
        return self.leave(self.dropout(out.view(B, T, C)))

    def before_compile(self):
        """Called by parallel/compile.py before this block is compiled: record() runs
        eagerly between the compiled pieces. Traced, its per-step counters (a Python int
        and float) would be guarded constants, a new graph for each micro-batch of a step,
        and past dynamo's limit of 8 (grad_accum or microbatches above 8) a failed run."""
        if not getattr(self.record, "_torchdynamo_disable", False):
            self.record = torch.compiler.disable(self.record)

    def record(self, r):
        if torch._C._current_graph_task_id() != -1:  # a recompute inside backward
            return
        s = self.stats
        s["balance"] += r.balance.detach()
        s["z"] += r.z.detach()
        s["counts"] = s["counts"] + r.counts
        s["forwards"] += 1


def _same(x):
    return x


class LocalExchange:
    """Every expert on this process: the N x k choices sorted by expert (stable: tokens
    in order within an expert), one grouped product per layer, the outputs weighted and
    summed back into their tokens."""

    def __call__(self, tokens, experts, weights, counts, module):
        order, rows = sort_by_expert(experts)
        y = module(tokens[rows], counts)
        return combine(y, order, rows, weights, tokens)


def sort_by_expert(experts):
    """(order of the flat N*k choices by expert, the token row of each) for (N, k) ids."""
    k = experts.size(1)
    order = torch.argsort(experts.reshape(-1), stable=True)
    return order, order // k


def combine(y, order, rows, weights, tokens):
    """Sum each token's k expert outputs y (in choice order `order`), times their weights."""
    w = weights.reshape(-1)[order].to(y.dtype).unsqueeze(1)
    out = torch.zeros(tokens.size(0), y.size(1), dtype=y.dtype, device=y.device)
    return out.index_add(0, rows, y * w)


class AttachLoss(Function):
    """Forward: `out` unchanged. Backward: `out`'s gradient, and `loss` the gradient
    `layer.backward_scale` (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out, loss, layer):
        ctx.layer = layer
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        scale = torch.full((), ctx.layer.backward_scale, device=grad.device)
        return grad, scale, None
