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
against a snapshot of another. Hugging Face's `gpt2` vocab.json and merges.txt
(the same two files under other names) are taken where tiktoken's cache lacks
them: converted into it (`from_hugging_face`). Built from a token index's state,
the files are read only once text is encoded or decoded. The tests put a small BPE
in GPT-2's file format (`data_gym_files`) into a TIKTOKEN_CACHE_DIR and go
through this same code, no network involved.
"""

import hashlib
import json
import os

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
    """GPT-2's BPE. Given the vocabulary size with the saved state (prepared tokens'
    index), the two files are read only when text is first encoded or decoded: training
    from data.tokens_path needs them for the prompt of a sample only."""
    kind = "gpt2"

    def __init__(self, expected_sha256=None, vocab_size=None):
        self.expected_sha256 = expected_sha256
        self._enc = None
        if expected_sha256 and vocab_size:  # known without the files: read them when needed
            self.sha256, self.vocab_size = expected_sha256, vocab_size
        else:
            self._load()
        self.eot = self.vocab_size - 1  # <|endoftext|> after the merges: 50256 for GPT-2

    def _load(self):
        import tiktoken
        from tiktoken_ext.openai_public import r50k_pat_str
        files = gpt2_files()
        sha256 = files_sha256(files)
        if self.expected_sha256 and self.expected_sha256 != sha256:
            raise UserError(
                f"the GPT-2 BPE files found (sha256 {sha256[:12]}...) are not the ones this "
                f"run's tokens or snapshot were made with (sha256 {self.expected_sha256[:12]}...): "
                "point TIKTOKEN_CACHE_DIR at those")
        ranks = parse_data_gym()
        self._enc = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                      special_tokens={ENDOFTEXT: len(ranks)})
        if getattr(self, "vocab_size", self._enc.n_vocab) != self._enc.n_vocab:
            raise UserError(f"the GPT-2 BPE files found have {self._enc.n_vocab} tokens, the "
                            f"tokens of this run {self.vocab_size}: point TIKTOKEN_CACHE_DIR at "
                            "the files they were made with")
        self.sha256, self.vocab_size = sha256, self._enc.n_vocab

    @property
    def enc(self):
        if self._enc is None:
            self._load()
        return self._enc

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


def tiktoken_cache_dir():
    """Where tiktoken's read_file_cached looks (tiktoken/load.py)."""
    import tempfile
    return os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or \
        os.path.join(tempfile.gettempdir(), "data-gym-cache")


def cache_name(name):
    """The file name tiktoken's cache gives GPT-2's `name`: the sha1 of its download URL."""
    return hashlib.sha1(GPT2_FILES[name][0].encode()).hexdigest()


def gpt2_files():
    """{"vocab.bpe": bytes, "encoder.json": bytes}: from tiktoken's cache; else Hugging
    Face's `gpt2` vocab.json and merges.txt (in TIKTOKEN_CACHE_DIR, or Hugging Face's
    hub cache), converted into tiktoken's cache; else downloaded by tiktoken."""
    from tiktoken.load import read_file_cached
    cache = tiktoken_cache_dir()
    if not all(os.path.isfile(os.path.join(cache, cache_name(n))) for n in GPT2_FILES):
        hf = hugging_face_gpt2_dir()
        if hf:
            cache_gpt2_files(cache, from_hugging_face(hf))
            if os.environ.get("RANK", "0") == "0":
                print(f"note: Hugging Face's gpt2 vocab.json and merges.txt in {hf} converted "
                      f"into tiktoken's cache {cache}", flush=True)
    try:
        return {name: read_file_cached(url) for name, (url, _) in GPT2_FILES.items()}
    except Exception as e:
        raise UserError(
            f"GPT-2's BPE files are not here and could not be downloaded ({type(e).__name__}): "
            + "; ".join(f"put {name} ({url}, sha256 {sha[:16]}...) into TIKTOKEN_CACHE_DIR as "
                        f"{cache_name(name)}" for name, (url, sha) in GPT2_FILES.items())
            + ", or Hugging Face's gpt2 vocab.json and merges.txt there "
              "(docs/data.md, 'GPT-2's BPE offline')") from None


HF_NAMES = {"encoder.json": "vocab.json", "vocab.bpe": "merges.txt"}  # the same content


def hugging_face_gpt2_dir():
    """A directory holding Hugging Face's `gpt2` vocab.json and merges.txt: TIKTOKEN_CACHE_DIR
    itself, or a snapshot of `gpt2` (`openai-community/gpt2`) in Hugging Face's hub cache
    (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub). None if there is none."""
    import glob
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    places = [tiktoken_cache_dir()] + sorted(
        glob.glob(os.path.join(hub, "models--gpt2", "snapshots", "*")) +
        glob.glob(os.path.join(hub, "models--openai-community--gpt2", "snapshots", "*")))
    return next((d for d in places if all(os.path.isfile(os.path.join(d, n))
                                          for n in HF_NAMES.values())), None)


def from_hugging_face(directory):
    """GPT-2's two files in OpenAI's form from Hugging Face's vocab.json (the ids, as
    encoder.json) and merges.txt (the merges, as vocab.bpe; a trailing newline is what
    tiktoken's parser expects). Where the bytes as they are, or encoder.json written as
    json.dumps writes it, are OpenAI's (their sha256), those; else the json.dumps form,
    so the same BPE has one digest whichever form it came in."""
    with open(os.path.join(directory, "vocab.json"), "rb") as f:
        vocab = f.read()
    with open(os.path.join(directory, "merges.txt"), "rb") as f:
        merges = f.read().replace(b"\r\n", b"\n")
    if not merges.startswith(b"#version"):
        merges = b"#version: 0.2\n" + merges
    if not merges.endswith(b"\n"):
        merges += b"\n"
    try:
        canonical = json.dumps(json.loads(vocab)).encode()
    except ValueError:
        raise UserError(f"{os.path.join(directory, 'vocab.json')} is not JSON: not Hugging "
                        "Face's gpt2 vocab.json") from None
    official = GPT2_FILES["encoder.json"][1]
    encoder = vocab if hashlib.sha256(vocab).hexdigest() == official else canonical
    return {"vocab.bpe": merges, "encoder.json": encoder}


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
        raise UserError(f"the GPT-2 BPE files in {tiktoken_cache_dir()} are damaged: vocab.bpe "
                        f"({cache_name('vocab.bpe')}) and encoder.json "
                        f"({cache_name('encoder.json')}) do not agree ({type(e).__name__})") from None


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
    TIKTOKEN_CACHE_DIR=directory, data.tokenizer=gpt2 loads them. Each file appears
    whole (a rename), as ranks may write the same at once. Returns directory."""
    os.makedirs(directory, exist_ok=True)
    for name in GPT2_FILES:
        path = os.path.join(directory, cache_name(name))
        with open(f"{path}.{os.getpid()}.tmp", "wb") as f:
            f.write(files[name])
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    return str(directory)


def build_tokenizer(kind, text=None, saved=None, source=None, vocab_size=None):
    """A tokenizer from a saved state (snapshot or token index), or else fitted to `text`.
    source: where a saved state came from ("the snapshot at ..."), for errors. vocab_size
    (a token index's): a gpt2 state then reads its files only when text is encoded or
    decoded."""
    if saved is not None:
        kind = saved["kind"]
    if kind == "gpt2":
        return GPT2Tokenizer(expected_sha256=(saved or {}).get("sha256"), vocab_size=vocab_size)
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
