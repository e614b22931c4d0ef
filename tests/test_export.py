"""mode=export (a snapshot of any layout -> a Hugging Face GPT-2 folder) and
model.init_from (such a folder -> the start of a run, under any layout).

transformers.GPT2LMHeadModel.from_pretrained(folder) must give our model's
logits on the same tokens; a round trip export -> init_from -> export is
bitwise identical; a run started from the folder under tp=2 trains the
losses of one started from it on one process.
"""

import json
import os
import shutil

import pytest
import torch

from harness import REPO, TINY, assert_parity, read_metrics, run_job

from checkpoint import hf_gpt2
from config import load_config
from errors import UserError
from checkpoint.export import export, file_digest
from model import GPT, GPTConfig
from checkpoint.snapshot_reader import open_snapshot
from checkpoint.snapshot_writer import save_sharded

transformers = pytest.importorskip("transformers")  # a test-time dependency (requirements-dev.txt)


def our_model(snapshot_dir):
    reader = open_snapshot(str(snapshot_dir))
    model = GPT(GPTConfig(**reader.meta["gpt_config"])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.read_full(f"model/{name}"))
    return model


def export_to(snapshot_dir, out):
    cfg = load_config(["mode=export", f"export.path={out}", f"trainer.snapshot_path={snapshot_dir}"], 1)
    return export(cfg)


def assert_same_logits(snapshot_dir, folder):
    ours = our_model(snapshot_dir)
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(folder)).eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(ours.config.vocab_size, (3, ours.config.block_size), generator=gen)
    with torch.no_grad():
        a, b = ours(x)[0], hf(x).logits
    diff = (a - b).abs().max().item()
    print(f"max |logits ours - transformers| = {diff:.3g} (logits up to {a.abs().max().item():.3g})")
    assert diff <= 1e-5 * max(1.0, a.abs().max().item())


def write_snapshot(grid, path, gpt, tokenizer, seed=0):
    """A snapshot of a freshly initialised (or given) GPT, written in this process."""
    from parallel.config import ParallelConfig
    from parallel.parallelize import parallelize
    from training.config import TrainerConfig
    torch.manual_seed(seed)
    model = gpt if isinstance(gpt, GPT) else GPT(GPTConfig(**gpt))
    if not isinstance(gpt, GPT):
        with torch.no_grad():  # large weights, biases too: activations of order 1, where
            for p in model.parameters():  # exact and tanh GELU differ, and every bias matters
                p.normal_(0, 0.5)
    strategy = parallelize(model, grid, ParallelConfig(dp="single"))
    strategy.configure_optimizer(TrainerConfig())
    from dataclasses import asdict
    save_sharded(str(path), grid, 1, strategy.shard_pieces(),
                 meta={"gpt_config": asdict(model.config), "tokenizer": tokenizer, "config": {}})


# ---------------------------------------------------------------- export

def test_export_of_a_sharded_snapshot_gives_our_logits_in_transformers(tmp_path):
    """tests/data/snapshot-v2: written by fsdp on 2 ranks (flat shards, previous format)."""
    snapshot = tmp_path / "snapshot"
    shutil.copytree(os.path.join(REPO, "tests", "data", "snapshot-v2"), snapshot)
    notes = export_to(snapshot, tmp_path / "hf")
    print("\n".join(notes))
    assert sorted(os.listdir(tmp_path / "hf")) == ["README.md", "config.json", "model.safetensors",
                                                  "vocab_char.json"]
    assert_same_logits(snapshot, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["activation_function"] == "gelu" and config["tie_word_embeddings"]
    assert "decode" in (tmp_path / "hf" / "README.md").read_text().lower()


def test_exported_readme_says_generation_stays_within_the_context():
    """The folder's README gives the context (block_size) a generation must stay within:
    past it the model has no position (transformers' generate runs off the table)."""
    from checkpoint.export import readme
    for kind in ("char", "gpt2"):
        text = readme(dict(n_layer=2, n_head=2, n_embd=16, vocab_size=11, block_size=8), kind)
        assert "The context is 8 tokens" in text and "must stay within 8" in text, text
        assert "max_length=8" in text, text


def test_export_without_biases_writes_zero_biases(one_rank_grid, tmp_path):
    gpt = dict(n_layer=2, n_head=2, n_embd=16, vocab_size=11, block_size=8, dropout=0.0, bias=False)
    write_snapshot(one_rank_grid, tmp_path / "snapshot", gpt, {"kind": "char", "chars": "abcdefghijk"})
    export_to(tmp_path / "snapshot", tmp_path / "hf")
    assert_same_logits(tmp_path / "snapshot", tmp_path / "hf")
    tensors = hf_gpt2.read_safetensors(str(tmp_path / "hf" / "model.safetensors"))
    assert all(t.abs().max() == 0 for n, t in tensors.items() if n.endswith(".bias"))
    # and back into a bias=false model; a non-zero bias is refused with the reason
    state = hf_gpt2.from_hf(tensors, gpt, "DIR")
    assert not any(n.endswith(".bias") for n in state)
    tensors["transformer.h.0.mlp.c_fc.bias"][0] = 1.0
    with pytest.raises(UserError, match="c_fc.bias is not zero but model.bias=false"):
        hf_gpt2.from_hf(tensors, gpt, "DIR")


def test_gpt2_tokenizer_files_go_with_the_bpe_the_snapshot_was_trained_with(one_rank_grid, tmp_path,
                                                                            monkeypatch):
    """The folder's vocab.json / merges.txt are tiktoken's cached files only when they are
    the BPE the snapshot recorded (sha256); config.json carries that digest and the
    tokenizer's own end-of-text id, so model.init_from reads the data with the same BPE."""
    from harness import tiny_gpt2_cache
    import hashlib
    from data.tokenizer import GPT2_FILES, build_tokenizer, cache_gpt2_files, data_gym_files
    ours = tiny_gpt2_cache(tmp_path / "ours")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", ours)
    tok = build_tokenizer("gpt2")
    gpt = dict(n_layer=1, n_head=2, n_embd=4, vocab_size=tok.vocab_size, block_size=8, dropout=0.0,
               bias=True)
    write_snapshot(one_rank_grid, tmp_path / "snapshot", gpt, tok.state())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", cache_gpt2_files(tmp_path / "other",
                                                              data_gym_files(["zebra"])))
    notes = export_to(tmp_path / "snapshot", tmp_path / "bare")
    assert any("sha256 this snapshot was trained with" in n for n in notes), notes
    assert not (tmp_path / "bare" / "vocab.json").exists()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", ours)
    export_to(tmp_path / "snapshot", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == tok.eot == tok.vocab_size - 1
    assert config["mingpt_parallel"]["tokenizer_sha256"] == tok.state()["sha256"]
    hf, _, chars = hf_gpt2.read_folder(str(tmp_path / "hf"))
    assert hf_gpt2.tokenizer_state(hf, chars, "hf") == tok.state()
    for hf_name, tiktoken_name in [("vocab.json", "encoder.json"), ("merges.txt", "vocab.bpe")]:
        cached = os.path.join(ours, hashlib.sha1(GPT2_FILES[tiktoken_name][0].encode()).hexdigest())
        assert (tmp_path / "hf" / hf_name).read_bytes() == open(cached, "rb").read()
    # a GPT-2 folder from elsewhere (no mingpt_parallel): OpenAI's BPE, whose digest is known
    from data.tokenizer import files_sha256
    assert hf_gpt2.tokenizer_state({"vocab_size": 50257}, None, "x") == \
        {"kind": "gpt2", "sha256": files_sha256(None)}


def test_export_into_a_used_place_or_a_bad_path_is_one_line(one_rank_grid, tmp_path):
    write_snapshot(one_rank_grid, tmp_path / "snapshot", dict(
        n_layer=1, n_head=2, n_embd=4, vocab_size=3, block_size=8, dropout=0.0, bias=True),
        {"kind": "char", "chars": "abc"})
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "vocab_char.json").write_text("{}")  # another export's leftovers
    (tmp_path / "a-file").write_text("x")
    for out, needle in [(tmp_path / "used", "not an empty directory"),
                        (tmp_path / "a-file", "not an empty directory"),
                        (tmp_path / "a-file" / "below", "cannot write export.path")]:
        with pytest.raises(UserError, match=needle):
            export_to(tmp_path / "snapshot", out)
    assert (tmp_path / "used" / "vocab_char.json").read_text() == "{}"


def test_a_damaged_init_from_folder_is_one_line(one_rank_grid, tmp_path):
    write_snapshot(one_rank_grid, tmp_path / "snapshot", dict(
        n_layer=1, n_head=2, n_embd=4, vocab_size=3, block_size=8, dropout=0.0, bias=True),
        {"kind": "char", "chars": "abc"})
    export_to(tmp_path / "snapshot", tmp_path / "hf")
    (tmp_path / "hf" / "vocab_char.json").write_text('{"letters": "abc"}')
    with pytest.raises(UserError, match="vocab_char.json is damaged"):
        hf_gpt2.read_folder(str(tmp_path / "hf"))
    weights = tmp_path / "hf" / "model.safetensors"
    data = weights.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [7, 7, 7]
    text = json.dumps(header).encode()
    weights.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    with pytest.raises(UserError, match="model.safetensors is not a readable safetensors file"):
        hf_gpt2.read_safetensors(str(weights))


def test_export_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(UserError, match="needs export.path"):
        load_config(["mode=export"], 1)
    with pytest.raises(UserError, match="no snapshot"):
        export_to(tmp_path / "nothing", tmp_path / "hf")


# ---------------------------------------------------------------- init_from, round trip

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 3-step run on one process, exported: (its run directory, the folder)."""
    base = tmp_path_factory.mktemp("exported")
    result = run_job(base / "trained", 1, ["parallel.dp=single", "trainer.max_steps=3"])
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = base / "trained" / "runs" / "default"
    export_to(run_dir / "snapshot", base / "hf1")
    return run_dir, base / "hf1"


def test_export_init_from_export_round_trip_is_bitwise(exported, one_rank_grid, tmp_path):
    """Folder 1 read with model.init_from's own functions, snapshotted, exported again:
    every file of folder 2 has folder 1's bytes."""
    run_dir, hf1 = exported
    hf, tensors, chars = hf_gpt2.read_folder(str(hf1))
    gpt = open_snapshot(str(run_dir / "snapshot")).meta["gpt_config"]
    hf_gpt2.check_config(hf, gpt, str(hf1))
    model = GPT(GPTConfig(**gpt))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in hf_gpt2.from_hf(tensors, gpt, str(hf1)).items():
            params[name].copy_(t)
    write_snapshot(one_rank_grid, tmp_path / "again", model, hf_gpt2.tokenizer_state(hf, chars, "hf1"))
    export_to(tmp_path / "again", tmp_path / "hf2")
    assert sorted(os.listdir(hf1)) == sorted(os.listdir(tmp_path / "hf2"))
    for name in sorted(os.listdir(hf1)):
        assert file_digest(str(hf1 / name)) == file_digest(str(tmp_path / "hf2" / name)), name


def test_init_from_under_tp_trains_like_single_and_its_snapshot_exports(exported, tmp_path):
    """Runs started from the folder on one process and under tp=2 (the shards cut from the
    loaded full model) train the same losses, from the trained weights; the tp=2 run's
    snapshot exports to transformers' logits too."""
    run_dir, hf1 = exported
    start = [f"model.init_from={hf1}", "trainer.max_steps=3", "parallel.dp=single"]
    one = run_job(tmp_path / "one", 1, start)
    tp2 = run_job(tmp_path / "tp2", 2, start + ["parallel.tp=2"])
    assert one.returncode == 0 and tp2.returncode == 0, one.stderr[-2000:] + tp2.stderr[-2000:]
    fresh = read_metrics(run_dir)
    got = read_metrics(tmp_path / "one" / "runs" / "default")
    assert_parity(got, read_metrics(tmp_path / "tp2" / "runs" / "default"))
    print(f"step 1 loss: from the folder {got[0]['loss']:.4f}, from scratch {fresh[0]['loss']:.4f}")
    assert got[0]["loss"] < fresh[0]["loss"] - 0.01, "the run must start from the folder's weights"
    snapshot = tmp_path / "tp2" / "runs" / "default" / "snapshot"
    export_to(snapshot, tmp_path / "hf3")
    assert_same_logits(snapshot, tmp_path / "hf3")


@pytest.mark.parametrize("overrides,needle", [
    (["model.n_layer=3"], "n_layer=2 (this run: model.n_layer = 3)"),
    (["data.tokenizer=gpt2"], "was trained with the char tokenizer: set data.tokenizer=char"),
    (["data.block_size=32"], "n_positions=16 < data.block_size=32"),
])
def test_init_from_a_folder_of_another_shape_is_one_clear_error(one_rank_grid, tmp_path, overrides, needle):
    gpt = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=0, block_size=16, dropout=0.0, bias=True)
    from char_dataset import load_text
    chars = "".join(sorted(set(load_text(""))))
    write_snapshot(one_rank_grid, tmp_path / "snapshot", {**gpt, "vocab_size": len(chars)},
                   {"kind": "char", "chars": chars})
    export_to(tmp_path / "snapshot", tmp_path / "hf")
    import main
    cfg = load_config(TINY + [f"model.init_from={tmp_path / 'hf'}", f"trainer.run_dir={tmp_path / 'run'}",
                              "parallel.dp=single"] + overrides, 1)
    with pytest.raises(UserError) as e:
        main.read_inputs(cfg, True)
    assert needle in str(e.value), str(e.value)


def test_init_from_reads_prepared_tokens_only_of_its_own_tokenizer(one_rank_grid, tmp_path):
    """model.init_from with data.tokens_path: the folder's tokenizer must be the corpus's."""
    import main
    from data import prepare
    text = tmp_path / "t.txt"
    text.write_text("abcab cabba " * 400)
    prepare.prepare(load_config([f"data.path={text}", f"data.tokens_path={tmp_path / 'tok'}",
                                 "mode=prepare", "prepare.workers=1"], 1))
    for chars, fits in [(" abc", True), (" abd", False)]:
        write_snapshot(one_rank_grid, tmp_path / f"snap{chars}", dict(
            n_layer=1, n_head=2, n_embd=4, vocab_size=4, block_size=8, dropout=0.0, bias=True),
            {"kind": "char", "chars": chars})
        export_to(tmp_path / f"snap{chars}", tmp_path / f"hf{chars}")
        cfg = load_config(TINY + [f"model.init_from={tmp_path / f'hf{chars}'}", "parallel.dp=single",
                                  f"data.tokens_path={tmp_path / 'tok'}", "data.block_size=8",
                                  "model.n_layer=1", "model.n_head=2", "model.n_embd=4",
                                  f"trainer.run_dir={tmp_path / 'run'}"], 1)
        if fits:
            tokenizer = main.read_inputs(cfg, True)[1]
            assert tokenizer.state() == {"kind": "char", "chars": chars}
        else:
            with pytest.raises(UserError, match=r"prepared with the char \(4 characters\) tokenizer, "
                                                r"model.init_from=.* was trained with char"):
                main.read_inputs(cfg, True)
