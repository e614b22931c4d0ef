"""mode=prepare and the token shards it writes, in process (prepare.workers=1 unless a
test is about the worker processes): chunks that tokenize like the whole text, the
same tokens as the text path, resuming without redoing shards, refusing to overwrite,
the gpt2 tokenizer from tiktoken's cache files, and every damaged corpus refused with
one line."""

import json
import os
import random

import numpy as np
import pytest

from data import prepare as prepare_module
from data import text_chunks
from char_dataset import DataConfig, open_data, split_tokens
from config import load_config
from errors import UserError
from harness import tiny_gpt2_cache
from data.text_chunks import list_sources, plan_chunks, read_chunk
from data.token_shards import TokenCorpus
from data.tokenizer import build_tokenizer


def awkward_text(n, seed=0):
    """Runs of spaces and line breaks, contractions, digits, non-ASCII: every place a
    careless cut would change GPT-2's pre-tokenization."""
    rng = random.Random(seed)
    pieces = ["the", " the", " river", "KING", "ab", " a", " ", "  ", "   ", "\n", "\n\n", " \n",
              "\t", "'s", "'t", "1", "22", "!", "?", "\u00e9", "\u2014", "\u00a0", "\U0001F600",
              "\r\n", " shall", "ing"]
    return "".join(rng.choice(pieces) for _ in range(n))


@pytest.fixture
def gpt2_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", tiny_gpt2_cache(tmp_path / "tiktoken"))


def prepare(tmp_path, src, dst, *overrides):
    cfg = load_config([f"data.path={src}", f"data.tokens_path={dst}", "mode=prepare",
                       "prepare.workers=1", *overrides], 1)
    prepare_module.prepare(cfg)
    return cfg


def all_tokens(path):
    corpus = TokenCorpus(str(path))
    total = corpus.train_tokens + corpus.val_tokens
    return corpus.read(np.array([0]), total)[0]


# ---------------------------------------------------------------- tokenizer and chunks

@pytest.mark.parametrize("chunk_bytes", [7, 50, 333, 4096])
def test_chunks_tokenize_like_the_whole_text(tmp_path, gpt2_cache, monkeypatch, chunk_bytes):
    monkeypatch.setattr(text_chunks, "FIRST_SEARCH", 64)
    text = awkward_text(6000)
    path = tmp_path / "t.txt"
    path.write_text(text)
    (url, size, _), = list_sources(str(path))
    parts = [read_chunk(url, size, a, b) for _, a, b in plan_chunks([(url, size)], chunk_bytes)]
    assert "".join(p for p, _ in parts) == text  # every byte in exactly one chunk
    assert all(exact for _, exact in parts)
    tok = build_tokenizer("gpt2")
    assert [i for p, _ in parts for i in tok.encode(p)] == tok.encode(text)


def test_text_without_a_safe_cut_is_cut_inexactly_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(text_chunks, "MAX_SEARCH", 256)
    monkeypatch.setattr(text_chunks, "FIRST_SEARCH", 64)
    path = tmp_path / "t.txt"
    path.write_text("x" * 3000 + "\u00e9" * 500)
    prepare(tmp_path, path, tmp_path / "tok", "prepare.chunk_mb=0.0005")  # 524 bytes
    index = json.loads((tmp_path / "tok" / "index.json").read_text())
    assert index["inexact_cuts"] >= 5
    assert all_tokens(tmp_path / "tok").tolist() == build_tokenizer("char", path.read_text()).encode(
        path.read_text())  # exact all the same for char, UTF-8 characters kept whole


# ---------------------------------------------------------------- prepare

def test_prepared_char_tokens_are_the_text_paths(tmp_path):
    text = awkward_text(20000, seed=1)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text(text[:9000])
    (tmp_path / "src" / "b.txt").write_text(text[9000:])
    prepare(tmp_path, tmp_path / "src", tmp_path / "tok", "prepare.chunk_mb=0.01")
    cfg = DataConfig(block_size=8, tokens_path=str(tmp_path / "tok"))
    tokenizer, train, val = open_data(cfg)
    ref_tok = build_tokenizer("char", text)
    ref_train, ref_val = split_tokens(text, ref_tok, cfg, "x")
    assert tokenizer.state() == ref_tok.state()
    assert len(train) == len(ref_train) and len(val) == len(ref_val)
    starts = np.array([0, 5, len(train) - 1, 4321])
    import torch
    for a, b in zip(train.batch(torch.tensor(starts)), ref_train.batch(torch.tensor(starts))):
        assert torch.equal(a, b)
    index = json.loads((tmp_path / "tok" / "index.json").read_text())
    assert index["dtype"] == "uint8" and len(index["shards"]) > 2
    assert os.path.getsize(tmp_path / "tok" / "shard-00000.bin") == index["shards"][0]["tokens"]


def test_gpt2_shards_end_each_file_with_endoftext(tmp_path, gpt2_cache):
    (tmp_path / "a.txt").write_text("KING: the river\n")
    (tmp_path / "b.txt").write_text("the crown")
    prepare(tmp_path, tmp_path / "*.txt", tmp_path / "tok", "data.tokenizer=gpt2")
    tok = build_tokenizer("gpt2")
    assert all_tokens(tmp_path / "tok").tolist() == \
        tok.encode("KING: the river\n") + [tok.eot] + tok.encode("the crown") + [tok.eot]
    assert json.loads((tmp_path / "tok" / "index.json").read_text())["dtype"] == "uint16"


def shard_times(directory):
    return {p.name: p.stat().st_mtime_ns for p in sorted(directory.glob("shard-*.bin"))}


def test_interrupted_prepare_finishes_without_redoing_shards(tmp_path, monkeypatch):
    src = tmp_path / "t.txt"
    src.write_text(awkward_text(30000, seed=2))
    prepare(tmp_path, src, tmp_path / "whole", "prepare.chunk_mb=0.01")
    real, calls = prepare_module._tokenize_chunk, []

    def dies_after_three(job):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(job[0])
        return real(job)
    monkeypatch.setattr(prepare_module, "_tokenize_chunk", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path, src, tmp_path / "tok", "prepare.chunk_mb=0.01")
    before = shard_times(tmp_path / "tok")
    assert len(before) == 3 and not (tmp_path / "tok" / "index.json").exists()
    with pytest.raises(UserError, match="interrupted"):
        TokenCorpus(str(tmp_path / "tok"))

    def counts(job):
        calls.append(job[0])
        return real(job)
    monkeypatch.setattr(prepare_module, "_tokenize_chunk", counts)
    calls.clear()
    prepare(tmp_path, src, tmp_path / "tok", "prepare.chunk_mb=0.01")
    whole = shard_times(tmp_path / "whole")
    assert sorted(calls) == list(range(3, len(whole)))  # only the shards not done before
    after = shard_times(tmp_path / "tok")
    assert all(after[name] == t for name, t in before.items())  # not rewritten
    assert np.array_equal(all_tokens(tmp_path / "tok"), all_tokens(tmp_path / "whole"))
    prepare(tmp_path, src, tmp_path / "tok", "prepare.chunk_mb=0.01")  # done: a no-op
    assert shard_times(tmp_path / "tok") == after


def test_prepare_again_redoes_a_truncated_or_missing_shard_only(tmp_path, monkeypatch):
    src = tmp_path / "t.txt"
    src.write_text(awkward_text(30000, seed=2))
    prepare(tmp_path, src, tmp_path / "tok", "prepare.chunk_mb=0.01")
    whole = all_tokens(tmp_path / "tok")
    shard = tmp_path / "tok" / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-1])
    (tmp_path / "tok" / "shard-00003.bin").unlink()
    with pytest.raises(UserError, match="run the mode=prepare command again"):
        TokenCorpus(str(tmp_path / "tok"))
    real, calls = prepare_module._tokenize_chunk, []
    monkeypatch.setattr(prepare_module, "_tokenize_chunk", lambda job: (calls.append(job[0]), real(job))[1])
    prepare(tmp_path, src, tmp_path / "tok", "prepare.chunk_mb=0.01")
    assert calls == [1, 3] and np.array_equal(all_tokens(tmp_path / "tok"), whole)


def test_worker_processes_write_what_one_process_writes(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text(awkward_text(30000, seed=3))
    prepare(tmp_path, src, tmp_path / "one", "prepare.chunk_mb=0.01")
    prepare(tmp_path, src, tmp_path / "two", "prepare.chunk_mb=0.01", "prepare.workers=2")
    one, two = (json.loads((tmp_path / d / "index.json").read_text()) for d in ("one", "two"))
    assert one["shards"] == two["shards"] and len(one["shards"]) > 4
    assert np.array_equal(all_tokens(tmp_path / "one"), all_tokens(tmp_path / "two"))


@pytest.mark.parametrize("change", ["another tokenizer", "another text", "foreign directory"])
def test_prepare_never_writes_over_something_else(tmp_path, gpt2_cache, change):
    src = tmp_path / "t.txt"
    src.write_text(awkward_text(3000))
    dst = tmp_path / "tok"
    if change == "foreign directory":
        dst.mkdir()
        (dst / "notes.txt").write_text("mine")
    else:
        prepare(tmp_path, src, dst)
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    overrides = ["data.tokenizer=gpt2"] if change == "another tokenizer" else []
    if change == "another text":
        src = tmp_path / "other.txt"
        src.write_text("other text " * 100)
    with pytest.raises(UserError, match="another preparation|not a token directory") as e:
        prepare(tmp_path, src, dst, *overrides)
    assert "\n" not in str(e.value)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before


@pytest.mark.parametrize("what,workers,message", [
    ("missing", 1, "data file not found"),
    ("empty glob", 1, "names no files"),
    ("latin-1", 2, "is not UTF-8 text \\(byte 0xe9 at offset 20027\\)"),  # raised in a worker
])
def test_bad_text_is_one_line(tmp_path, what, workers, message):
    src = {"missing": tmp_path / "none.txt", "empty glob": tmp_path / "*.none",
           "latin-1": tmp_path / "t.txt"}[what]
    if what == "latin-1":
        src.write_bytes(b"plain text " * 1820 + b"abc caf\xe9" + b" more" * 9000)
    with pytest.raises(UserError, match=message) as e:
        prepare(tmp_path, src, tmp_path / "tok", f"prepare.workers={workers}", "prepare.chunk_mb=0.01")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- damaged corpora

@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text(awkward_text(20000, seed=4))
    prepare(tmp_path, src, tmp_path / "tok", "prepare.chunk_mb=0.01")
    return tmp_path / "tok"


def edit_index(path, fn):
    index = json.loads((path / "index.json").read_text())
    fn(index)
    (path / "index.json").write_text(json.dumps(index))


DAMAGE = {
    "truncated shard": (lambda p: (p / "shard-00001.bin").write_bytes(
        (p / "shard-00001.bin").read_bytes()[:-10]), "shard-00001.bin has .* truncated"),
    "missing shard": (lambda p: (p / "shard-00002.bin").unlink(), "shard-00002.bin is missing"),
    "unlisted shard": (lambda p: (p / "shard-00099.bin").write_bytes(b"\0" * 8),
                       "does not match its shards: shard-00099.bin"),
    "index of other shards": (lambda p: edit_index(p, lambda i: (
        i["shards"][0].update(tokens=i["shards"][0]["tokens"] + 5),
        i["shards"][1].update(tokens=i["shards"][1]["tokens"] - 5))), "has .* bytes, index.json says"),
    "token past vocabulary in index": (
        lambda p: edit_index(p, lambda i: i["shards"][0].update(max_token=200)),
        "token id 200, past the vocabulary"),
    "garbage index": (lambda p: (p / "index.json").write_text("{not json"), "corrupt or truncated"),
    "no index": (lambda p: [(p / n).unlink() for n in ("index.json", "plan.json")],
                 "has no index.json: prepare it first"),
}


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_corpus_is_refused_with_one_line(corpus, how):
    damage, message = DAMAGE[how]
    damage(corpus)
    with pytest.raises(UserError, match=message) as e:
        open_data(DataConfig(block_size=8, tokens_path=str(corpus)))
    assert "\n" not in str(e.value) and str(corpus) in str(e.value)


def test_token_past_vocabulary_in_a_shard_is_refused_when_read(corpus):
    import torch
    data = bytearray((corpus / "shard-00000.bin").read_bytes())
    data[100] = 250
    (corpus / "shard-00000.bin").write_bytes(bytes(data))
    _, train, _ = open_data(DataConfig(block_size=8, tokens_path=str(corpus)))
    train.batch(torch.tensor([0, 200]))  # windows that miss it read fine
    with pytest.raises(UserError, match="shard-00000.bin holds token id 250, past the vocabulary"):
        train.batch(torch.tensor([200, 95]))


def test_tokens_of_another_tokenizer_than_the_snapshots_are_refused(corpus, gpt2_cache):
    cfg = DataConfig(block_size=8, tokens_path=str(corpus))
    with pytest.raises(UserError, match="prepared with the char .* snapshot was trained with gpt2"):
        open_data(cfg, saved_tokenizer=build_tokenizer("gpt2").state())
    with pytest.raises(UserError, match="prepared with the char .* snapshot was trained with char"):
        open_data(cfg, saved_tokenizer={"kind": "char", "chars": "abc"})
    with pytest.raises(UserError, match="data.tokenizer=gpt2"):
        open_data(DataConfig(block_size=8, tokens_path=str(corpus), tokenizer="gpt2"))


def test_a_remote_corpus_is_read_by_ranged_requests(tmp_path, monkeypatch):
    """Not a local path (memory:// stands for an object store): prepare writes there, and
    training reads a window's bytes with ranged requests, never a whole shard."""
    import torch
    from fsspec.implementations.memory import MemoryFileSystem
    src = tmp_path / "t.txt"
    src.write_text(awkward_text(20000, seed=5))
    prepare(tmp_path, src, tmp_path / "local", "prepare.chunk_mb=0.01")
    prepare(tmp_path, src, "memory://bench-tokens", "prepare.chunk_mb=0.01")
    _, remote, _ = open_data(DataConfig(block_size=8, tokens_path="memory://bench-tokens"))
    ranges, real = [], MemoryFileSystem.cat_file

    def cat_file(self, path, start=None, end=None, **kw):
        ranges.append((start, end))
        return real(self, path, start=start, end=end, **kw)
    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)
    _, local, _ = open_data(DataConfig(block_size=8, tokens_path=str(tmp_path / "local")))
    starts = torch.tensor([0, 3, 9000, len(local) - 1])
    for a, b in zip(remote.batch(starts), local.batch(starts)):
        assert torch.equal(a, b)
    assert len(ranges) >= 4 and all(end - start <= 9 for start, end in ranges)  # block + 1 tokens
    MemoryFileSystem().rm("/bench-tokens", recursive=True)


def test_a_snapshot_resumes_on_a_copy_of_its_tokens_not_on_other_tokens(tmp_path, corpus):
    """Snapshots know prepared tokens by a fingerprint of the index, not by their path."""
    import shutil
    from char_dataset import data_identity
    from checkpoint.resume import check_resumable
    shutil.copytree(corpus, tmp_path / "copy")
    other = tmp_path / "other.txt"
    other.write_text(awkward_text(20001, seed=4))
    prepare(tmp_path, other, tmp_path / "other", "prepare.chunk_mb=0.01")
    ids = {name: data_identity(open_data(DataConfig(block_size=8, tokens_path=str(tmp_path / name)))[1])
           for name in ("tok", "copy", "other")}
    cfg = load_config([f"data.tokens_path={tmp_path / 'copy'}"], 1)
    meta = {"config": {"trainer": {"batch_size": 32, "seed": 1337, "max_steps": 300, "lr": 2e-3,
                                   "min_lr": 2e-4, "warmup_steps": 20}, "data": {}},
            "data_order": {"sampler": "feistel", "version": 1}, "data": ids["tok"]}
    assert ids["tok"] == ids["copy"] and check_resumable("snap", meta, cfg, ids["copy"]) == []
    with pytest.raises(UserError, match=r"trained on prepared tokens \w+ \(\d+ train windows\), "
                                        r"this run reads prepared tokens"):
        check_resumable("snap", meta, cfg, ids["other"])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's RssFile")
def test_reading_windows_does_not_keep_the_corpus_resident(tmp_path):
    """Memory-mapped shards: what training touched must not stay mapped (a fault maps a
    whole page-cache folio, so without letting go the RSS grows toward the corpus)."""
    import re
    import torch
    tokens = tmp_path / "tok"
    tokens.mkdir()
    n = 48 * 2**20
    (tokens / "shard-00000.bin").write_bytes(np.random.default_rng(0).integers(0, 50, n, np.uint8).tobytes())
    (tokens / "index.json").write_text(json.dumps({
        "format": "mingpt-parallel-tokens", "version": 1, "tokenizer": {"kind": "char", "chars": "x" * 50},
        "vocab_size": 50, "dtype": "uint8", "tokens": n,
        "split": {"train_tokens": n - 1000, "val_tokens": 1000},
        "shards": [{"file": "shard-00000.bin", "tokens": n, "max_token": 49}]}))
    corpus = TokenCorpus(str(tokens))
    train, _ = corpus.splits(128, 50)

    def resident_file_mb():
        with open("/proc/self/status") as f:
            return int(re.search(r"RssFile:\s+(\d+)", f.read()).group(1)) / 1024
    before = resident_file_mb()
    rng = np.random.default_rng(1)
    for _ in range(50):  # 50 steps of 16 windows
        train.batch(torch.from_numpy(rng.integers(0, len(train), 16)))
    assert resident_file_mb() - before < 8, f"{resident_file_mb() - before:.0f} MB of the shard stayed mapped"


class _RangedFiles(__import__("http.server").server.SimpleHTTPRequestHandler):
    """Files with Range requests and without directory listings: a plain static host
    (a CDN, a bucket's website endpoint), not an object store's API."""

    def list_directory(self, path):
        self.send_error(404)

    def send_head(self):
        import re
        path = self.translate_path(self.path)
        if os.path.isdir(path) or not os.path.exists(path):
            self.send_error(404)
            return None
        data = open(path, "rb").read()
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if wanted:
            start, end = int(wanted[1]), int(wanted[2] or len(data) - 1)
            body = data[start:end + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(data)}")
        else:
            body = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        import io
        return io.BytesIO(b"" if self.command == "HEAD" else body)

    def log_message(self, *args):
        pass


def test_a_corpus_on_a_plain_http_server_is_read_by_ranged_requests(tmp_path):
    """https:// is the commonest remote: no directory listing there, so each shard is
    checked by its own size, and windows come by Range requests."""
    import functools
    import threading
    import torch
    from http.server import ThreadingHTTPServer
    src = tmp_path / "t.txt"
    src.write_text(awkward_text(20000, seed=5))
    prepare(tmp_path, src, tmp_path / "site" / "tok", "prepare.chunk_mb=0.01")
    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 functools.partial(_RangedFiles, directory=str(tmp_path / "site")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/tok"
        _, remote, _ = open_data(DataConfig(block_size=8, tokens_path=url))
        _, local, _ = open_data(DataConfig(block_size=8, tokens_path=str(tmp_path / "site" / "tok")))
        starts = torch.tensor([0, 3, 9000, len(local) - 1])
        for a, b in zip(remote.batch(starts), local.batch(starts)):
            assert torch.equal(a, b)
        (tmp_path / "site" / "tok" / "shard-00001.bin").unlink()
        with pytest.raises(UserError, match=r"shard-00001.bin is missing"):
            open_data(DataConfig(block_size=8, tokens_path=url))
    finally:
        server.shutdown()


def test_sources_skip_hidden_files_and_the_output_and_know_an_edit_in_place(tmp_path):
    """A directory's hidden files (.git, editor swaps) and DST put inside the source are
    not text to train on; a file rewritten to the same size is not the file an
    interrupted prepare began on (its modification time, or ETag, is part of the plan)."""
    src = tmp_path / "src"
    (src / ".git").mkdir(parents=True)
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (src / "a.txt").write_text(awkward_text(3000, seed=1))
    prepare(tmp_path, src, src / "tok", "prepare.chunk_mb=0.01")
    index = json.loads((src / "tok" / "index.json").read_text())
    assert [s[0] for s in index["request"]["sources"]] == [str(src / "a.txt")]
    prepare(tmp_path, src, src / "tok", "prepare.chunk_mb=0.01")  # the same: nothing to do
    text = (src / "a.txt").read_text()
    (src / "a.txt").write_text(text[::-1])
    os.utime(src / "a.txt", (1, 1))
    with pytest.raises(UserError, match="holds another preparation .*sources"):
        prepare(tmp_path, src, src / "tok", "prepare.chunk_mb=0.01")
