"""The training state a live replica group sends to one that joins (torchft's healing).

Rank r of the joining group receives from rank r of a live one: the groups run the same
layout, so each rank holds the same parts of every parameter and of AdamW's state.
What it sends is what a snapshot would hold of this rank (weights, AdamW moments and
step, the fp16 loss scale, the trainer's step) but every part it holds, not only the
parts it would write (Region.writes leaves replicated copies to one writer). The data
position and the random state are functions of the step (trainer.py), so the step
carries them. The receiver loads it through the snapshot path (Strategy.load_shards),
so whatever a strategy does after a load (ZeRO-1/2's gather, offload's copy to the
device) happens here too. Each tensor travels with its CRC-32C (checkpoint/checksums.py),
taken by the sender; the receiver checks every one before it loads any (`damage_in`).
"""

import torch

from checkpoint.checksums import tensor_crc
from parallel.placement import OPTIM_FIELDS


@torch.no_grad()
def held_state(strategy, step, replica_id, numbers=None):
    """This rank's state as a dict of tensors and ints (copies: torchft serves it while
    this group computes the step)."""
    tensors = {}
    for r in strategy.regions():
        name = r.placement.name
        state = strategy.optimizer.state.get(r.opt_param, {})
        for box, idx in r.canonical_parts():
            where = box_key(box)
            tensors[f"model/{name}@{where}"] = r.values()[idx].cpu().clone()
            for field in OPTIM_FIELDS:
                if field in state:
                    tensors[f"optim/{name}/{field}@{where}"] = \
                        r.values(state[field])[idx].cpu().clone()
        if "step" in state:
            tensors[f"optim/{name}/step"] = state["step"].reshape(()).cpu().clone()
    return {"tensors": tensors, "crc32c": {key: tensor_crc(t) for key, t in tensors.items()},
            "step": step, "replica_id": replica_id,
            "precision": strategy.precision.state(), "numbers": numbers}


def damage_in(sent):
    """None if every tensor of a peer's held_state matches the checksum it was sent with,
    else what does not (the first tensor, by its canonical name and box)."""
    sums, tensors = sent.get("crc32c"), sent.get("tensors")
    if not isinstance(sums, dict) or not isinstance(tensors, dict):
        return "it holds no checksums"
    for key, t in tensors.items():
        if not torch.is_tensor(t) or sums.get(key) != tensor_crc(t.cpu()):
            name, _, box = key.partition("@")
            return f"tensor {name!r}{f' (box {box})' if box else ''} does not match its crc32c checksum"
    if set(sums) != set(tensors):
        return f"it lacks tensor {sorted(set(sums) - set(tensors))[0]!r}"
    return None


def numbers_of(cfg) -> dict:
    """The settings a step's numbers depend on, which every replica group must share: the
    model, the data's shape, the global batch and its cut, the schedule and optimizer, the
    precision, the layout inside a group (what a healing group loads must fit it). Not the
    ft keys (each group's own) nor where files go."""
    t = cfg.trainer
    return {"model": dict(vars(cfg.model)), "data.block_size": cfg.data.block_size,
            "data.tokenizer": cfg.data.tokenizer, "parallel": dict(vars(cfg.parallel)),
            **{f"trainer.{k}": getattr(t, k) for k in (
                "batch_size", "grad_accum", "lr", "min_lr", "warmup_steps", "max_steps",
                "weight_decay", "beta1", "beta2", "grad_clip", "seed", "precision")},
            **{f"trainer.{k}": getattr(t, k) for k in vars(t)  # the optimizer and its keys
               if k == "optimizer" or k.startswith("muon_")}}


def differences(mine, theirs) -> list:
    """The keys whose values differ between two numbers_of (nested: model.n_layer, ...)."""
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{k}" for k in differences(a, b)]
        elif a != b:
            out.append(key)
    return out


def wait_for_device(device):
    """Return once every kernel queued on `device` (on any stream) has run: held_state is
    read on torchft's thread, on a stream of its own, while this rank's last optimizer step
    may still be queued. Nothing to wait for on the CPU."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def load_held_state(strategy, sent):
    """Take a peer's held_state (same layout); returns its step."""
    strategy.load_shards(HeldStateReader(sent["tensors"]))
    strategy.precision.load_state(sent["precision"])
    return int(sent["step"])


def box_key(box):
    return ",".join(f"{a}:{b}" for a, b in box)


class HeldStateReader:
    """held_state's tensors, read as a snapshot is (read_box: Strategy.load_shards)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def keys(self):
        """The canonical keys it holds (a peer whose AdamW has not stepped sends none of
        its state: placement.load_regions then leaves none)."""
        return {key.partition("@")[0] for key in self.tensors}

    def read_box(self, key, box):
        found = self.tensors.get(key if key.endswith("/step") else f"{key}@{box_key(box)}")
        if found is None:
            raise RuntimeError(f"the peer's state has no {key} {box}: the replica groups must "
                               "run the same layout")
        return found
