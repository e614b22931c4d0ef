"""A prepared token corpus (mode=prepare, data/prepare.py), read in place: windows, not files.

Layout of `data.tokens_path` (a directory; any fsspec URL):

    index.json        written last, so its presence means "complete": format,
                      tokenizer state, vocab_size, dtype, the shards in order
                      ({file, tokens, max_token}), the train/val split
    shard-00000.bin   raw little-endian token ids in the smallest unsigned
                      dtype that holds the vocabulary (uint8/16/32), no header
    shard-00000.json  prepare's "this shard is done" marker; plan.json: its plan

The corpus is the shards concatenated in index order. The first
`split.train_tokens` tokens train, the rest validate; a window may straddle
two shards. Nothing is loaded up front: a local shard is memory-mapped
(the OS pages in only what a window touches, and the pages are let go of
after each read: `_unmap_pages`), a remote one is read by ranged requests
(`fs.cat_ranges`, concurrent on object stores), so a rank holds the windows
of its own micro-batches and nothing else.

Checked on opening, on every rank, each failure one UserError: index.json
present and of this format; every shard listed exists with exactly
tokens x itemsize bytes (a truncated shard, or an index of other shards);
no shard file the index does not list; recorded token ids below the
vocabulary. Each window read is checked too (ids past the vocabulary: a
damaged shard); a damaged window shows on one rank only, so the trainer has
the ranks agree on it before their next collective (in the step's scalar
all-reduce; before an evaluation for `checks_contents` sets).
"""

import hashlib
import json
import mmap
import re

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from errors import UserError

FORMAT, VERSION = "mingpt-parallel-tokens", 1
INDEX, PLAN = "index.json", "plan.json"
SHARD_FILE = re.compile(r"shard-\d{5,}\.bin")
DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
REPAIR = "run the mode=prepare command again (it redoes missing and truncated shards)"
FRESH = "prepare the corpus again into an empty data.tokens_path"


def dtype_for(vocab_size: int) -> str:
    """The smallest unsigned integer dtype that holds ids [0, vocab_size)."""
    return next(name for name, t in DTYPES.items() if vocab_size - 1 <= np.iinfo(t).max)


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.bin"


def join(root, name):
    return root.rstrip("/") + "/" + name


class TokenCorpus:
    def __init__(self, path, prepare_command=None):
        """prepare_command: the mode=prepare command that makes this corpus, for the error
        when it is missing (the run's config file and tokenizer in it)."""
        self.path = path
        self.prepare_command = prepare_command or \
            f"python main.py mode=prepare data.path=<text> data.tokens_path={path}"
        self.fs, self.root = fsspec.core.url_to_fs(path)
        self.local = isinstance(self.fs, LocalFileSystem)
        index = self._read_index()
        try:
            self.tokenizer_state = index["tokenizer"]
            self.vocab_size, self.dtype = int(index["vocab_size"]), np.dtype(DTYPES[index["dtype"]])
            shards = index["shards"]
            self.files = [s["file"] for s in shards]
            self.counts = np.array([int(s["tokens"]) for s in shards], dtype=np.int64)
            max_tokens = [int(s["max_token"]) for s in shards]
            self.train_tokens = int(index["split"]["train_tokens"])
            self.val_tokens = int(index["split"]["val_tokens"])
            total = int(index["tokens"])
            assert self.tokenizer_state["kind"] in ("char", "gpt2")
        except (KeyError, TypeError, ValueError, AssertionError) as e:
            raise UserError(f"{self._where(INDEX)} is malformed ({type(e).__name__}: {e}): "
                            f"{FRESH}") from None
        self.bounds = np.concatenate([[0], np.cumsum(self.counts)])
        mismatch = [f"the shards hold {int(self.bounds[-1])} tokens, it says {total}"
                    if self.bounds[-1] != total else None,
                    f"its split {self.train_tokens} + {self.val_tokens} is not its {total} tokens"
                    if self.train_tokens + self.val_tokens != total else None,
                    f"dtype {self.dtype} cannot hold its vocabulary of {self.vocab_size}"
                    if dtype_for(self.vocab_size) != str(self.dtype) else None]
        if any(mismatch):
            raise UserError(f"{self._where(INDEX)} contradicts itself: "
                            f"{'; '.join(m for m in mismatch if m)}: {FRESH}")
        for name, top in zip(self.files, max_tokens):
            if top >= self.vocab_size:
                raise UserError(f"{self._where(name)} holds token id {top}, past the vocabulary "
                                f"of {self.vocab_size}: the index belongs to another corpus or "
                                f"tokenizer; {FRESH}")
        self._check_files()
        self._maps = {}
        # what the tokens are, wherever they lie: a copy has the same, a new corpus not
        self.fingerprint = hashlib.sha256(json.dumps(
            [self.tokenizer_state, str(self.dtype), self.train_tokens, self.val_tokens,
             [[int(n), m] for n, m in zip(self.counts, max_tokens)]]).encode()).hexdigest()

    def _where(self, name):
        """A file of the corpus, named as the user named the corpus (any fsspec URL)."""
        return f"token corpus file {join(self.path, name)}"

    def _read_index(self):
        try:
            with self.fs.open(join(self.root, INDEX), "r") as f:
                index = json.load(f)
        except FileNotFoundError:
            if self.fs.exists(join(self.root, PLAN)):
                raise UserError(f"data.tokens_path {self.path} is not fully prepared (plan.json "
                                "but no index.json: mode=prepare was interrupted): run the same "
                                "mode=prepare command again to finish it") from None
            raise UserError(f"data.tokens_path {self.path} has no {INDEX}: prepare it first, "
                            f"{self.prepare_command}") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"{self._where(INDEX)} is corrupt or truncated ({e})") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise UserError(f"{self._where(INDEX)} is not the index of a prepared token corpus")
        if index.get("version") != VERSION:
            raise UserError(f"{self._where(INDEX)} was written by another version (format "
                            f"{index.get('version')!r}, expected {VERSION}): {FRESH}")
        return index

    def _check_files(self):
        """Every shard present with its exact size, none unlisted: one listing where the
        store can list, one size request per shard it did not list (plain HTTP servers
        list nothing)."""
        sizes = self._listing()
        for name, count in zip(self.files, self.counts.tolist()):
            if not SHARD_FILE.fullmatch(str(name)):
                raise UserError(f"{self._where(INDEX)} names a shard {name!r} that is not of the "
                                "form shard-00000.bin")
            expected = count * self.dtype.itemsize
            size = sizes[name] if name in sizes else self._size(name)
            if size is None:
                raise UserError(f"{self._where(name)} is missing (listed in {INDEX}); {REPAIR}")
            if size != expected:
                raise UserError(f"{self._where(name)} has {size} bytes, {INDEX} says "
                                f"{count} tokens of {self.dtype} = {expected} bytes: the shard is "
                                f"truncated or the index belongs to other shards; {REPAIR}")
        unlisted = sorted(set(n for n in sizes if SHARD_FILE.fullmatch(n)) - set(self.files))
        if unlisted:
            raise UserError(f"{self._where(INDEX)} does not match its shards: {unlisted[0]} is "
                            f"not in it; {FRESH}")

    def _listing(self):
        """{file name: size} of the corpus directory; {} where the store cannot list it."""
        try:
            entries = self.fs.ls(self.root, detail=True)
        except (FileNotFoundError, NotImplementedError, OSError):
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size") for e in entries
                if e.get("type", "file") == "file" and e.get("size") is not None}

    def _size(self, name):
        try:
            return self.fs.size(join(self.root, name))
        except FileNotFoundError:
            return None

    def splits(self, block_size, vocab_size):
        """(train, val) TokenWindows, checked against the run's block and tokenizer."""
        if vocab_size != self.vocab_size:
            raise UserError(f"{self._where(INDEX)} says the vocabulary has {self.vocab_size} "
                            f"tokens, its tokenizer has {vocab_size}: {FRESH}")
        total = self.train_tokens + self.val_tokens
        for name, n in (("train", self.train_tokens), ("val", self.val_tokens)):
            if n <= block_size:
                raise UserError(f"data.tokens_path {self.path} is too short: its {name} split "
                                f"has {n} tokens of {total}, but one sample needs block_size + 1 "
                                f"= {block_size + 1}")
        return (TokenWindows(self, 0, self.train_tokens, block_size),
                TokenWindows(self, self.train_tokens, self.val_tokens, block_size))

    def read(self, starts, length):
        """int64 array (len(starts), length): the tokens [s, s + length) of the concatenated
        shards for each s in `starts`; one shard slice (or ranged read) per piece."""
        out = np.empty((len(starts), length), dtype=np.int64)
        pieces = []  # (row, column, shard, first token in shard, tokens)
        for row, s in enumerate(starts.tolist()):
            k = int(np.searchsorted(self.bounds, s, side="right")) - 1
            at = 0
            while at < length:
                first = s + at - int(self.bounds[k])
                take = min(length - at, int(self.counts[k]) - first)
                if take > 0:
                    pieces.append((row, at, k, first, take))
                    at += take
                k += 1
        if self.local:
            for row, at, k, first, take in pieces:
                out[row, at:at + take] = self._map(k)[first:first + take]
            for k in {p[2] for p in pieces}:
                self._unmap_pages(k)
        else:
            size = self.dtype.itemsize
            blobs = self.fs.cat_ranges([join(self.root, self.files[p[2]]) for p in pieces],
                                       [p[3] * size for p in pieces],
                                       [(p[3] + p[4]) * size for p in pieces])
            for (row, at, k, first, take), blob in zip(pieces, blobs):
                if isinstance(blob, Exception):
                    raise UserError(f"{self._where(self.files[k])}: cannot read it ({blob})")
                out[row, at:at + take] = np.frombuffer(blob, dtype=self.dtype.newbyteorder("<"))
        bad = np.flatnonzero(out.max(axis=1) >= self.vocab_size) if len(out) else []
        if len(bad):
            row = int(bad[0])
            k = next(p[2] for p in pieces if p[0] == row)
            raise UserError(f"{self._where(self.files[k])} holds token id {int(out[row].max())}, "
                            f"past the vocabulary of {self.vocab_size}: the shard is damaged or "
                            f"was not made by its index's tokenizer; delete it, then {REPAIR}")
        return out

    def _map(self, k):
        """Shard k as a read-only memory map, viewed as a token array."""
        if k not in self._maps:
            with open(join(self.root, self.files[k]), "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[k] = (mapped, np.frombuffer(mapped, dtype=self.dtype.newbyteorder("<")))
        return self._maps[k][1]

    def _unmap_pages(self, k):
        """Let go of the pages a read mapped. A fault maps a whole page-cache folio (on
        Linux 6, up to megabytes), so otherwise the process's resident memory grows
        toward the size of the corpus as training touches it (measured: 320 windows of
        129 bytes mapped all of a 256 MB shard). The pages stay in the page cache; the
        next read maps them again, for about 5 us per shard and step."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._maps[k][0].madvise(mmap.MADV_DONTNEED)


class TokenWindows:
    """A split of a TokenCorpus: every window of block_size + 1 tokens that starts in it,
    as char_dataset.CharDataset (x = window[:-1], y = window[1:])."""
    checks_contents = True  # batch() may raise on a damaged shard: the trainer agrees first

    def __init__(self, corpus, offset, n_tokens, block_size):
        self.corpus, self.offset, self.n_tokens = corpus, offset, n_tokens
        self.block_size = block_size
        self.fingerprint = corpus.fingerprint

    def __len__(self):
        return self.n_tokens - self.block_size

    def batch(self, starts):
        windows = torch.from_numpy(self.corpus.read(starts.numpy() + self.offset, self.block_size + 1))
        return windows[:, :-1], windows[:, 1:]
