"""Reading a sharded snapshot (the format: checkpoint/snapshot_format.py): opening checks
everything that can be checked without reading a tensor, then ranged reads by box, so a
rank resuming under another layout reads only its own shard; which snapshot a run
resumes from, and whether it fits the model."""

import json
import math

import torch

from checkpoint.boxes import (box_numel, box_shape, first_and_end, flat_range_boxes, from_jsonable,
                              intersect, shift, strides, whole)
from checkpoint.snapshot_dirs import (PART_FILE, STEP_DIR, checked_name, fs_and_root, join,
                                      kept_steps, snapshot_exists, step_dir_name)
from checkpoint.snapshot_format import DTYPES, HEADER_BYTES, MAGIC, READABLE_VERSIONS
from errors import UserError


class SnapshotReader:
    """A checked snapshot: `meta` (the manifest) and ranged reads of canonical tensors.

    Opening it checks everything that can be checked without reading the tensors:
    format versions, that every part exists with its header and exact size, and
    that each key's boxes tile the whole tensor once. So a damaged snapshot fails
    on every rank, before any training state is touched."""

    def __init__(self, path, step=-1):
        """step=-1: the snapshot latest.json names; else the kept one of that step."""
        self.path = path
        self.fs, root = fs_and_root(path)
        if step == -1:
            latest_path = join(root, "latest.json")
            latest = self._json(latest_path)
            name = checked_name(latest.get("step_dir"), STEP_DIR, "step-00000120", latest_path, path)
        else:
            latest, name = None, step_dir_name(step)
        self.dir = join(root, name)
        manifest = join(self.dir, "manifest.json")
        self.meta = self._json(manifest)
        self.version = self.meta.get("format_version")
        if self.version not in READABLE_VERSIONS:
            raise UserError(f"snapshot {path} has format version {self.version!r}; "
                            f"this code reads versions {', '.join(map(str, READABLE_VERSIONS))}")
        if latest is not None and latest.get("snapshot_id") != self.meta.get("snapshot_id"):
            raise UserError(f"snapshot {path}: latest.json and {manifest} disagree")
        if self.meta.get("step") != int(STEP_DIR.fullmatch(name).group(1)):
            raise UserError(f"snapshot {path}: {manifest} is of step {self.meta.get('step')!r}, "
                            f"not the step its directory {name} names")
        try:
            self.index, sizes = self._index(self.meta["parts"])
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"snapshot {path}: {manifest} is damaged ({type(e).__name__}: {e})") from None
        for name, size in sizes.items():
            self._check_part(name, size)

    def _entries(self, e):
        """A manifest entry as boxes: (key, shape, box, dtype, file, byte offset)."""
        shape, dtype = tuple(int(n) for n in e["shape"]), e["dtype"]
        if dtype not in DTYPES:
            raise ValueError(f"{e['key']} has unknown dtype {dtype!r}")
        if self.version >= 3:
            box = from_jsonable(e["box"])
            if len(box) != len(shape) or any(not 0 <= a < b <= n for (a, b), n in zip(box, shape)):
                raise ValueError(f"box {box} of {e['key']} is not inside its shape {shape}")
            return [(e["key"], shape, box, dtype, e["file"], e["offset"])]
        out, offset, item = [], e["offset"], DTYPES[dtype].itemsize  # version 2: a flat range
        if not 0 <= e["start"] < e["start"] + e["length"] <= math.prod(shape):
            raise ValueError(f"range of {e['key']} is not inside its shape {shape}")
        for box in flat_range_boxes(shape, e["start"], e["start"] + e["length"]):
            out.append((e["key"], shape, box, dtype, e["file"], offset))
            offset += box_numel(box) * item
        return out

    def _index(self, parts):
        """key -> its entries, checked to tile the whole tensor exactly once."""
        index, sizes = {}, {}
        for part in parts:
            for key, shape, box, dtype, file, offset in self._entries(part):
                index.setdefault(key, []).append((shape, box, dtype, file, offset))
                end = offset + box_numel(box) * DTYPES[dtype].itemsize
                sizes[file] = max(sizes.get(file, HEADER_BYTES), end)
        for key, entries in index.items():
            shape, _, dtype, _, _ = entries[0]
            if any(e[0] != shape or e[2] != dtype for e in entries):
                raise ValueError(f"the pieces of {key} disagree on shape or dtype")
            for i, a in enumerate(entries):
                for b in entries[i + 1:]:
                    if intersect(a[1], b[1]) is not None:
                        raise ValueError(f"the pieces of {key} overlap")
            covered = sum(box_numel(e[1]) for e in entries)
            if covered != math.prod(shape):
                raise ValueError(f"the pieces of {key} cover {covered} of {math.prod(shape)} elements")
        return index, sizes

    def _json(self, path):
        try:
            with self.fs.open(path, "r") as f:
                obj = json.load(f)
        except FileNotFoundError:
            raise UserError(f"snapshot {self.path}: {path} is missing") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"snapshot {self.path}: {path} is corrupt or truncated ({e})") from None
        if not isinstance(obj, dict):
            raise UserError(f"snapshot {self.path}: {path} is not a JSON object")
        return obj

    def _bytes(self, name, start, end):
        """One ranged read (no read-ahead: object stores fetch only these bytes)."""
        return self.fs.cat_file(join(self.dir, name), start=start, end=end)

    def _check_part(self, name, size):
        checked_name(name, PART_FILE, "part-00000.bin", join(self.dir, "manifest.json"), self.path)
        path = join(self.dir, name)
        try:
            actual = self.fs.size(path)
            header = json.loads(self._bytes(name, 0, HEADER_BYTES).decode())
        except FileNotFoundError:
            raise UserError(f"snapshot {self.path}: part {path} is missing") from None
        except (ValueError, UnicodeDecodeError):
            raise UserError(f"snapshot {self.path}: part {path} has no valid header") from None
        if not isinstance(header, dict) or header.get("magic") != MAGIC \
                or header.get("format_version") != self.version:
            found = header.get("format_version") if isinstance(header, dict) else None
            raise UserError(f"snapshot {self.path}: part {path} was written by another version "
                            f"(format {found!r}, expected {self.version})")
        if header.get("snapshot_id") != self.meta["snapshot_id"]:
            raise UserError(f"snapshot {self.path}: part {path} belongs to another snapshot")
        if actual != size:
            raise UserError(f"snapshot {self.path}: part {path} is truncated or padded "
                            f"({actual} bytes, expected {size})")

    def keys(self):
        return self.index.keys()

    def part_files(self):
        """Names of the part files that hold tensor data."""
        return {file for entries in self.index.values() for _, _, _, file, _ in entries}

    def shape(self, key):
        return self.index[key][0][0]

    def read_box(self, key, box):
        """The box `box` of canonical tensor `key`, as a tensor of the box's shape. Each
        stored piece it overlaps costs one ranged read: of exactly the overlap when that
        is contiguous in the piece, else of the span from its first to its last byte."""
        if key not in self.index:
            raise UserError(f"snapshot {self.path} has no {key!r}: it does not fit this model")
        entries = self.index[key]
        shape, dtype = entries[0][0], DTYPES[entries[0][2]]
        box = tuple(box)
        if len(box) != len(shape) or any(not 0 <= a < b <= n for (a, b), n in zip(box, shape)):
            raise UserError(f"snapshot {self.path}: {key!r} has shape {shape}, no box {box}")
        out = torch.empty(box_shape(box), dtype=dtype)
        item = out.element_size()
        for _, piece, _, file, offset in entries:  # they tile the tensor (checked on opening)
            common = intersect(box, piece)
            if common is None:
                continue
            piece_shape = box_shape(piece)
            first, end = first_and_end(piece_shape, shift(common, piece))
            raw = self._bytes(file, offset + first * item, offset + end * item)
            flat = torch.frombuffer(bytearray(raw), dtype=dtype)
            where = tuple(slice(a, b) for a, b in shift(common, box))
            out[where] = flat.as_strided(box_shape(common), strides(piece_shape))
        return out

    def read(self, key, start=0, length=None):
        """Elements [start, start + length) of the flattened canonical tensor `key`."""
        shape = self.shape(key) if key in self.index else ()
        numel = math.prod(shape)
        length = numel - start if length is None else length
        boxes = flat_range_boxes(shape, start, start + length)
        return torch.cat([self.read_box(key, b).reshape(-1) for b in boxes]) if boxes else \
            torch.empty(0)

    def read_full(self, key):
        if key not in self.index:
            raise UserError(f"snapshot {self.path} has no {key!r}: it does not fit this model")
        return self.read_box(key, whole(self.shape(key)))


def open_snapshot(path, step=-1):
    """The snapshot at `path`, checked, or None if there is none. step=-1: the newest
    (what latest.json names); else the kept snapshot of that step (trainer.resume_step),
    with an error naming the kept steps if there is none."""
    if step == -1:
        return SnapshotReader(path) if snapshot_exists(path) else None
    fs, root = fs_and_root(path)
    kept = kept_steps(fs, root) if fs.exists(root) else []
    if step not in kept:
        raise UserError(f"trainer.resume_step={step}: snapshot {path} keeps "
                        + (f"steps {', '.join(map(str, kept))}" if kept else "no snapshot")
                        + " (trainer.keep_snapshots says how many survive)")
    return SnapshotReader(path, step)


def step_to_resume(path, resume_step):
    """(step for open_snapshot, note or None). trainer.resume_step=S goes back to S once:
    if the newest snapshot was written by a run started with that same S and is past S
    (the command ran before: it was preempted and requeued, say), it continues from the
    newest instead of going back to S again and losing what was trained since."""
    if resume_step == -1 or not snapshot_exists(path):
        return resume_step, None
    try:
        newest = SnapshotReader(path).meta
        started_with = newest["config"]["trainer"].get("resume_step")
    except (UserError, KeyError, TypeError):
        return resume_step, None  # the newest is damaged: going back to S is the way out
    if started_with == resume_step and newest.get("step", -1) > resume_step:
        return -1, (f"note: trainer.resume_step={resume_step}: this run went back to step "
                    f"{resume_step} before and has written step {newest['step']} since; "
                    f"continuing from step {newest['step']}")
    fs, root = fs_and_root(path)
    newer = [s for s in kept_steps(fs, root) if s > resume_step]
    if newer:
        return resume_step, (f"note: going back to step {resume_step}; the newer snapshots (steps "
                             f"{', '.join(map(str, newer))}) are deleted when this run writes its "
                             "first snapshot")
    return resume_step, None


def check_model_shape(path: str, saved_gpt: dict, current_gpt: dict):
    """A snapshot fits only a model of the same shape; say which sizes differ."""
    keys = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "bias")
    diff = [f"{k}: snapshot {saved_gpt.get(k)!r} vs config {current_gpt.get(k)!r}"
            for k in keys if saved_gpt.get(k) != current_gpt.get(k)]
    if diff:
        raise UserError(f"snapshot {path} is from a model of another shape ({'; '.join(diff)}). "
                        "Match the config to it, or point trainer.snapshot_path elsewhere")
