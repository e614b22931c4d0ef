"""Names under a snapshot path: which step directories exist, which survive, which are safe.

A snapshot path holds `latest.json` (the commit point) and one directory per
kept snapshot, `step-NNNNNNNN` (the step, zero-padded to at least 8 digits),
each with `manifest.json` and `part-NNNNN.bin` files. checkpoint/snapshot_writer.py writes
them and checkpoint/snapshot_reader.py reads them; this file only deals with their names:

- Names read back from `latest.json` and the manifest are data from
  elsewhere (snapshot directories get copied between machines and buckets):
  they must be plain names of the expected form, never a path that leaves the
  snapshot (`../../outside/step-00000004`, `/etc/x`, `a/b`).
- Retention (`trainer.keep_snapshots=K`): after a commit at step s, the K
  newest step directories up to s survive; a directory past s belongs to an
  abandoned run (one resumed with `trainer.resume_step` from an older step)
  and goes too, as do temporary files of writers killed mid-write.
"""

import re

import fsspec

from errors import UserError

# matched whole (fullmatch) and ASCII only: "step-00000004\n" or non-ASCII digits are no names
STEP_DIR = re.compile(r"step-(\d{8,})", re.ASCII)
PART_FILE = re.compile(r"part-\d{5,}\.bin", re.ASCII)
TEMP_FILE = re.compile(r"latest\.json\.tmp-.+", re.ASCII)


def fs_and_root(path):
    """(filesystem, path within it) for a snapshot path or URL (fsspec)."""
    return fsspec.core.url_to_fs(path)


def join(root, name):
    return root.rstrip("/") + "/" + name


def snapshot_exists(path: str) -> bool:
    fs, root = fs_and_root(path)
    return fs.exists(join(root, "latest.json"))


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def checked_name(value, pattern, example, where, path):
    """`value` if it is a plain name matching `pattern`, else one clear UserError."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise UserError(f"snapshot {path}: {where} names {value!r} where a plain name like "
                        f"{example} belongs: refused (names in a snapshot must not lead outside it)")
    return value


def _names(fs, root):
    return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False)]


def kept_steps(fs, root):
    """Steps of the complete snapshots under root (a step directory with a manifest),
    ascending. A directory without one is a write that never finished."""
    steps = []
    for name in _names(fs, root):
        m = STEP_DIR.fullmatch(name)
        if m and fs.exists(join(join(root, name), "manifest.json")):
            steps.append(int(m.group(1)))
    return sorted(steps)


def remove_stale(fs, root, step, keep):
    """After the commit at `step`: keep the `keep` newest complete snapshots up to `step`,
    remove the other step directories (older ones, unfinished writes, the ones past
    `step`) and leftover temporary files. Best effort: the snapshot is committed
    already, so a failure here only costs disk space."""
    try:
        names = _names(fs, root)
        complete = [s for s in kept_steps(fs, root) if s <= step]
        survivors = {step_dir_name(s) for s in complete[-keep:]} | {step_dir_name(step)}
        for name in names:
            if (STEP_DIR.fullmatch(name) and name not in survivors) or TEMP_FILE.fullmatch(name):
                fs.rm(join(root, name), recursive=True)
    except Exception as e:
        print(f"warning: could not remove old snapshot files under {root}: {e}", flush=True)
