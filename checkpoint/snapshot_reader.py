"""Reading a sharded snapshot (the format: checkpoint/snapshot_format.py): opening checks
everything that can be checked without reading a tensor, then ranged reads by box, so a
rank resuming under another layout reads only its own shard; which snapshot a run
resumes from, and whether it fits the model. Every read is checked against the checksums
the writer recorded (checkpoint/checksums.py)."""

import contextlib
import json
import math

import torch
from fsspec.implementations.local import LocalFileSystem

from checkpoint.boxes import (box_numel, box_shape, first_and_end, flat_range_boxes, from_jsonable,
                              intersect, shift, strides, whole)
from checkpoint.snapshot_dirs import (PART_FILE, STEP_DIR, checked_name, fs_and_root, join,
                                      kept_steps, snapshot_exists, step_dir_name)
from checkpoint.checksums import ALGORITHM, CHUNK_BYTES, MANIFEST_KEY, crc, sealed_intact
from checkpoint.snapshot_format import (CHECKSUMMED_FROM, DTYPES, HEADER_BYTES, MAGIC,
                                        READABLE_VERSIONS)
from errors import UserError


class SnapshotReader:
    """A checked snapshot: `meta` (the manifest) and ranged reads of canonical tensors.

    Opening it checks everything that can be checked without reading the tensors:
    the manifest's own checksum, format versions, that every part exists with its
    header and exact size, and that each key's boxes tile the whole tensor once.
    So a damaged snapshot fails on every rank, before any training state is
    touched. Damage inside a tensor's bytes (the size unchanged) is found by the
    read of those bytes: each checksummed chunk a read touches is checked, and a
    mismatch is one UserError naming the part, the tensor and an older kept snapshot
    to go back to (`damage_found_later` collects it instead, for a load whose
    collectives must run on every rank)."""

    def __init__(self, path, step=-1, verify=True):
        """step=-1: the snapshot latest.json names; else the kept one of that step.
        verify=False: no checksum checked (the benchmark's baseline only)."""
        self.path, self.verify = path, verify
        self.defer, self.found = False, None  # damage_found_later
        self.fs, self.root = fs_and_root(path)
        root = self.root
        if step == -1:
            latest_path = join(root, "latest.json")
            latest = self._json(latest_path)
            name = checked_name(latest.get("step_dir"), STEP_DIR, "step-00000120", latest_path, path)
        else:
            latest, name = None, step_dir_name(step)
        self.dir = join(root, name)
        self.dir_step = int(STEP_DIR.fullmatch(name).group(1))
        manifest = join(self.dir, "manifest.json")
        self.meta = self._json(manifest, damaged=True)
        if verify:
            self._check_sealed(manifest)
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
            self.chunk_bytes = self._chunk_bytes()
            self.index, sizes = self._index(self.meta["parts"])
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"snapshot {path}: {manifest} is damaged ({type(e).__name__}: {e}); "
                            f"{self.recovery()}") from None
        for name, size in sizes.items():
            self._check_part(name, size)

    def _check_sealed(self, manifest):
        """The manifest's own checksum (format 4 on); formats 2 and 3 have none."""
        sealed, version = MANIFEST_KEY in self.meta, self.meta.get("format_version")
        if not sealed and not (isinstance(version, int) and version >= CHECKSUMMED_FROM):
            return  # an older format (or an unknown one: the version check says so)
        if sealed and sealed_intact(self.meta):
            return
        why = "its contents do not match its crc32c checksum" if sealed else "it has no checksum"
        raise UserError(f"snapshot {self.path}: manifest {manifest} is damaged ({why}); "
                        f"{self.recovery()}")

    def _chunk_bytes(self):
        """Bytes per checksum in the parts (format 4 on), or None: nothing to check."""
        if self.version < CHECKSUMMED_FROM or not self.verify:
            return None
        sums = self.meta["checksums"]
        if sums["algorithm"] != ALGORITHM or not isinstance(sums["chunk_bytes"], int) \
                or sums["chunk_bytes"] <= 0 or sums["chunk_bytes"] % 8:
            raise ValueError(f"checksums {sums!r}: this code checks {ALGORITHM} chunks")
        return sums["chunk_bytes"]

    def _entries(self, e):
        """A manifest entry as boxes: (key, shape, box, dtype, file, byte offset, its
        chunks' checksums or None)."""
        shape, dtype = tuple(int(n) for n in e["shape"]), e["dtype"]
        if dtype not in DTYPES:
            raise ValueError(f"{e['key']} has unknown dtype {dtype!r}")
        if self.version >= 3:
            box = from_jsonable(e["box"])
            if len(box) != len(shape) or any(not 0 <= a < b <= n for (a, b), n in zip(box, shape)):
                raise ValueError(f"box {box} of {e['key']} is not inside its shape {shape}")
            sums = None
            if self.chunk_bytes is not None:
                sums = e["crc32c"]
                nbytes = box_numel(box) * DTYPES[dtype].itemsize
                if not isinstance(sums, list) or len(sums) != -(-nbytes // self.chunk_bytes):
                    raise ValueError(f"the checksums of {e['key']} do not cover its {nbytes} bytes")
            return [(e["key"], shape, box, dtype, e["file"], e["offset"], sums)]
        out, offset, item = [], e["offset"], DTYPES[dtype].itemsize  # version 2: a flat range
        if not 0 <= e["start"] < e["start"] + e["length"] <= math.prod(shape):
            raise ValueError(f"range of {e['key']} is not inside its shape {shape}")
        for box in flat_range_boxes(shape, e["start"], e["start"] + e["length"]):
            out.append((e["key"], shape, box, dtype, e["file"], offset, None))
            offset += box_numel(box) * item
        return out

    def _index(self, parts):
        """key -> its entries, checked to tile the whole tensor exactly once."""
        index, sizes = {}, {}
        for part in parts:
            for key, shape, box, dtype, file, offset, sums in self._entries(part):
                index.setdefault(key, []).append((shape, box, dtype, file, offset, sums))
                end = offset + box_numel(box) * DTYPES[dtype].itemsize
                sizes[file] = max(sizes.get(file, HEADER_BYTES), end)
        for key, entries in index.items():
            shape, _, dtype = entries[0][:3]
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

    def _json(self, path, damaged=False):
        """damaged: a file of this step (the manifest), so unreadable JSON says which older
        snapshot to go back to."""
        try:
            with self.fs.open(path, "r") as f:
                obj = json.load(f)
        except FileNotFoundError:
            raise UserError(f"snapshot {self.path}: {path} is missing") from None
        except (ValueError, UnicodeDecodeError) as e:
            hint = f"; {self.recovery()}" if damaged else ""
            raise UserError(f"snapshot {self.path}: {path} is corrupt or truncated ({e}){hint}") from None
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

    def recovery(self):
        """What to do about damage in this snapshot: the newest kept snapshot before it."""
        try:
            older = [s for s in kept_steps(self.fs, self.root) if s < self.dir_step]
        except Exception:  # listing failed too: say what can be said
            older = []
        if older:
            before = f" (kept before it: steps {', '.join(map(str, older[:-1]))})" if older[:-1] else ""
            return f"go back to the older kept snapshot with trainer.resume_step={older[-1]}{before}"
        return ("no older snapshot is kept to go back to (trainer.keep_snapshots keeps more): "
                "restore this one from a copy, or start afresh with a new trainer.snapshot_path")

    @contextlib.contextmanager
    def damage_found_later(self):
        """Inside it, damage a read finds goes to `found` (the first line) and the read
        returns the damaged values, so a load whose strategy runs collectives between its
        reads (fsdp's gathers) runs them on every rank; the caller agrees and raises."""
        self.defer, self.found = True, None
        try:
            yield self
        finally:
            self.defer = False

    def _damaged(self, key, file, start, end, why="does not match its crc32c checksum"):
        line = (f"snapshot {self.path}: part {join(self.dir, file)} is damaged: tensor {key!r} "
                f"(bytes {start}-{end} of the part) {why}; {self.recovery()}")
        if not self.defer:
            raise UserError(line)
        self.found = self.found or line

    def _read_piece(self, key, file, offset, nbytes, sums, start, end):
        """Bytes [start, end) of a stored piece (offset: its first byte in `file`, nbytes
        its size), as (a buffer, where they begin in it). Checked (a checksummed piece,
        verify): the read widens to the chunks it touches, and each chunk's checksum is
        taken right after it was read, while it is in the cache. A local part is read
        straight into the buffer, a chunk at a time; others in one ranged read."""
        size = self.chunk_bytes or CHUNK_BYTES
        check = sums is not None and self.verify
        lo, hi = (start // size * size, min(-(-end // size) * size, nbytes)) if check else (start, end)
        out = bytearray(hi - lo)
        view = memoryview(out)
        if isinstance(self.fs, LocalFileSystem):
            with self.fs.open(join(self.dir, file), "rb") as f:
                f.seek(offset + lo)
                got = 0
                for at in range(0, hi - lo, size):
                    stop = min(at + size, hi - lo)
                    got += f.readinto(view[at:stop])
                    if check and crc(view[at:stop]) != sums[(lo + at) // size]:
                        self._damaged(key, file, offset + lo + at, offset + lo + stop)
        else:
            data = self._bytes(file, offset + lo, offset + hi)
            got = len(data)
            view[:got] = data
            for at in range(0, got if check else 0, size):
                stop = min(at + size, hi - lo)
                if crc(view[at:stop]) != sums[(lo + at) // size]:
                    self._damaged(key, file, offset + lo + at, offset + lo + stop)
        if got != hi - lo:  # the part shrank since it was opened
            self._damaged(key, file, offset + lo, offset + hi, "is cut short")
        return out, start - lo

    def keys(self):
        return self.index.keys()

    def part_files(self):
        """Names of the part files that hold tensor data."""
        return {e[3] for entries in self.index.values() for e in entries}

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
        for _, piece, _, file, offset, sums in entries:  # they tile the tensor (checked on opening)
            common = intersect(box, piece)
            if common is None:
                continue
            piece_shape = box_shape(piece)
            first, end = first_and_end(piece_shape, shift(common, piece))
            raw, skip = self._read_piece(key, file, offset, box_numel(piece) * item, sums,
                                         first * item, end * item)
            flat = torch.frombuffer(raw, dtype=dtype, offset=skip, count=end - first)
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
