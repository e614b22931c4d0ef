"""configs/gpt2-124m.yaml stays GPT-2 small and stays runnable: its values checked
in process, then its own first steps on CPU (prepare, then train) with only the
sizes scaled down by overrides, on a small BPE in GPT-2's format (no network)."""

import os

import torch

from char_dataset import embedded_corpus
from config import load_config
from harness import REPO, read_metrics, run_job, tiny_gpt2_cache
from data.prepare import prepare

PRESET = "config=" + os.path.join(REPO, "configs", "gpt2-124m.yaml")


def test_preset_is_gpt2_small():
    from dataclasses import asdict
    from model import GPT, GPTConfig
    cfg = load_config([PRESET, "trainer.grad_accum=5"], 8)  # 8 GPUs: micro-batches of 12
    m, d, t = cfg.model, cfg.data, cfg.trainer
    assert (m.n_layer, m.n_head, m.n_embd, d.block_size, d.tokenizer) == (12, 12, 768, 1024, "gpt2")
    assert t.batch_size * d.block_size == 491_520  # ~0.5M tokens per step
    assert (t.lr, t.min_lr, t.warmup_steps, t.max_steps) == (6e-4, 6e-5, 2000, 600_000)
    assert (t.beta1, t.beta2, t.weight_decay, t.grad_clip) == (0.9, 0.95, 0.1, 1.0)
    assert d.tokens_path and t.batch_size % (8 * t.grad_accum) == 0
    with torch.device("meta"):
        model = GPT(GPTConfig(**asdict(m), vocab_size=50257, block_size=d.block_size))
    assert round(model.num_params() / 1e6, 1) == 124.4  # the canonical model: real rows only
    assert m.vocab_pad_to == 64 and model.transformer.wte.weight.shape == (50304, 768)
    from omegaconf import OmegaConf
    assert OmegaConf.load(PRESET.split("=", 1)[1]).trainer.precision == "auto"  # bf16 on a GPU with it
    assert load_config([PRESET, "trainer.device=cpu"], 1).trainer.precision == "fp32"


SCALED = ["model.n_layer=1", "model.n_embd=48", "data.block_size=32", "trainer.batch_size=4",
          "trainer.grad_accum=2", "trainer.max_steps=3", "trainer.eval_every=3",
          "trainer.eval_batches=1", "trainer.log_every=1", "sample.length=8",
          "wandb.mode=disabled", "parallel.timeout_s=60", "trainer.device=cpu"]


def test_preset_trains_its_first_steps_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", tiny_gpt2_cache(tmp_path / "tiktoken"))
    text = tmp_path / "corpus"
    text.mkdir()
    (text / "a.txt").write_text(embedded_corpus(40_000, seed=1))
    (text / "b.txt").write_text(embedded_corpus(40_000, seed=2))
    tokens = f"data.tokens_path={tmp_path / 'tokens'}"
    prepare(load_config([PRESET, "mode=prepare", f"data.path={text}/*.txt", tokens,
                         "data.val_fraction=0.1", "prepare.workers=1"], 1))  # in process: quicker
    result = run_job(tmp_path / "job", 1, [PRESET, tokens] + SCALED, tiny=False, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "job" / "runs" / "gpt2-124m")
    assert [r["step"] for r in records] == [1, 2, 3] and "val_loss" in records[-1]
    assert records[0]["lr"] == 6e-4 / 2000  # the preset's warm-up, step 1 of 2000
    assert "---- sample ----" in result.stdout
