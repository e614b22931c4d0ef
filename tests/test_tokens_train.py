"""Training from prepared token shards in real jobs: `python main.py mode=prepare` with
worker processes, then a 2-rank torchrun run that must equal the text path's, resume
exactly under another layout, and stop with one line on every rank when a shard turns
out damaged mid-run, with the snapshot untouched."""

import shutil

import pytest

from char_dataset import embedded_corpus
from harness import assert_parity, read_metrics, run_job, run_metrics
from harness import our_frames
from test_bad_input import tree_bytes

COMMON = ["parallel.dp=ddp_bucket", "trainer.eval_every=3", "trainer.warmup_steps=0",
          "trainer.lr=0.003", "trainer.min_lr=0.003", "trainer.grad_clip=0"]
SAVED = ["trainer.save_every=3", "trainer.keep_snapshots=2"]  # snapshots at steps 3 and 6


@pytest.fixture(scope="module")
def shards_run(tmp_path_factory):
    """The embedded corpus prepared by 2 worker processes, and a 2-rank run on it
    that keeps its snapshots of steps 3 and 6: (root, tokens, text file, records)."""
    root = tmp_path_factory.mktemp("shards")
    text = root / "corpus.txt"
    text.write_text(embedded_corpus())
    tokens = root / "tokens"
    result = run_job(root / "prep", 1, ["mode=prepare", f"data.path={text}",
                                        f"data.tokens_path={tokens}", "prepare.workers=2",
                                        "prepare.chunk_mb=0.1"], tiny=False, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "in 6 shards of uint8" in result.stdout, result.stdout
    result = run_job(root / "run", 2, COMMON + SAVED + [f"data.tokens_path={tokens}"])
    assert result.returncode == 0, result.stderr[-3000:]
    return root, tokens, text, read_metrics(root / "run" / "runs" / "default")


def test_shards_train_as_the_text_does_and_resume_exactly(tmp_path, shards_run):
    root, tokens, text, from_shards = shards_run
    from_text = run_metrics(tmp_path, 2, COMMON + [f"data.path={text}"])
    for key in ("loss", "grad_norm", "val_loss"):  # the same windows: bitwise the same run
        assert [r.get(key) for r in from_shards] == [r.get(key) for r in from_text], key
    assert all(r["data_ms"] >= 0 for r in from_shards)
    # step 3's snapshot, resumed on one process from a copy of the shards
    shutil.copytree(tokens, tmp_path / "copy")
    shutil.copytree(root / "run" / "runs" / "default" / "snapshot", tmp_path / "snapshot")
    result = run_job(tmp_path / "resume", 1, [
        "parallel.dp=single", f"data.tokens_path={tmp_path / 'copy'}", "trainer.resume_step=3",
        f"trainer.snapshot_path={tmp_path / 'snapshot'}", *COMMON[1:]])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 3" in result.stdout
    resumed = read_metrics(tmp_path / "resume" / "runs" / "default")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert_parity(from_shards[3:], resumed)


def test_a_shard_damaged_mid_run_stops_every_rank_with_one_line(tmp_path, shards_run):
    """Step 8 (resumed at 6: read at the end of step 7) has a window rank 0 alone reads,
    damaged (ids past the vocabulary, the shard's size unchanged): rank 0 finds it, and
    rank 1, whose windows are fine, must stop too instead of waiting for rank 0 in the
    next collective."""
    from char_dataset import GlobalBatches
    from data.token_shards import TokenCorpus
    root, tokens, _, _ = shards_run
    shutil.copytree(tokens, tmp_path / "tokens")
    shutil.copytree(root / "run" / "runs" / "default" / "snapshot", tmp_path / "snapshot")
    corpus = TokenCorpus(str(tmp_path / "tokens"))
    train, _ = corpus.splits(16, 50)  # TINY: block 16, batch 12; seed 1337
    starts = GlobalBatches(len(train), 12, 1337).indices(7).tolist()  # 0-based: step 8
    mine, theirs = starts[0], starts[6:]  # rank 0 reads positions 0-5, rank 1 positions 6-11
    assert all(abs(mine - s) > 17 for s in theirs)
    shard = int((corpus.bounds <= mine).sum()) - 1
    path = tmp_path / "tokens" / corpus.files[shard]
    data = bytearray(path.read_bytes())
    at = mine + 5 - int(corpus.bounds[shard])
    data[at] = 0xFF
    path.write_bytes(bytes(data))
    before = tree_bytes(tmp_path / "snapshot")
    result = run_job(tmp_path / "job", 2, COMMON + [
        f"data.tokens_path={tmp_path / 'tokens'}", f"trainer.snapshot_path={tmp_path / 'snapshot'}",
        "trainer.max_steps=12"], timeout=120, fresh=True)
    assert "at step 6" in result.stdout and "step 7/12" in result.stdout, result.stdout
    assert result.returncode != 0 and not our_frames(result.stderr), result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error on rank")]
    assert sorted(ln[:15] for ln in lines) == ["error on rank 0", "error on rank 1"], result.stderr
    assert f"{path} holds token id 255, past the vocabulary of 50" in lines[[ln[:15] for ln in lines].index("error on rank 0")]
    assert tree_bytes(tmp_path / "snapshot") == before  # nothing overwritten, nothing lost
