"""Corpora past 2^24 tokens: no index, position or count through float32.

float32 holds every integer only up to 2^24 = 16,777,216; a torch.linspace of
window starts over a larger split rounds some of them, past the end of the
corpus for the last (a 22M-token val split crashed the first evaluation). The
corpus here is written as uint8 shards in mode=prepare's format (cheap: no
tokenizing), 2^24 + 2^20 tokens in each split.
"""

import json

import numpy as np
import pytest
import torch

from harness import read_metrics, run_job
from char_dataset import CharDataset, eval_starts
from data.token_shards import FORMAT, INDEX, VERSION, TokenCorpus, shard_name

BIG = 2**24 + 2**20  # tokens per split: past float32's exact integers
CHARS = "".join(sorted("abcdefghijklmnopqrstuvwxyz \n.,"))  # a char tokenizer's state


def expected_starts(n_samples, global_batch, n_batches):
    """The evenly spaced starts, in exact integer arithmetic: floor(i (n-1) / (total-1))."""
    total = global_batch * n_batches
    return [i * (n_samples - 1) // max(total - 1, 1) for i in range(total)]


def write_big_corpus(root, tokens_per_split=BIG, shards=3):
    """A prepared corpus of uint8 token shards: both splits of `tokens_per_split`, the
    ids a repeating pattern (so every window is valid and windows differ)."""
    root.mkdir()
    total = 2 * tokens_per_split
    ids = (np.arange(total, dtype=np.int64) * 7 % len(CHARS)).astype(np.uint8)
    bounds = [k * total // shards for k in range(shards + 1)]  # integers: no float cut
    entries = []
    for k in range(shards):
        part = ids[bounds[k]:bounds[k + 1]]
        part.tofile(root / shard_name(k))
        entries.append({"file": shard_name(k), "tokens": int(len(part)), "max_token": int(part.max())})
    index = {"format": FORMAT, "version": VERSION,
             "tokenizer": {"kind": "char", "chars": CHARS}, "vocab_size": len(CHARS),
             "dtype": "uint8", "tokens": total,
             "split": {"val_fraction": 0.5, "train_tokens": tokens_per_split,
                       "val_tokens": tokens_per_split},
             "shards": entries, "inexact_cuts": 0, "request": {}, "id": "big"}
    (root / INDEX).write_text(json.dumps(index))
    return ids


def test_eval_windows_past_2_24_are_the_integer_formula():
    n = BIG - 8  # windows of a val split of BIG tokens, block 8
    got = eval_starts(n, 32, 4)
    assert got.dtype == torch.int64 and got.shape == (4, 32)
    assert got.reshape(-1).tolist() == expected_starts(n, 32, 4)
    assert int(got.max()) == n - 1  # the last window is the last one there is, not past it
    # float32 cannot: the same linspace rounds some starts (the bug this guards)
    floats = torch.linspace(0, n - 1, 128).long().tolist()
    assert floats != expected_starts(n, 32, 4)


def test_text_path_val_windows_past_2_24_read_the_right_tokens():
    """The text path's val set (a CharDataset over > 2^24 tokens): the evaluation's windows
    start where the formula says and hold those tokens."""
    tokens = torch.arange(BIG, dtype=torch.int64) % 251
    val = CharDataset(tokens, 8)
    starts = eval_starts(len(val), 16, 2)
    x, y = val.batch(starts.reshape(-1))
    want = torch.tensor(expected_starts(len(val), 16, 2))
    assert torch.equal(x[:, 0], tokens[want]) and torch.equal(y[:, -1], tokens[want + 8])


def test_prepared_corpus_past_2_24_trains_and_evaluates_on_2_ranks(tmp_path):
    """A 2-rank ddp_bucket run with evaluation on a corpus whose val split is past 2^24
    tokens (it crashed at the first evaluation), and the windows it evaluates are the
    integer formula's: their tokens, read through the corpus, match the ids written."""
    ids = write_big_corpus(tmp_path / "tokens")
    corpus = TokenCorpus(str(tmp_path / "tokens"))
    _, val = corpus.splits(8, len(CHARS))
    starts = eval_starts(len(val), 12, 2).reshape(-1)
    x, _ = val.batch(starts)
    want = np.array(expected_starts(len(val), 12, 2)) + BIG  # val follows train
    assert np.array_equal(x[:, 0].numpy(), ids[want])
    result = run_job(tmp_path / "job", 2, [
        f"data.tokens_path={tmp_path / 'tokens'}", "data.block_size=8", "parallel.dp=ddp_bucket",
        "trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_batches=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "job" / "runs" / "default")
    assert records[-1]["step"] == 2 and np.isfinite(records[-1]["val_loss"])
