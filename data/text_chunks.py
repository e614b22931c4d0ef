"""UTF-8 text from fsspec paths, in chunks that tokenize exactly as the whole does.

`list_sources(spec)`: a file, a directory (every file below it that is not
hidden), or a glob, as [(url, size, version)] in sorted order (version: the
store's ETag or modification time, so a file edited in place is not taken for
the one an interrupted prepare began on). `plan_chunks` cuts each file at nominal
offsets k * chunk_bytes; `read_chunk` returns the text between the safe cut
at or after its start and the one at or after its end. The cut after a
nominal offset x depends only on the file's bytes near x, so the worker
reading chunk k and the one reading chunk k + 1 agree on their common edge
without talking, and every byte lands in exactly one chunk.

A safe cut is one where GPT-2's pre-tokenizer (the regex that splits text
into pieces before byte-pair merges; merges never cross pieces) starts a new
piece whatever comes before or after:

- before a space that sits between two printable ASCII characters ("a b":
  the letter run ends at the space, " b" starts a piece), or
- after a newline that sits between two printable ASCII characters ("a\\nB":
  the lone newline is a piece of its own, then "B" starts one).

Tokenizing the chunks separately then gives the tokens of the whole text
(tests/test_prepare.py checks it on text full of awkward spots). If no safe
cut exists within MAX_SEARCH bytes (a megabyte without a space or line
break), the cut falls on the next UTF-8 character boundary instead: exact
for `char`, possibly one BPE piece split in two for `gpt2`; prepare counts
these cuts (`inexact_cuts` in index.json).
"""

import re

import fsspec

from errors import UserError

CUT = re.compile(rb"(?<=[\x21-\x7e])(?= [\x21-\x7e])|(?<=[\x21-\x7e]\n)(?=[\x21-\x7e])")
FIRST_SEARCH, MAX_SEARCH = 1 << 16, 1 << 20


def list_sources(spec, exclude=None):
    """[(url, size, version)] of the text files `spec` names, sorted, leaving out hidden
    files under a directory and anything under `exclude` (prepare's own output, were it
    put inside its source directory); a UserError if none."""
    try:
        fs, root = fsspec.core.url_to_fs(spec)
        if any(c in root for c in "*?["):
            found = fs.glob(root, detail=True)
            found = {p: i for p, i in found.items() if i.get("type") == "file"}
        elif fs.isdir(root):
            found = {p: i for p, i in fs.find(root, detail=True).items()
                     if not any(part.startswith(".") for part in p[len(root):].split("/"))}
        elif fs.exists(root):
            found = {root: fs.info(root)}
        else:
            raise UserError(f"data file not found: {spec}")
    except UserError:
        raise
    except Exception as e:  # network, permissions, unknown protocol, ...
        raise UserError(f"cannot list data.path {spec}: {type(e).__name__}: {e}") from None
    if exclude:
        _, skip = fsspec.core.url_to_fs(exclude)
        skip = skip.rstrip("/")
        found = {p: i for p, i in found.items() if p != skip and not p.startswith(skip + "/")}
    if not found:
        raise UserError(f"data.path {spec} names no files")
    return [(fs.unstrip_protocol(p) if not isinstance(fs, _local()) else p, int(found[p]["size"]),
             _version(found[p])) for p in sorted(found)]


def _version(info):
    """What the store says identifies this content of the file: an ETag where there is
    one (s3, gcs, http), else the modification time; None if the store gives neither."""
    for key in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return None


def _local():
    from fsspec.implementations.local import LocalFileSystem
    return LocalFileSystem


def plan_chunks(sources, chunk_bytes):
    """[(source index, nominal start, nominal end)] covering every file."""
    return [(i, start, min(start + chunk_bytes, size))
            for i, (_, size) in enumerate(sources) for start in range(0, size, chunk_bytes)]


def safe_cut(fs, path, size, x):
    """(position, exact): the first safe cut at or after x (0 and size are cuts)."""
    if x <= 0 or x >= size:
        return min(max(x, 0), size), True
    lo, span = x - 2 if x >= 2 else 0, FIRST_SEARCH
    while True:
        hi = min(size, x + span)
        buf = fs.cat_file(path, start=lo, end=hi)
        found = CUT.search(buf, x - lo)
        if found:
            return lo + found.start(), True
        if hi == size:
            return size, True  # the rest of the file belongs to this chunk
        if span >= MAX_SEARCH:
            break
        span *= 4
    for i in range(x - lo, len(buf)):  # a UTF-8 character starts at a non-continuation byte
        if buf[i] & 0xC0 != 0x80:
            return lo + i, False
    return hi, False


def read_chunk(url, size, start, end):
    """(text, whether its end cut is exact) of the chunk with nominal range [start, end)
    (its start cut is the previous chunk's end cut)."""
    fs, path = fsspec.core.url_to_fs(url)
    (first, _), (last, exact) = safe_cut(fs, path, size, start), safe_cut(fs, path, size, end)
    raw = fs.cat_file(path, start=first, end=last) if last > first else b""
    try:
        return raw.decode("utf-8"), exact
    except UnicodeDecodeError as e:
        raise UserError(f"data file {url} is not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                        f"offset {first + e.start})") from None
