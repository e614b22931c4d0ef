"""mode=prepare: text in, token shards out (data/token_shards.py reads them in place).

    python main.py mode=prepare data.path=SRC data.tokens_path=DST [data.tokenizer=gpt2]

SRC is a file, a directory or a glob, any fsspec URL; DST any fsspec URL.
The text is cut into chunks of about `prepare.chunk_mb` at safe places
(data/text_chunks.py) and each chunk becomes one shard, tokenized by a pool of
`prepare.workers` processes. A worker holds one chunk at a time (its text and
its tokens), so memory stays bounded whatever the corpus size.

- `char`: the vocabulary must be known before any chunk is tokenized, and it
  must be the one the text path would fit (the sorted set of characters of
  the whole text), so that the same text trains identically either way: a
  first, parallel pass collects each chunk's characters. `gpt2`: one pass;
  each file ends with <|endoftext|>, as GPT-2 separates documents.
- Resumable: plan.json (what is being prepared, and the vocabulary) is
  written first; each shard gets a marker (shard-NNNNN.json) once it is
  complete; index.json is written last. Run again after an interruption, the
  same command skips every shard whose marker and size check out. A DST that
  holds anything else (another corpus, another tokenizer, other files) is
  refused: nothing is overwritten.
- Progress on stderr: MB of text and tokens per second, shards done.
"""

import json
import multiprocessing
import os
import sys
import time
import uuid
from dataclasses import dataclass

import fsspec
import numpy as np

from data.fs_json import read_json, write_json
from errors import UserError
from data.text_chunks import list_sources, plan_chunks, read_chunk
from data.token_shards import DTYPES, FORMAT, INDEX, PLAN, SHARD_FILE, VERSION, dtype_for, join, shard_name
from data.tokenizer import build_tokenizer, describe_state


@dataclass
class PrepareConfig:
    """The `prepare:` section of gpt2_train_cfg.yaml (mode=prepare)."""
    workers: int = 0         # tokenizing processes; 0 = one per CPU core
    chunk_mb: float = 64.0   # MB of text per shard; a worker holds one chunk's text and tokens


def prepare(cfg):
    d, p = cfg.data, cfg.prepare
    fs, root = fsspec.core.url_to_fs(d.tokens_path)
    listed, chunk_bytes = list_sources(d.path, exclude=d.tokens_path), max(1, int(p.chunk_mb * 2**20))
    sources = [(url, size) for url, size, _ in listed]
    chunks = plan_chunks(sources, chunk_bytes)
    request = {"sources": [list(source) for source in listed], "tokenizer": d.tokenizer,
               "chunk_bytes": chunk_bytes, "val_fraction": d.val_fraction}
    workers = p.workers or os.cpu_count() or 1
    plan = _existing_plan(fs, root, d.tokens_path, request)
    if plan is None:
        state = _fit_tokenizer(d.tokenizer, sources, chunks, workers)
        vocab = build_tokenizer(None, saved=state).vocab_size
        plan = {"format": FORMAT, "version": VERSION, "request": request, "tokenizer": state,
                "vocab_size": vocab, "dtype": dtype_for(vocab), "id": uuid.uuid4().hex}
        fs.makedirs(root, exist_ok=True)
        write_json(fs, join(root, PLAN), plan)
    markers = _finished(fs, root, plan, len(chunks))
    todo = [k for k in range(len(chunks)) if k not in markers]
    if fs.exists(join(root, INDEX)):
        if not todo:
            print(f"{d.tokens_path} is already prepared from {d.path}: nothing to do", flush=True)
            return
        fs.rm(join(root, INDEX))  # incomplete until the repaired shards are written
        print(f"repairing: {len(todo)} of {len(chunks)} shards are missing or truncated", flush=True)
    elif markers:
        print(f"resuming: {len(markers)} of {len(chunks)} shards are done already", flush=True)
    jobs = [(k, *sources[chunks[k][0]], chunks[k][1], chunks[k][2],
             chunks[k][2] == sources[chunks[k][0]][1], d.tokens_path) for k in todo]
    bar = Progress("tokenizing", sum(chunks[k][2] - chunks[k][1] for k in todo), len(todo), "shards")
    for k, marker in _pool_map(_tokenize_chunk, jobs, workers,
                               (plan["tokenizer"], plan["dtype"], plan["id"])):
        markers[k] = marker
        bar.update(marker["text_bytes"], marker["tokens"])
    bar.close()
    index = _write_index(fs, root, plan, [markers[k] for k in range(len(chunks))], d.val_fraction)
    print(f"prepared {d.tokens_path}: {index['tokens']} tokens ({index['split']['train_tokens']} "
          f"train, {index['split']['val_tokens']} val) in {len(chunks)} shards of "
          f"{index['dtype']}, tokenizer {describe_state(index['tokenizer'])}; "
          f"{bar.summary()}", flush=True)


def _existing_plan(fs, root, path, request):
    """The plan of this same preparation found at DST (to resume, repair or confirm), or
    None for an empty DST; refuses a DST that holds anything else."""
    if not fs.exists(root):
        return None
    found = {name: _read_json(fs, join(root, name), path)
             for name in (INDEX, PLAN) if fs.exists(join(root, name))}
    for obj in found.values():
        if obj.get("format") != FORMAT or obj.get("request") != request:
            raise UserError(
                f"data.tokens_path {path} holds another preparation ({_differences(obj, request)}): "
                "nothing was overwritten; use another data.tokens_path or delete it")
    if PLAN in found:
        return found[PLAN]
    if found or fs.ls(root):
        raise UserError(f"data.tokens_path {path} exists and is not a token directory of this "
                        "version (no plan.json): refusing to write into it; use a new or empty "
                        "directory")
    return None


def _differences(found, request):
    was = found.get("request") if isinstance(found.get("request"), dict) else {}
    keys = [k for k in request if was.get(k) != request[k]]
    if not keys:
        return "not written by mode=prepare"
    return "; ".join(f"{k} {_short(was.get(k))} there, {_short(request[k])} now" for k in keys)


def _short(value):
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fit_tokenizer(kind, sources, chunks, workers):
    """The tokenizer's state: for char, the characters of the whole text (a first pass)."""
    if kind != "char":
        return build_tokenizer(kind).state()
    chars = set()
    bar = Progress("collecting characters", sum(b - a for _, a, b in chunks), len(chunks), "chunks")
    jobs = [(k, *sources[i], a, b) for k, (i, a, b) in enumerate(chunks)]
    for _, (found, size) in _pool_map(_chunk_chars, jobs, workers, None):
        chars |= set(found)
        bar.update(size, 0)
    bar.close()
    if not chars:
        raise UserError("data.path holds no text: nothing to prepare")
    return build_tokenizer("char", "".join(chars)).state()


def _finished(fs, root, plan, n_chunks):
    """{shard index: marker} of shards done by an earlier run of this plan."""
    done = {}
    itemsize = np.dtype(DTYPES[plan["dtype"]]).itemsize
    listing = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e["size"] for e in fs.ls(root, detail=True)}
    for k in range(n_chunks):
        name = shard_name(k)
        marker_name = name.replace(".bin", ".json")
        if marker_name not in listing or name not in listing:
            continue
        try:
            marker = _read_json(fs, join(root, marker_name), root)
        except UserError:
            continue  # a marker cut short: do the shard again
        if marker.get("plan") == plan["id"] and listing[name] == marker.get("tokens", -1) * itemsize:
            done[k] = marker
    return done


def _write_index(fs, root, plan, markers, val_fraction):
    total = sum(m["tokens"] for m in markers)
    n_val = int(total * val_fraction)
    index = {"format": FORMAT, "version": VERSION, "tokenizer": plan["tokenizer"],
             "vocab_size": plan["vocab_size"], "dtype": plan["dtype"], "tokens": total,
             "split": {"val_fraction": val_fraction, "train_tokens": total - n_val, "val_tokens": n_val},
             "shards": [{"file": shard_name(k), "tokens": m["tokens"], "max_token": m["max_token"]}
                        for k, m in enumerate(markers)],
             "inexact_cuts": sum(not m["exact"] for m in markers),
             "request": plan["request"], "id": plan["id"]}
    assert all(SHARD_FILE.fullmatch(s["file"]) for s in index["shards"])
    write_json(fs, join(root, INDEX), index, atomic=True)  # last: the corpus is complete
    return index


def _read_json(fs, path, where):
    try:
        obj = read_json(fs, path)
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: {path} is corrupt ({e}): delete it to start afresh") from None
    if not isinstance(obj, dict):
        raise UserError(f"{where}: {path} is not a JSON object")
    return obj



# ---------------------------------------------------------------- workers

_worker = {}  # per worker process: tokenizer, dtype and plan id, set once by _init


def _init(tokenizer_state=None, dtype=None, plan_id=None):
    if tokenizer_state is not None:
        _worker.update(tokenizer=build_tokenizer(None, saved=tokenizer_state),
                       dtype=np.dtype(DTYPES[dtype]).newbyteorder("<"), plan=plan_id)


def _chunk_chars(job):
    k, url, size, start, end = job
    text, _ = read_chunk(url, size, start, end)
    return k, ("".join(set(text)), end - start)


def _tokenize_chunk(job):
    """Tokenize one chunk into its shard, then write the shard's marker."""
    k, url, size, start, end, file_ends, dst = job
    tokenizer = _worker["tokenizer"]
    text, exact = read_chunk(url, size, start, end)
    ids = tokenizer.encode_array(text, _worker["dtype"])
    del text
    if file_ends and tokenizer.eot is not None:
        ids = np.append(ids, np.array([tokenizer.eot], dtype=ids.dtype))
    fs, root = fsspec.core.url_to_fs(dst)
    with fs.open(join(root, shard_name(k)), "wb") as f:
        f.write(memoryview(ids))
    marker = {"tokens": int(len(ids)), "max_token": int(ids.max()) if len(ids) else -1,
              "text_bytes": end - start, "exact": exact, "source": url, "range": [start, end],
              "plan": _worker["plan"]}
    write_json(fs, join(root, shard_name(k).replace(".bin", ".json")), marker)
    return k, marker


def _pool_map(fn, jobs, workers, tokenizer_args):
    """fn over jobs, results as they finish: in this process for one worker, else in a
    pool of worker processes (fork where the platform has it: nothing to re-import)."""
    init_args = tokenizer_args or ()
    if workers <= 1 or len(jobs) <= 1:
        _init(*init_args)
        yield from map(fn, jobs)
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ctx.Pool(min(workers, len(jobs)), initializer=_init, initargs=init_args) as pool:
        yield from pool.imap_unordered(fn, jobs)


class Progress:
    """One line on stderr: MB of text and tokens per second, items done (redrawn in
    place on a terminal, every 10 s otherwise)."""

    def __init__(self, what, total_bytes, total_items, unit):
        self.what, self.total, self.items, self.unit = what, total_bytes, total_items, unit
        self.bytes = self.tokens = self.done = 0
        self.started = self.shown = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, nbytes, ntokens):
        self.bytes, self.tokens, self.done = self.bytes + nbytes, self.tokens + ntokens, self.done + 1
        now = time.perf_counter()
        if now - self.shown >= (0.2 if self.tty else 10.0):
            self.shown = now
            self._show()

    def summary(self):
        s = max(time.perf_counter() - self.started, 1e-9)
        return (f"{self.bytes / 2**20 / s:.1f} MB/s of text, {self.tokens / s / 1e6:.2f}M tokens/s "
                f"over {s:.2f} s")

    def _show(self):
        left = (self.total - self.bytes) / max(self.bytes, 1) * (time.perf_counter() - self.started)
        line = (f"{self.what}: {self.bytes / 2**20:.0f}/{self.total / 2**20:.0f} MB, "
                f"{self.done}/{self.items} {self.unit} | {self.summary()} | ETA {left:.0f} s")
        sys.stderr.write(("\r" + line) if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self):
        if self.items:
            self._show()
            if self.tty:
                sys.stderr.write("\n")
