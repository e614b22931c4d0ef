"""JSON objects on any fsspec filesystem: the manifests, indexes and markers that
snapshots (checkpoint/snapshot_writer.py) and prepared token shards (data/prepare.py)
write beside their binary parts."""

import json
import uuid


def read_json(fs, path):
    with fs.open(path, "r") as f:
        return json.load(f)


def write_json(fs, path, obj, atomic=False):
    """atomic: write a temporary name, then rename, so a reader sees the old file or
    the whole new one (the commit point of a snapshot or a prepared corpus)."""
    target = f"{path}.tmp-{uuid.uuid4().hex[:8]}" if atomic else path
    with fs.open(target, "w") as f:
        json.dump(obj, f)
    if atomic:
        fs.mv(target, path)
