"""Text in, batches out: reading, tokenizing, splitting and ordering samples.

- Text comes from any fsspec path or URL (`data.path`); empty means the
  embedded default corpus, which this file generates (no download, no
  third-party text). A corpus prepared by mode=prepare (`data.tokens_path`,
  data/prepare.py) is read in place instead: data/token_shards.py.
- Tokenizers (data/tokenizer.py): `char` (vocabulary = the sorted characters of
  the text, saved in snapshots) or `gpt2` (GPT-2's BPE through tiktoken, which
  needs its two files locally when offline: see TIKTOKEN_CACHE_DIR in docs/data.md).
- Train/val split: the first (1 - val_fraction) of the tokens train, the rest
  validate. Contiguous, so no window straddles both, and identical on every
  rank because it involves no randomness at all.
- Sample order: a sample is the window starting at token i. Each epoch is a
  pseudo-random permutation of all windows keyed by (seed, epoch)
  (data/permutation.py: entry i costs O(1), so a step costs O(batch) whatever the
  corpus size), so the order changes per epoch and is reproducible.
  Optimizer step s reads global-batch positions [s*B, (s+1)*B) of that
  stream; data-parallel rank r takes its contiguous 1/dp of them, and computes
  only those. The position is therefore a function of the step alone, which
  is what lets a snapshot resume under another layout (data/sampling.py). `data.sampler=randperm`
  is the order before the permutation existed (torch.randperm over all
  windows each epoch), kept only so that snapshots written with it can finish
  their runs with the data they started with.
"""

import functools
import random
from dataclasses import dataclass

import fsspec
import torch

from errors import UserError
from data.sampling import (LEGACY_ORDER, SAMPLERS, GlobalBatches, data_identity,  # noqa: F401
                           data_order, describe_data, eval_starts)  # re-exported: the data entry point
from data.tokenizer import build_tokenizer, describe_state, same_tokenizer  # noqa: F401 (build_tokenizer: re-exported)

@dataclass
class DataConfig:
    """The `data:` section of gpt2_train_cfg.yaml."""
    path: str = ""           # UTF-8 text, any fsspec path or URL ("" = the embedded corpus);
                             # mode=prepare also takes a directory or a glob
    tokens_path: str = ""    # token shards made by mode=prepare (any fsspec URL); when set,
                             # training reads them in place instead of data.path
    block_size: int = 128    # context length in tokens
    tokenizer: str = "char"  # char (the text's characters, saved in snapshots) | gpt2 (tiktoken BPE)
    val_fraction: float = 0.1  # the last fraction of the tokens validates (tokens_path: fixed at prepare)
    sampler: str = "feistel"  # window order per epoch: feistel (keyed permutation, O(batch) a step)
                              # | randperm (the older order, only to finish snapshots written with it)


def open_data(cfg: DataConfig, saved_tokenizer=None, saved_by="the snapshot", config_file=""):
    """(tokenizer, train set, val set) of the run: prepared tokens if data.tokens_path is
    set, else the text of data.path. saved_tokenizer: the one the model was trained with
    (`saved_by`: the snapshot's when resuming, or a model.init_from folder's).
    config_file: the run's config=FILE, quoted in the command that prepares missing tokens."""
    if not cfg.tokens_path:
        text = load_text(cfg.path)
        tokenizer = build_tokenizer(cfg.tokenizer, text, saved=saved_tokenizer, source=saved_by)
        return (tokenizer, *split_tokens(text, tokenizer, cfg, cfg.path))
    from data.token_shards import TokenCorpus
    corpus = TokenCorpus(cfg.tokens_path, " ".join(
        ["python main.py"] + ([f"config={config_file}"] if config_file else [])
        + ["mode=prepare", "data.path=<text>", f"data.tokens_path={cfg.tokens_path}"]
        + ([f"data.tokenizer={cfg.tokenizer}"] if cfg.tokenizer != DataConfig.tokenizer else [])))
    state = corpus.tokenizer_state
    if state["kind"] != cfg.tokenizer:
        raise UserError(f"data.tokens_path {cfg.tokens_path} was prepared with the "
                        f"{describe_state(state)} tokenizer, but data.tokenizer={cfg.tokenizer}: "
                        f"set data.tokenizer={state['kind']}, or prepare the text again")
    if saved_tokenizer is not None and not same_tokenizer(saved_tokenizer, state):
        raise UserError(f"data.tokens_path {cfg.tokens_path} was prepared with the "
                        f"{describe_state(state)} tokenizer, {saved_by} was trained with "
                        f"{describe_state(saved_tokenizer)}: its token ids mean other text. Use "
                        f"tokens prepared with the tokenizer of {saved_by}"
                        + (", or a new trainer.snapshot_path" if saved_by.startswith("the snapshot") else ""))
    # gpt2: its files are read when text is first encoded or decoded (a prompt, a sample)
    tokenizer = build_tokenizer(None, saved=state, source=f"the tokens at {cfg.tokens_path}",
                                vocab_size=corpus.vocab_size)
    return (tokenizer, *corpus.splits(cfg.block_size, tokenizer.vocab_size))


# ---------------------------------------------------------------- text

@functools.lru_cache(maxsize=2)  # generated once per process: tests' job servers run many jobs
def embedded_corpus(n_chars: int = 600_000, seed: int = 1234) -> str:
    """A play-like text generated from this project's own word lists."""
    rng = random.Random(seed)
    speakers = ["KING", "QUEEN", "FOOL", "CAPTAIN", "NURSE", "SCRIBE", "HERALD"]
    adj = ["old", "quiet", "bright", "cold", "gentle", "proud", "weary", "golden", "dark"]
    noun = ["river", "crown", "tower", "sword", "garden", "letter", "ship", "lantern", "field"]
    verb = ["keeps", "remembers", "breaks", "follows", "carries", "guards", "forgets"]
    go = ["walk to", "sail past", "wait by", "ride toward", "sleep beneath"]
    call = ["my lord", "good lady", "sweet friend", "sir", "brave heart"]
    templates = [
        lambda: f"The {rng.choice(adj)} {rng.choice(noun)} {rng.choice(verb)} the {rng.choice(noun)}.",
        lambda: f"I shall {rng.choice(go)} the {rng.choice(adj)} {rng.choice(noun)} tonight.",
        lambda: f"Why do you {rng.choice(['weep', 'laugh', 'wait', 'sing'])}, {rng.choice(call)}?",
        lambda: f"Bring me the {rng.choice(noun)}, and tell the {rng.choice(speakers).lower()} "
                f"that the {rng.choice(noun)} is {rng.choice(adj)}.",
        lambda: f"No, {rng.choice(call)}; the {rng.choice(noun)} {rng.choice(verb)} what we lost.",
    ]
    parts, size = [], 0
    while size < n_chars:
        lines = " ".join(rng.choice(templates)() for _ in range(rng.randint(1, 3)))
        speech = f"{rng.choice(speakers)}:\n{lines}\n\n"
        parts.append(speech)
        size += len(speech)
    return "".join(parts)


def load_text(path: str) -> str:
    """Read UTF-8 text from an fsspec path or URL ("" = embedded default)."""
    if not path:
        return embedded_corpus()
    try:
        with fsspec.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise UserError(f"data file not found: {path}") from None
    except Exception as e:  # network, permissions, unknown protocol, ...
        raise UserError(f"cannot read data file {path}: {e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"data file {path} is not UTF-8 text "
                        f"(byte 0x{raw[e.start]:02x} at offset {e.start})") from None


# ---------------------------------------------------------------- samples

class CharDataset:
    """Every window of block_size + 1 tokens: x = window[:-1], y = window[1:]."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self):
        return len(self.tokens) - self.block_size

    def batch(self, starts):
        """Stack the windows that begin at `starts` into (x, y) of shape (len, block)."""
        idx = starts.view(-1, 1) + torch.arange(self.block_size + 1)
        windows = self.tokens[idx]
        return windows[:, :-1], windows[:, 1:]


def split_tokens(text, tokenizer, cfg: DataConfig, source):
    """Train and val CharDatasets, with a clear error if either is too short."""
    tokens = torch.from_numpy(tokenizer.encode_array(text))
    n_val = int(len(tokens) * cfg.val_fraction)
    train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    for name, part in (("train", train), ("val", val)):
        if len(part) <= cfg.block_size:
            raise UserError(
                f"data file {source or '<embedded>'} is too short: its {name} split has "
                f"{len(part)} tokens of {len(tokens)}, but one sample needs block_size + 1 = "
                f"{cfg.block_size + 1}")
    return CharDataset(train, cfg.block_size), CharDataset(val, cfg.block_size)
