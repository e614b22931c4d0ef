"""Snapshot files: atomic writes and safe reads through fsspec.

- Atomic: the bytes go to a temporary name beside the target and are then
  renamed over it, so a kill mid-write leaves the previous snapshot intact
  (on object stores a single PUT is atomic already).
- Safe: loaded with `torch.load(weights_only=True)`, which refuses to run
  pickled code; a snapshot holds only tensors, numbers, strings, lists and
  dicts.
- Any fsspec URL works (`s3://...`, `file://...`, a local path). `memory://`
  is private to one process, so multi-rank jobs need a shared filesystem or
  an object store.
"""

import io
import os
import uuid

import fsspec
import torch

from errors import UserError

FORMAT_VERSION = 1


def snapshot_exists(path: str) -> bool:
    fs, p = fsspec.core.url_to_fs(path)
    return fs.exists(p)


def save_snapshot(path: str, snapshot: dict):
    buf = io.BytesIO()
    torch.save({**snapshot, "format_version": FORMAT_VERSION}, buf)
    fs, p = fsspec.core.url_to_fs(path)
    parent = fs._parent(p)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = f"{p}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with fs.open(tmp, "wb") as f:
            f.write(buf.getbuffer())
            if hasattr(f, "flush"):
                f.flush()
            if hasattr(f, "fileno"):  # local file: make the bytes durable before the rename
                try:
                    os.fsync(f.fileno())
                except (OSError, io.UnsupportedOperation):
                    pass
        fs.mv(tmp, p)
        for stale in fs.glob(f"{p}.tmp-*"):  # left by a writer killed mid-write
            fs.rm(stale)
    finally:
        if fs.exists(tmp):
            fs.rm(tmp)


def load_snapshot(path: str) -> dict:
    """Read a snapshot; any problem becomes one UserError naming the file."""
    try:
        with fsspec.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise UserError(f"snapshot not found: {path}") from None
    except Exception as e:
        raise UserError(f"cannot read snapshot {path}: {e}") from None
    try:
        snapshot = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"snapshot {path} is corrupt or truncated ({len(raw)} bytes): {reason}. "
                        "Delete it or point trainer.snapshot_path elsewhere to start fresh") from None
    if not isinstance(snapshot, dict) or snapshot.get("format_version") != FORMAT_VERSION:
        found = snapshot.get("format_version") if isinstance(snapshot, dict) else type(snapshot).__name__
        raise UserError(f"snapshot {path} has format version {found!r}; "
                        f"this code reads version {FORMAT_VERSION}")
    return snapshot


def check_model_shape(path: str, saved_gpt: dict, current_gpt: dict):
    """A snapshot fits only a model of the same shape; say which sizes differ."""
    keys = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "bias")
    diff = [f"{k}: snapshot {saved_gpt.get(k)!r} vs config {current_gpt.get(k)!r}"
            for k in keys if saved_gpt.get(k) != current_gpt.get(k)]
    if diff:
        raise UserError(f"snapshot {path} is from a model of another shape ({'; '.join(diff)}). "
                        "Match the config to it, or point trainer.snapshot_path elsewhere")
