"""The logged val_loss is the mean loss over every evaluation window, computed here from
the model itself (not compared with another run of the same trainer, which a fault in
Trainer.evaluate would shift alike)."""

import torch

from char_dataset import eval_starts, open_data
from checkpoint.canonical import load_named_parameters
from config import load_config
from harness import TINY, read_metrics, run_job, snapshot_model
from model import GPT, GPTConfig


def test_val_loss_is_the_mean_over_all_evaluation_windows(tmp_path):
    """2 ranks, ddp_bucket, grad_accum 2: each rank evaluates 2 micro-batches of each of
    2 global batches; the logged value must be the mean over all 48 windows."""
    overrides = ["parallel.dp=ddp_bucket", "trainer.grad_accum=2", "trainer.max_steps=3",
                 "trainer.eval_every=3", "trainer.eval_batches=2"]
    result = run_job(tmp_path, 2, overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = read_metrics(tmp_path / "runs" / "default")[-1]["val_loss"]

    cfg = load_config(TINY + overrides, 2)
    _, _, val = open_data(cfg.data)
    state = snapshot_model(tmp_path / "runs" / "default" / "snapshot")
    model = GPT(GPTConfig(**{k: getattr(cfg.model, k) for k in ("n_layer", "n_head", "n_embd",
                                                                 "dropout", "bias")},
                          vocab_size=state["transformer.wte.weight"].shape[0],
                          block_size=cfg.data.block_size))
    load_named_parameters(model, state)
    model.eval()
    starts = eval_starts(len(val), cfg.trainer.batch_size, cfg.trainer.eval_batches).reshape(-1)
    x, y = val.batch(starts)
    with torch.no_grad():
        _, direct = model(x, y)  # the mean over every token of every window
    print(f"logged val_loss {logged:.7f}, direct {direct.item():.7f}")
    assert abs(logged - direct.item()) <= 1e-5 * abs(direct.item())
