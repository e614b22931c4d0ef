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

import hf_gpt2
from config import load_config
from errors import UserError
from export import export, file_digest
from model import GPT, GPTConfig
from snapshot import open_snapshot, save_sharded

transformers = pytest.importorskip("transformers")  # a test-time dependency (requirements.txt)


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
    from parallel.single import Single
    from trainer import TrainerConfig
    torch.manual_seed(seed)
    model = gpt if isinstance(gpt, GPT) else GPT(GPTConfig(**gpt))
    if not isinstance(gpt, GPT):
        with torch.no_grad():  # large weights, biases too: activations of order 1, where
            for p in model.parameters():  # exact and tanh GELU differ, and every bias matters
                p.normal_(0, 0.5)
    strategy = Single(model, grid, ParallelConfig(dp="single"))
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


def test_gpt2_tokenizer_files_are_copied_from_tiktokens_cache(one_rank_grid, tmp_path, monkeypatch):
    gpt = dict(n_layer=1, n_head=2, n_embd=4, vocab_size=50257, block_size=8, dropout=0.0, bias=True)
    write_snapshot(one_rank_grid, tmp_path / "snapshot", gpt, {"kind": "gpt2"})
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    notes = export_to(tmp_path / "snapshot", tmp_path / "bare")
    assert any("not in its cache" in n for n in notes) and not (tmp_path / "bare" / "vocab.json").exists()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6").write_text('{"stand-in": 0}')  # encoder.json
    (cache / "6d1cbeee0f20b3d9449abfede4726ed8212e3aee").write_text("#version: 0.2\n")  # vocab.bpe
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    export_to(tmp_path / "snapshot", tmp_path / "hf")
    assert (tmp_path / "hf" / "vocab.json").read_text() == '{"stand-in": 0}'
    assert (tmp_path / "hf" / "merges.txt").read_text() == "#version: 0.2\n"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 50256


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
        main.prepare(cfg, True)
    assert needle in str(e.value), str(e.value)
