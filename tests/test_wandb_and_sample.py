"""wandb offline logging continues the same run after a resume; mode=sample prints text."""

import glob

from harness import run_job
from checkpoint.snapshot_reader import open_snapshot


def test_wandb_offline_run_continues_after_resume(tmp_path):
    args = ["wandb.mode=offline", "trainer.max_steps=2", "sample.length=40"]
    first = run_job(tmp_path, 2, args)
    assert first.returncode == 0, first.stderr
    assert "---- sample ----" in first.stdout  # a sample after training
    run_dir = tmp_path / "runs" / "default"
    wandb_id = open_snapshot(str(run_dir / "snapshot")).meta["wandb_id"]
    second = run_job(tmp_path, 2, ["wandb.mode=offline", "trainer.max_steps=4", "sample.length=0"])
    assert second.returncode == 0, second.stderr
    assert open_snapshot(str(run_dir / "snapshot")).meta["wandb_id"] == wandb_id
    runs = glob.glob(str(run_dir / "wandb" / "offline-run-*"))
    assert len(runs) == 2 and all(r.endswith("-" + wandb_id) for r in runs), runs


def test_sample_mode_prints_generated_text(tmp_path):
    assert run_job(tmp_path, 1, ["parallel.dp=single", "trainer.max_steps=2"]).returncode == 0
    result = run_job(tmp_path, 1, ["mode=sample", "sample.prompt=KING:", "sample.length=50",
                                   "sample.temperature=0.5", "sample.top_k=5"])
    assert result.returncode == 0, result.stderr
    text = result.stdout.rstrip("\n")
    assert text.startswith("KING:") and len(text) == len("KING:") + 50


def test_sample_mode_without_snapshot_is_a_clear_error(tmp_path):
    result = run_job(tmp_path, 1, ["mode=sample"], fresh=True)
    assert result.returncode == 2 and "no snapshot at" in result.stderr
