"""The router: which k experts each token goes to, with which weights, and the losses that
keep the experts evenly loaded.

- Scores: softmax over the experts of a linear map of the token, in fp32 whatever the
  autocast (a bf16 softmax over many experts flips close choices from run to run).
- Choice: the top k of softmax + `bias` (DeepSeek-V3's auxiliary-loss-free balancing:
  the bias moves choices only, never the weights); the weights are the chosen softmax
  probabilities, renormalized to sum to 1 by default (`model.moe_renormalize`: Mixtral's
  and DeepSeek-V3's choice; the block's output then has the scale of one expert's,
  whatever k), or left as they are (GShard/Switch).
- Balance loss (Switch/GShard), computed per sequence and averaged over sequences
  (DeepSeek-V3's sequence-wise form): E x sum_e f_e P_e, with f_e the share of the
  sequence's k x T choices that went to expert e and P_e its mean probability over the
  sequence's tokens; 1.0 when perfectly balanced. Per sequence, so that it does not depend
  on how a batch is cut into micro-batches or data-parallel ranks; a sequence cut across
  ranks (context parallelism, tensor parallelism's token split) sums its counts over them
  (`sum_counts`), and each rank's share of P_e is normalized so the ranks' losses combine
  as their gradients do (see `balance_loss`).
- z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2, which keeps logits small.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Routes:
    experts: torch.Tensor   # (N, k) long: each token's chosen experts
    weights: torch.Tensor   # (N, k) fp32: what each choice's output is multiplied by
    counts: torch.Tensor    # (E,) long: choices per expert among these N tokens
    balance: torch.Tensor   # 0-d: the balance loss (this rank's share)
    z: torch.Tensor         # 0-d: the z-loss (this rank's share)


def route(logits, top_k, renormalize, bias=None, sum_counts=None, summed_ranks=1):
    """logits: (B, T, E) router outputs for B sequences of T tokens (this rank's part of
    each). sum_counts: counts (B, E) -> their sum over the ranks holding other parts of
    the same sequences (None: this rank holds whole sequences). summed_ranks: how many
    of those ranks' gradients are summed rather than averaged (tensor parallelism's token
    split: tp; context parallelism's ranks are averaged like data-parallel ones)."""
    B, T, E = logits.shape
    logits = logits.float()
    probs = F.softmax(logits, dim=-1)
    choice = probs if bias is None else probs + bias
    experts = torch.topk(choice, top_k, dim=-1).indices             # (B, T, k)
    weights = probs.gather(-1, experts)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    with torch.no_grad():
        per_sequence = torch.zeros(B, E, device=logits.device, dtype=torch.float32)
        per_sequence.scatter_add_(1, experts.reshape(B, -1),
                                  torch.ones(B, T * top_k, device=logits.device))
        local_counts = per_sequence.sum(0).long()
        if sum_counts is not None:
            per_sequence = sum_counts(per_sequence)
    balance = balance_loss(per_sequence, probs, top_k, summed_ranks)
    z = torch.logsumexp(logits, dim=-1).square().sum() / (B * T * summed_ranks)
    return Routes(experts.reshape(-1, top_k), weights.reshape(-1, top_k), local_counts, balance, z)


def balance_loss(per_sequence, probs, top_k, summed_ranks=1):
    """E x sum_e f_e P_e averaged over sequences. per_sequence: (B, E) choices per expert
    of each whole sequence (over every rank holding part of it); probs: (B, T, E) of this
    rank's T tokens of each. P_e is this rank's sum over its tokens divided by the tokens
    of the sequence that `summed_ranks` ranks hold together (T x summed_ranks): summed over
    tensor-parallel ranks and averaged over context-parallel ones, as their gradients are,
    the ranks' losses give the whole sequence's."""
    B, T, E = probs.shape
    tokens = per_sequence.sum(-1, keepdim=True)                      # k x the sequence's tokens
    f = per_sequence / tokens
    P = probs.sum(1) / (T * summed_ranks)
    return E * (f * P).sum(-1).mean()
