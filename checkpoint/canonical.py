"""Canonical state: the single-device GPT's parameter names and full shapes, which
snapshots store and every layout reads and writes (so a snapshot written under
one layout resumes under another)."""

import torch

from errors import UserError


def check_state_names(expected: dict, state: dict, what: str):
    """Raise a UserError listing missing / unexpected / mis-shaped entries. expected: {name:
    a shape, or anything with a .shape}."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    want = {n: tuple(getattr(e, "shape", e)) for n, e in expected.items()}
    shapes = [f"{n}: {tuple(state[n].shape)} vs {want[n]}" for n in sorted(set(expected) & set(state))
              if tuple(state[n].shape) != want[n]]
    if missing or unexpected or shapes:
        parts = [f"missing {missing[:4]}" if missing else "",
                 f"unexpected {unexpected[:4]}" if unexpected else "",
                 f"shape mismatch {shapes[:4]}" if shapes else ""]
        raise UserError(f"{what} does not fit this model: " + "; ".join(p for p in parts if p))


@torch.no_grad()
def load_named_parameters(module, state, what="snapshot model state"):
    """Copy a canonical state dict into a full (unsharded) GPT; the rows a padded vocabulary
    adds (model.vocab_pad_to) become zeros."""
    shapes = module.canonical_shapes()
    check_state_names(shapes, state, what)
    for name, shape in shapes.items():
        module.get_parameter(name).zero_()[tuple(slice(0, n) for n in shape)] = state[name]


def optimizer_state_from(reader):
    """{name: {field: tensor}} from a snapshot's "optim/<name>/<field>" keys (full tensors)."""
    state = {}
    for key in reader.keys():
        if key.startswith("optim/"):
            name, field = key[len("optim/"):].rsplit("/", 1)
            state.setdefault(name, {})[field] = reader.read_full(key)
    return state


