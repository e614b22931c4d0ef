"""In-process checks of the model and the data pipeline (no processes spawned)."""

import json

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


def offline(monkeypatch):
    """tiktoken without a network: a download raises, as it does offline."""
    def no_network(url):
        raise ConnectionError(f"cannot reach {url}")
    import tiktoken.load
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)


def test_gpt2_tokenizer_offline_error(tmp_path, monkeypatch):
    """The one line says where GPT-2's two files come from and what to name them."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty: nothing cached
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no Hugging Face cache either
    offline(monkeypatch)
    with pytest.raises(UserError) as e:
        build_tokenizer("gpt2", "text")
    message = str(e.value)
    print(message)
    assert "\n" not in message and "TIKTOKEN_CACHE_DIR" in message and "vocab.json" in message
    for url, sha, cached in [
        ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
         "1ce1664773c50f3e", "6d1cbeee0f20b3d9449abfede4726ed8212e3aee"),
        ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
         "196139668be63f3b", "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6")]:
        assert f"({url}, sha256 {sha}...) into TIKTOKEN_CACHE_DIR as {cached}" in message


def hugging_face_pair(directory):
    """The tiny BPE as Hugging Face keeps GPT-2's: vocab.json (here compact, UTF-8) and
    merges.txt (here without the last line break)."""
    from data.tokenizer import data_gym_files
    from harness import TINY_BPE_WORDS
    files = data_gym_files(TINY_BPE_WORDS)
    directory.mkdir(parents=True)
    (directory / "vocab.json").write_text(json.dumps(json.loads(files["encoder.json"]),
                                                     ensure_ascii=False, separators=(",", ":")))
    (directory / "merges.txt").write_bytes(files["vocab.bpe"].rstrip(b"\n"))
    return directory


@pytest.mark.parametrize("where", ["TIKTOKEN_CACHE_DIR", "Hugging Face's hub cache"])
def test_gpt2_tokenizer_takes_hugging_faces_vocab_json_and_merges_txt(tmp_path, monkeypatch, where):
    """Hugging Face's pair, in TIKTOKEN_CACHE_DIR or in its own hub cache (HF_HOME), is
    converted into tiktoken's cache: the same tokenizer as tiktoken's pair of the same
    BPE, its digest too (so tokens and snapshots of either agree), and no download."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", tiny_gpt2_cache(tmp_path / "tiktoken"))
    reference = build_tokenizer("gpt2")
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    if where == "TIKTOKEN_CACHE_DIR":
        hugging_face_pair(cache)
    else:
        hugging_face_pair(tmp_path / "hf" / "hub" / "models--gpt2" / "snapshots" / "0123abc")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    offline(monkeypatch)
    tok = build_tokenizer("gpt2")
    text = "KING: the river<|endoftext|> caf\u00e9 \U0001F600   the old crown"
    assert tok.state() == reference.state() and tok.vocab_size == reference.vocab_size
    assert tok.encode(text) == reference.encode(text) and tok.decode(tok.encode(text)) == text
    from data.tokenizer import GPT2_FILES, cache_name
    assert all((cache / cache_name(n)).is_file() for n in GPT2_FILES)  # tiktoken's names now


def test_prepared_gpt2_tokens_train_without_the_bpe_files(tmp_path, monkeypatch):
    """Training from data.tokens_path reads token ids: with sample.length=0 nothing is
    encoded or decoded, so the BPE files are not needed (main.read_inputs, every rank's
    set-up, with none here and no network); a prompt to encode needs them."""
    import main
    from config import load_config
    from data.prepare import prepare
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", tiny_gpt2_cache(tmp_path / "tiktoken"))
    (tmp_path / "a.txt").write_text(embedded_corpus(20_000))
    prepare(load_config(["mode=prepare", "data.path=a.txt", "data.tokens_path=tok",
                         "data.tokenizer=gpt2", "prepare.workers=1"], 1))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    offline(monkeypatch)
    run = ["data.tokens_path=tok", "data.tokenizer=gpt2", "data.block_size=16", "wandb.mode=disabled"]
    _, tokenizer, train_set, _, gpt, _ = main.read_inputs(load_config(run + ["sample.length=0"], 1), True)
    x, y = train_set.batch(torch.arange(4))
    assert gpt.vocab_size == tokenizer.vocab_size and x.shape == (4, 16) and x.max() < gpt.vocab_size
    with pytest.raises(UserError, match="GPT-2's BPE files are not here"):
        main.read_inputs(load_config(run + ["sample.length=10"], 1), True)


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
