"""Sharded snapshots: each rank writes what it owns, in parallel; nothing is pickled.

Layout under `trainer.snapshot_path` (a directory; any fsspec URL):

    latest.json                  -> {"step_dir": "step-00000120", "snapshot_id": ...}
    step-00000120/manifest.json  step, layout, config, GPT shape, tokenizer, wandb id,
                                 and an index: which bytes of which part hold which
                                 range of which canonical tensor
    step-00000120/part-00000.bin one per rank: a 256-byte JSON header, then raw tensors

A canonical tensor is a model parameter or an AdamW state in single-device
names and shapes ("model/transformer.wte.weight", "optim/<name>/exp_avg"),
seen flat; a rank writes the flat ranges it owns (a whole tensor for a
replicated strategy, its slice of a sharding unit for fsdp). Every range is
written by exactly one rank, so replicated state is written once.

Reading is by range: `SnapshotReader.read(key, start, length)` fetches only
the bytes it needs (ranged reads also work on object stores), so a rank
resuming under another layout reads its own shard without materialising
the rest.

Atomic: parts and manifest go into a fresh step directory; only then is
latest.json replaced (write to a temporary name, rename), and older step
directories are deleted. A kill at any moment leaves latest.json pointing at
a complete snapshot. Safe: JSON and raw bytes only, nothing executes on load.
"""

import json
import uuid

import fsspec
import torch
import torch.distributed as dist

from errors import UserError

FORMAT_VERSION = 2
HEADER_BYTES = 256
MAGIC = "mingpt-parallel-part"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64}


def _fs(path):
    return fsspec.core.url_to_fs(path)


def _join(root, name):
    return root.rstrip("/") + "/" + name


def snapshot_exists(path: str) -> bool:
    fs, root = _fs(path)
    return fs.exists(_join(root, "latest.json"))


# ---------------------------------------------------------------- writing

def save_sharded(path, grid, step, pieces, meta):
    """Collective. pieces: [(key, full_shape, flat_start, 1-D tensor)] this rank owns;
    meta: JSON-able facts for the manifest (config, tokenizer, ...). Every rank
    raises the same UserError if any rank fails, so nobody trains on past a
    snapshot that was not written."""
    fs, root = _fs(path)
    step_name = f"step-{step:08d}"
    step_dir = _join(root, step_name)

    def agree(error):
        if not grid.all_ok(error is None):
            raise UserError(f"could not write snapshot {path}: {error}" if error
                            else f"another rank could not write its part of snapshot {path}")

    error, ids = None, [uuid.uuid4().hex]
    if grid.is_main:
        try:
            if fs.exists(step_dir):  # left by a job killed while writing this very step
                fs.rm(step_dir, recursive=True)
            fs.makedirs(step_dir, exist_ok=True)
        except OSError as e:
            error = e
    agree(error)
    dist.broadcast_object_list(ids, src=0)  # one id ties parts to their manifest

    index = []
    try:
        index = _write_part(fs, step_dir, grid.rank, ids[0], pieces)
    except OSError as e:
        error = e
    agree(error)
    indexes = [None] * grid.world_size
    dist.all_gather_object(indexes, index)

    if grid.is_main:
        try:
            manifest = {"format_version": FORMAT_VERSION, "snapshot_id": ids[0], "step": step,
                        **meta, "parts": [e for part in indexes for e in part]}
            _write_json(fs, _join(step_dir, "manifest.json"), manifest)
            _write_json(fs, _join(root, "latest.json"),  # the commit point
                        {"step_dir": step_name, "snapshot_id": ids[0]}, atomic=True)
            for old in fs.glob(_join(root, "step-*")):
                if not old.rstrip("/").endswith(step_name):
                    fs.rm(old, recursive=True)
        except OSError as e:
            error = e
    agree(error)


def _write_part(fs, step_dir, rank, snapshot_id, pieces):
    name = f"part-{rank:05d}.bin"
    header = json.dumps({"magic": MAGIC, "format_version": FORMAT_VERSION,
                         "snapshot_id": snapshot_id, "rank": rank}).encode()
    assert len(header) < HEADER_BYTES
    index, offset = [], HEADER_BYTES
    with fs.open(_join(step_dir, name), "wb") as f:
        f.write(header.ljust(HEADER_BYTES, b" "))
        for key, shape, start, data in pieces:
            raw = data.detach().contiguous().cpu().view(-1)
            nbytes = raw.numel() * raw.element_size()
            f.write(raw.view(torch.uint8).numpy().tobytes())
            index.append({"key": key, "shape": list(shape), "start": start, "length": raw.numel(),
                          "dtype": str(raw.dtype).removeprefix("torch."), "file": name,
                          "offset": offset})
            offset += nbytes
    return index


def _write_json(fs, path, obj, atomic=False):
    target = f"{path}.tmp-{uuid.uuid4().hex[:8]}" if atomic else path
    with fs.open(target, "w") as f:
        json.dump(obj, f)
    if atomic:
        fs.mv(target, path)
        for stale in fs.glob(f"{path}.tmp-*"):  # left by a writer killed mid-write
            fs.rm(stale)


# ---------------------------------------------------------------- reading

class SnapshotReader:
    """A checked snapshot: `meta` (the manifest) and ranged reads of canonical tensors."""

    def __init__(self, path):
        self.path = path
        self.fs, root = _fs(path)
        latest = self._json(_join(root, "latest.json"))
        self.dir = _join(root, str(latest.get("step_dir")))
        self.meta = self._json(_join(self.dir, "manifest.json"))
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise UserError(f"snapshot {path} has format version {self.meta.get('format_version')!r}; "
                            f"this code reads version {FORMAT_VERSION}")
        if latest.get("snapshot_id") != self.meta.get("snapshot_id"):
            raise UserError(f"snapshot {path}: latest.json and {self.dir}/manifest.json disagree")
        self.index = {}
        sizes = {}
        for e in self.meta["parts"]:
            self.index.setdefault(e["key"], []).append(e)
            end = e["offset"] + e["length"] * DTYPES[e["dtype"]].itemsize
            sizes[e["file"]] = max(sizes.get(e["file"], HEADER_BYTES), end)
        for name, size in sizes.items():
            self._check_part(name, size)

    def _json(self, path):
        try:
            with self.fs.open(path, "r") as f:
                return json.load(f)
        except FileNotFoundError:
            raise UserError(f"snapshot {self.path}: {path} is missing") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"snapshot {self.path}: {path} is corrupt or truncated ({e})") from None

    def _check_part(self, name, size):
        path = _join(self.dir, name)
        try:
            actual = self.fs.size(path)
            with self.fs.open(path, "rb") as f:
                header = json.loads(f.read(HEADER_BYTES).decode())
        except FileNotFoundError:
            raise UserError(f"snapshot {self.path}: part {path} is missing") from None
        except (ValueError, UnicodeDecodeError):
            raise UserError(f"snapshot {self.path}: part {path} has no valid header") from None
        if header.get("magic") != MAGIC or header.get("format_version") != FORMAT_VERSION:
            raise UserError(f"snapshot {self.path}: part {path} was written by another version "
                            f"(format {header.get('format_version')!r}, expected {FORMAT_VERSION})")
        if header.get("snapshot_id") != self.meta["snapshot_id"]:
            raise UserError(f"snapshot {self.path}: part {path} belongs to another snapshot")
        if actual != size:
            raise UserError(f"snapshot {self.path}: part {path} is truncated or padded "
                            f"({actual} bytes, expected {size})")

    def keys(self):
        return self.index.keys()

    def shape(self, key):
        return tuple(self.index[key][0]["shape"])

    def read(self, key, start=0, length=None):
        """Elements [start, start + length) of the flattened canonical tensor `key`."""
        if key not in self.index:
            raise UserError(f"snapshot {self.path} has no {key!r}: it does not fit this model")
        entries = self.index[key]
        numel = 1
        for d in entries[0]["shape"]:
            numel *= d
        length = numel - start if length is None else length
        out = torch.empty(length, dtype=DTYPES[entries[0]["dtype"]])
        filled = 0
        for e in entries:
            lo, hi = max(start, e["start"]), min(start + length, e["start"] + e["length"])
            if lo >= hi:
                continue
            item = out.element_size()
            with self.fs.open(_join(self.dir, e["file"]), "rb") as f:
                f.seek(e["offset"] + (lo - e["start"]) * item)
                raw = f.read((hi - lo) * item)
            out[lo - start:hi - start] = torch.frombuffer(bytearray(raw), dtype=out.dtype)
            filled += hi - lo
        if filled != length:
            raise UserError(f"snapshot {self.path}: {key!r} is incomplete "
                            f"({filled} of {length} elements found)")
        return out

    def read_full(self, key):
        return self.read(key).view(self.shape(key))


def open_snapshot(path):
    """The snapshot at `path`, checked, or None if there is none."""
    return SnapshotReader(path) if snapshot_exists(path) else None


def check_model_shape(path: str, saved_gpt: dict, current_gpt: dict):
    """A snapshot fits only a model of the same shape; say which sizes differ."""
    keys = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "bias")
    diff = [f"{k}: snapshot {saved_gpt.get(k)!r} vs config {current_gpt.get(k)!r}"
            for k in keys if saved_gpt.get(k) != current_gpt.get(k)]
    if diff:
        raise UserError(f"snapshot {path} is from a model of another shape ({'; '.join(diff)}). "
                        "Match the config to it, or point trainer.snapshot_path elsewhere")
