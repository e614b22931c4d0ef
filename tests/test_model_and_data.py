"""In-process checks of the model and the data pipeline (no processes spawned)."""

import pytest
import torch

from char_dataset import (CharDataset, DataConfig, GlobalBatches, build_tokenizer,
                          embedded_corpus, eval_starts, load_text, split_tokens)
from errors import UserError
from harness import tiny_gpt2_cache
from model import GPT, GPTConfig


def tiny_gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=20, block_size=16, **kw))


def test_attention_is_causal():
    """Changing a future token must not change earlier logits (the tutorial's bug)."""
    model = tiny_gpt().eval()
    x = torch.randint(0, 20, (1, 16))
    y = x.clone()
    y[0, 10] = (x[0, 10] + 1) % 20
    a, _ = model(x)
    b, _ = model(y)
    assert torch.equal(a[0, :10], b[0, :10])
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_embedding_tied_and_named_once():
    model = tiny_gpt()
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    groups = model.optim_groups(0.1)
    assert sorted(groups[0]["params"] + groups[1]["params"]) == sorted(names)
    assert all(dict(model.named_parameters())[n].dim() >= 2 for n in groups[0]["params"])


def test_generate_extends_prompt():
    model = tiny_gpt()
    out = model.generate(torch.zeros(1, 3, dtype=torch.long), 25, top_k=5,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 28) and torch.equal(out[0, :3], torch.zeros(3, dtype=torch.long))


def test_embedded_corpus_is_deterministic_and_default():
    assert embedded_corpus() == embedded_corpus() == load_text("")
    assert len(embedded_corpus()) > 100_000


def test_split_is_contiguous_and_deterministic():
    text = embedded_corpus(5_000)
    tok = build_tokenizer("char", text)
    cfg = DataConfig(block_size=8, val_fraction=0.1)
    train, val = split_tokens(text, tok, cfg, "x")
    assert torch.equal(torch.cat([train.tokens, val.tokens]), torch.tensor(tok.encode(text)))
    x, y = train.batch(torch.tensor([0, 5]))
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.shape == (2, 8)


def test_each_dp_rank_reads_its_own_share_of_the_global_batch():
    batches = GlobalBatches(n_samples=100, global_batch=12, seed=3)
    ds = CharDataset(torch.arange(120), block_size=4)
    per_rank = [batches.local_micro_batches(ds, 0, r, 3, 2) for r in range(3)]
    starts = torch.cat([x[:, 0] for rank in per_rank for x, _ in rank])
    assert torch.equal(starts.sort().values, batches.indices(0).sort().values)
    assert len(set(starts.tolist())) == 12  # every sample read once, by one rank


def test_sample_order_is_a_new_permutation_each_epoch_and_reproducible():
    batches = GlobalBatches(n_samples=100, global_batch=12, seed=3)
    epoch0 = torch.cat([batches.indices(s) for s in range(batches.steps_per_epoch)])
    epoch1 = torch.cat([batches.indices(s + batches.steps_per_epoch)
                        for s in range(batches.steps_per_epoch)])
    assert len(set(epoch0.tolist())) == len(epoch0)  # no window twice in an epoch
    assert not torch.equal(epoch0, epoch1)
    assert torch.equal(GlobalBatches(100, 12, 3).indices(9), batches.indices(9))  # reproducible
    assert not torch.equal(GlobalBatches(100, 12, 4).indices(0), batches.indices(0))


def test_eval_windows_fixed():
    a = eval_starts(50, 12, 3)
    assert a.shape == (3, 12) and int(a.max()) <= 49 and torch.equal(a, eval_starts(50, 12, 3))


@pytest.mark.parametrize("content,message", [
    (None, "data file not found"),
    (b"\xff\xfe bad bytes", "not UTF-8"),
])
def test_bad_data_files(tmp_path, content, message):
    path = tmp_path / "data.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=message) as e:
        load_text(str(path))
    assert str(path) in str(e.value)


def test_short_corpus_error():
    tok = build_tokenizer("char", "abc")
    with pytest.raises(UserError, match="too short"):
        split_tokens("abcabc", tok, DataConfig(block_size=8), "short.txt")


def test_gpt2_tokenizer_offline_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty: nothing cached

    def offline(url):  # what read_file_cached meets without a network, online or not
        raise ConnectionError(f"cannot reach {url}")
    import tiktoken.load
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    with pytest.raises(UserError, match="TIKTOKEN_CACHE_DIR"):
        build_tokenizer("gpt2", "text")


def test_gpt2_tokenizer_loads_tiktoken_cache_files(tmp_path, monkeypatch):
    """data.tokenizer=gpt2 through the code that loads GPT-2's own files, fed a small BPE
    in their format from a TIKTOKEN_CACHE_DIR: no network."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", tiny_gpt2_cache(tmp_path))
    tok = build_tokenizer("gpt2")
    text = "KING: the river<|endoftext|> caf\u00e9 \U0001F600"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok.encode_array(text).tolist() == ids
    assert tok.encode(" river") == [tok.enc.encode_single_token(b" river")]  # a merge applies
    assert tok.eot == tok.vocab_size - 1 and tok.eot not in ids  # special text stays text
    assert tok.state()["kind"] == "gpt2" and len(tok.state()["sha256"]) == 64
    with pytest.raises(UserError, match="not the ones") as e:
        build_tokenizer(None, saved={"kind": "gpt2", "sha256": "0" * 64})
    assert "\n" not in str(e.value)


def test_char_tokenizer_encodes_slice_by_slice(monkeypatch):
    from data import tokenizer
    monkeypatch.setattr(tokenizer, "SLICE", 7)
    text = embedded_corpus(2_000) + "caf\u00e9 \U0001F600"
    tok = build_tokenizer("char", text)
    assert tok.encode(text) == [tok.stoi[c] for c in text]
    assert tok.encode_array(text, dtype="uint8").dtype == "uint8"


def test_char_tokenizer_rejects_unknown_characters():
    tok = build_tokenizer(None, saved={"kind": "char", "chars": "abc"})
    assert tok.decode(tok.encode("cab")) == "cab"
    with pytest.raises(UserError, match="not in the vocabulary"):
        tok.encode("abz")
