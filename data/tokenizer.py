"""Tokenizers: `char` (the sorted characters of the text) and `gpt2` (GPT-2's BPE).

Both turn text into ids as a list (`encode`) or a numpy array (`encode_array`,
vectorised: what mode=prepare and the text path use), and describe
themselves as a small JSON-able `state()` that snapshots and token indexes
carry, so a run can tell whether two of them tokenize alike (`same_tokenizer`).

`gpt2` is built here, not by `tiktoken.get_encoding`, from the two files
GPT-2 was published with (vocab.bpe: the merges; encoder.json: the ids),
read through tiktoken's own cache (`read_file_cached`: TIKTOKEN_CACHE_DIR,
files named by the sha1 of their URL; a download when online): tiktoken's
data-gym parser, GPT-2's pre-tokenizer pattern and <|endoftext|> after the
last rank, as tiktoken_ext.openai_public.gpt2 does. The state records the
sha256 of the two files, so tokens prepared with one BPE are never trained
against a snapshot of another. The tests put a small BPE in GPT-2's file
format (`data_gym_files`) into a TIKTOKEN_CACHE_DIR and go through this
same code, no network involved.
"""

import hashlib
import json

import numpy as np

from errors import UserError

GPT2_FILES = {  # tiktoken_ext/openai_public.py: URL and sha256 of GPT-2's files
    "vocab.bpe": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                  "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "encoder.json": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
                     "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
}
ENDOFTEXT = "<|endoftext|>"
SLICE = 1 << 20  # characters CharTokenizer.encode_array converts at a time


class CharTokenizer:
    kind = "char"

    def __init__(self, chars, source="the training text"):
        self.chars = list(chars)  # id i is chars[i]: sorted when fitted to a text
        self.source = source  # where the vocabulary came from, for the error below
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars)
        codes = np.array([ord(c) for c in self.chars], dtype=np.uint32)
        self.order = np.argsort(codes, kind="stable")  # encode_array looks codes up sorted
        self.codes = codes[self.order]
        self.eot = None  # nothing marks the end of a document

    def encode(self, text):
        return self.encode_array(text).tolist()

    def encode_array(self, text, dtype=np.int64):
        """ids as a numpy array of `dtype`, a slice of the text at a time (so a big
        chunk costs its output and a few MB, not 20 bytes per character)."""
        out = np.empty(len(text), dtype=dtype)
        for at in range(0, len(text), SLICE):
            piece = text[at:at + SLICE]
            points = np.frombuffer(piece.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
            where = np.searchsorted(self.codes, points).clip(0, max(self.vocab_size - 1, 0))
            unknown = np.flatnonzero(self.codes[where] != points) if self.vocab_size else \
                np.arange(len(points))
            if unknown.size:
                raise UserError(f"character {piece[unknown[0]]!r} is not in the vocabulary of "
                                f"{self.source} ({self.vocab_size} characters: a char vocabulary "
                                "is the characters of the text it was made from)")
            out[at:at + len(piece)] = self.order[where]
        return out

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)

    def state(self):
        return {"kind": self.kind, "chars": "".join(self.chars)}

    def describe(self):
        return f"char ({self.vocab_size} characters)"


class GPT2Tokenizer:
    kind = "gpt2"

    def __init__(self, expected_sha256=None):
        import tiktoken
        from tiktoken.load import read_file_cached
        from tiktoken_ext.openai_public import r50k_pat_str
        try:
            files = {name: read_file_cached(url) for name, (url, _) in GPT2_FILES.items()}
        except Exception as e:
            raise UserError(
                "tiktoken's gpt2 encoding files are not available offline "
                f"({type(e).__name__}). Copy vocab.bpe and encoder.json into a directory, "
                "named by the sha1 of their download URL, and set TIKTOKEN_CACHE_DIR to it "
                "(see docs/data.md, 'GPT-2\'s BPE offline').") from None
        self.sha256 = files_sha256(files)
        if expected_sha256 and expected_sha256 != self.sha256:
            raise UserError(
                f"the GPT-2 BPE files found (sha256 {self.sha256[:12]}...) are not the ones this "
                f"run's tokens or snapshot were made with (sha256 {expected_sha256[:12]}...): "
                "point TIKTOKEN_CACHE_DIR at those")
        ranks = parse_data_gym()
        self.enc = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                     special_tokens={ENDOFTEXT: len(ranks)})
        self.vocab_size = self.enc.n_vocab
        self.eot = len(ranks)  # 50256 for GPT-2: ends each document of a prepared corpus

    def encode(self, text):
        return self.enc.encode_ordinary(text)

    def encode_array(self, text, dtype=np.int64):
        # disallowed_special=(): "<|endoftext|>" in the text is ordinary text, as encode_ordinary
        return self.enc.encode_to_numpy(text, disallowed_special=()).astype(dtype)

    def decode(self, ids):
        return self.enc.decode(list(ids))

    def state(self):
        return {"kind": self.kind, "sha256": self.sha256}

    def describe(self):
        official = self.sha256 == files_sha256(None)
        return f"gpt2 ({self.vocab_size} tokens{'' if official else ', BPE sha256 ' + self.sha256[:12]})"


def files_sha256(files):
    """One digest of GPT-2's two files (None: the digest of OpenAI's originals)."""
    digests = [sha for _, sha in GPT2_FILES.values()] if files is None else \
        [hashlib.sha256(files[name]).hexdigest() for name in GPT2_FILES]
    return hashlib.sha256(" ".join(digests).encode()).hexdigest()


def parse_data_gym():
    """{token bytes: rank} by tiktoken's own data-gym parser, which reads both files
    through read_file_cached again (from its cache: the download, if any, is done)."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    try:
        return data_gym_to_mergeable_bpe_ranks(*(url for url, _ in GPT2_FILES.values()))
    except (AssertionError, ValueError, KeyError, UnicodeDecodeError) as e:
        raise UserError(f"the GPT-2 BPE files in TIKTOKEN_CACHE_DIR are damaged: vocab.bpe and "
                        f"encoder.json do not agree ({type(e).__name__})") from None


def data_gym_files(words):
    """vocab.bpe and encoder.json (bytes) of a small BPE in GPT-2's format: the 256 byte
    tokens plus merges that spell each of `words` (ASCII) left to right. For tests and
    the benchmark, which have no network to fetch GPT-2's own."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    order = printable + others  # tiktoken's data-gym byte order
    gym = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    encoder = {gym[b]: rank for rank, b in enumerate(order)}
    merges = []
    for word in words:
        raw = word.encode()
        for cut in range(2, len(raw) + 1):
            left, right = "".join(gym[b] for b in raw[:cut - 1]), gym[raw[cut - 1]]
            if left + right not in encoder:
                merges.append(f"{left} {right}")
                encoder[left + right] = len(encoder)
    vocab_bpe = "#version: 0.2\n" + "".join(m + "\n" for m in merges)
    return {"vocab.bpe": vocab_bpe.encode(), "encoder.json": json.dumps(encoder).encode()}


def cache_gpt2_files(directory, files):
    """Put {"vocab.bpe": bytes, "encoder.json": bytes} into `directory` under the names
    tiktoken's cache gives GPT-2's files (the sha1 of their URL): with
    TIKTOKEN_CACHE_DIR=directory, data.tokenizer=gpt2 loads them. Returns directory."""
    import os
    os.makedirs(directory, exist_ok=True)
    for name, (url, _) in GPT2_FILES.items():
        with open(os.path.join(directory, hashlib.sha1(url.encode()).hexdigest()), "wb") as f:
            f.write(files[name])
    return str(directory)


def build_tokenizer(kind, text=None, saved=None, source=None):
    """A tokenizer from a saved state (snapshot or token index), or else fitted to `text`.
    source: where a saved state came from ("the snapshot at ..."), for errors."""
    if saved is not None:
        kind = saved["kind"]
    if kind == "gpt2":
        return GPT2Tokenizer(expected_sha256=(saved or {}).get("sha256"))
    if kind == "char":
        if saved:
            return CharTokenizer(saved["chars"], source or "the saved tokenizer")
        return CharTokenizer(sorted(set(text)))
    raise UserError(f"data.tokenizer must be 'char' or 'gpt2', got {kind!r}")


def same_tokenizer(a: dict, b: dict) -> bool:
    """Whether two saved states tokenize alike (a gpt2 state without sha256 is from
    before it was recorded: its kind is all there is to compare)."""
    if a["kind"] != b["kind"]:
        return False
    if a["kind"] == "char":
        return a["chars"] == b["chars"]
    return not (a.get("sha256") and b.get("sha256")) or a["sha256"] == b["sha256"]


def describe_state(state: dict) -> str:
    if state["kind"] == "char":
        return f"char ({len(state['chars'])} characters)"
    return f"gpt2 (BPE sha256 {state.get('sha256', '?')[:12]})"
