"""Config: typed schema, overrides, and one clear error for impossible values."""

import pytest

from config import load_config
from errors import UserError


def test_defaults_and_overrides():
    cfg = load_config(["trainer.max_steps=7", "model.n_layer=3", "parallel.dp=single"], 1)
    assert cfg.trainer.max_steps == 7 and cfg.model.n_layer == 3
    assert cfg.wandb.mode == "offline"  # never asks for a key by default


@pytest.mark.parametrize("overrides,world,message", [
    (["trainer.bogus=1"], 1, "bogus"),
    (["trainer.max_steps=many"], 1, "max_steps"),
    (["trainer.max_steps"], 1, "not key=value"),
    (["parallel.dp=warp_drive"], 1, "warp_drive"),
    (["parallel.dp=single"], 2, "one process"),
    (["parallel.tp=2"], 2, "not implemented yet"),
    (["parallel.pp=2"], 2, "not implemented yet"),
    (["trainer.batch_size=10"], 3, "divisible"),
    (["trainer.batch_size=8", "trainer.grad_accum=3"], 1, "divisible"),
    (["model.n_head=3"], 1, "n_embd"),
    (["wandb.mode=loud"], 1, "wandb.mode"),
    (["data.tokenizer=bytes"], 1, "tokenizer"),
    (["config=/nonexistent.yaml"], 1, "config file not found"),
    (["config=/"], 1, "cannot read config file"),
    (["trainer.eval_batches=0"], 1, "eval_batches"),
    (["trainer.beta2=1.5"], 1, "beta"),
    (["trainer.seed=-1"], 1, "seed"),
    (["trainer.run_dir="], 1, "run_dir"),
    (["sample.top_k=-3"], 1, "top_k"),
    (["parallel.timeout_s=inf"], 1, "timeout_s"),
    (["parallel.zero_stage=4"], 1, "zero_stage"),
    (["trainer.keep_snapshots=0"], 1, "keep_snapshots"),
    (["trainer.resume_step=0"], 1, "resume_step"),
])
def test_bad_config_is_one_clear_error(overrides, world, message):
    with pytest.raises(UserError, match=message):
        load_config(overrides, world)
