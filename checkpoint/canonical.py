"""Canonical state: the single-device GPT's parameter names and full shapes, which
snapshots store and every layout reads and writes (so a snapshot written under
one layout resumes under another)."""

import torch

from errors import UserError


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


def optimizer_state_from(reader):
    """{name: {field: tensor}} from a snapshot's "optim/<name>/<field>" keys (full tensors)."""
    state = {}
    for key in reader.keys():
        if key.startswith("optim/"):
            name, field = key[len("optim/"):].rsplit("/", 1)
            state.setdefault(name, {})[field] = reader.read_full(key)
    return state


