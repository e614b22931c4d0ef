"""Writing a sharded snapshot (the format: checkpoint/snapshot_format.py): every rank
its part file, then the main rank the manifest and latest.json, the commit point;
every rank fails alike if any rank could not write. checkpoint/async_snapshot.py runs
the same three steps in the background."""

import json
import uuid

import torch
import torch.distributed as dist

from checkpoint.boxes import as_jsonable, box_numel, flat_range_boxes
from checkpoint.checksums import ALGORITHM, CHUNK_BYTES, seal, write_chunks
from checkpoint.snapshot_dirs import fs_and_root, join, kept_steps, remove_stale, step_dir_name
from checkpoint.snapshot_format import DTYPES, FORMAT_VERSION, HEADER_BYTES, MAGIC
from data.fs_json import read_json, write_json
from errors import UserError


def save_sharded(path, grid, step, pieces, meta, keep=1):
    """Collective. pieces: [(key, full_shape, box, tensor of the box's shape)] this rank
    owns (an int instead of a box: a flat start, the tensor 1-D); meta: JSON-able facts
    for the manifest (config, tokenizer, ...); keep: how many snapshots survive
    (trainer.keep_snapshots). Every rank
    raises the same UserError if any rank fails, so nobody trains on past a
    snapshot that was not written."""
    fs, root = fs_and_root(path)

    def agree(error):
        if not grid.all_ok(error is None):
            raise UserError(f"could not write snapshot {path}: {error}" if error
                            else f"another rank could not write its part of snapshot {path}")

    # any exception (s3 credentials, a read-only filesystem, ...) must reach agree(),
    # or the other ranks would wait for this one in all_ok
    error, ids = None, [uuid.uuid4().hex]
    if grid.is_main:
        try:
            prepare_step_dir(path, step)
        except Exception as e:
            error = e
    agree(error)
    # one id ties parts to their manifest; objects travel in host memory (grid.host_group)
    dist.broadcast_object_list(ids, src=0, group=grid.host_group)

    index = []
    try:
        index = write_part(path, step, grid.rank, ids[0], pieces)
    except Exception as e:
        error = e
    agree(error)
    indexes = [None] * grid.world_size
    dist.all_gather_object(indexes, index, group=grid.host_group)

    if grid.is_main:
        try:
            commit(path, step, ids[0], meta, indexes)
        except Exception as e:
            error = e
    agree(error)
    if grid.is_main:
        remove_stale(fs, root, step, keep)


def prepare_step_dir(path, step):
    """Main rank, before any part is written: an empty directory for `step`."""
    fs, root = fs_and_root(path)
    step_name = step_dir_name(step)
    step_dir = join(root, step_name)
    if fs.exists(step_dir):  # a write killed at this very step, or a kept snapshot
        _step_back_from(fs, root, step_name)  # past the step a run resumed from
        fs.rm(step_dir, recursive=True)
    fs.makedirs(step_dir, exist_ok=True)


def write_part(path, step, rank, snapshot_id, pieces, checksums=True):
    """This rank's part file of `step`; returns its index entries (for the manifest), each
    with its bytes' checksums (checkpoint/checksums.py; checksums=False: none, the
    benchmark's baseline, bench.snapshot_checksum)."""
    fs, root = fs_and_root(path)
    return _write_part(fs, join(root, step_dir_name(step)), rank, snapshot_id, pieces, checksums)


def commit(path, step, snapshot_id, meta, indexes):
    """Main rank, once every part of `step` is written: the manifest, then latest.json
    (the commit point, replaced atomically). indexes: every rank's write_part result."""
    fs, root = fs_and_root(path)
    step_name = step_dir_name(step)
    manifest = {"format_version": FORMAT_VERSION, "snapshot_id": snapshot_id, "step": step,
                **meta, "checksums": {"algorithm": ALGORITHM, "chunk_bytes": CHUNK_BYTES},
                "parts": [e for part in indexes for e in part]}
    # sealed: the manifest carries the checksum of its own contents
    write_json(fs, join(join(root, step_name), "manifest.json"), seal(manifest))
    write_json(fs, join(root, "latest.json"), {"step_dir": step_name, "snapshot_id": snapshot_id},
               atomic=True)


def _step_back_from(fs, root, step_name):
    """Before `step_name` is removed to be written again: if latest.json names it (a run
    resumed from an older kept snapshot, trainer.resume_step, and reached this step
    again), point latest.json at the newest complete snapshot before it first, so no
    moment leaves the commit point naming a directory that is gone."""
    latest = join(root, "latest.json")
    if not fs.exists(latest) or read_json(fs, latest).get("step_dir") != step_name:
        return
    older = [s for s in kept_steps(fs, root) if step_dir_name(s) < step_name]
    if older:
        name = step_dir_name(older[-1])
        manifest = read_json(fs, join(join(root, name), "manifest.json"))
        write_json(fs, latest, {"step_dir": name, "snapshot_id": manifest["snapshot_id"]},
                    atomic=True)


def _write_part(fs, step_dir, rank, snapshot_id, pieces, checksums=True):
    name = f"part-{rank:05d}.bin"
    header = json.dumps({"magic": MAGIC, "format_version": FORMAT_VERSION,
                         "snapshot_id": snapshot_id, "rank": rank}).encode()
    assert len(header) < HEADER_BYTES
    index, offset = [], HEADER_BYTES
    with fs.open(join(step_dir, name), "wb") as f:
        f.write(header.ljust(HEADER_BYTES, b" "))
        for key, shape, box, data in _as_boxes(pieces):
            raw = data.detach().contiguous().cpu().view(-1)
            assert raw.numel() == box_numel(box), f"{key}: {raw.numel()} elements for box {box}"
            dtype = str(raw.dtype).removeprefix("torch.")
            assert dtype in DTYPES, f"{key}: dtype {dtype} has no snapshot encoding"
            nbytes = raw.numel() * raw.element_size()
            # the tensor's own bytes (buffer protocol), not a bytes copy: a copy doubled the
            # write's memory traffic and CPU time (bench.snapshot_async), paid by every rank
            data = memoryview(raw.view(torch.uint8).numpy())
            entry = {"key": key, "shape": list(shape), "box": as_jsonable(box),
                     "dtype": dtype, "file": name, "offset": offset}
            sums = write_chunks(f, data, summed=checksums)
            if sums is not None:
                entry["crc32c"] = sums
            index.append(entry)
            offset += nbytes
    return index


def _as_boxes(pieces):
    """Pieces given as (key, shape, flat start, 1-D tensor) become boxes."""
    for key, shape, where, data in pieces:
        if isinstance(where, int):
            flat, at = data.reshape(-1), 0
            for box in flat_range_boxes(tuple(shape), where, where + flat.numel()):
                n = box_numel(box)
                yield key, shape, box, flat[at:at + n]
                at += n
        else:
            yield key, shape, tuple(where), data
