"""Stragglers are visible (telemetry/stragglers.py): at every logged step the rank the
others wait for, its busy time (step time less its waits in collectives) and the spread
over the median rank, in metrics.jsonl; nothing at the steps that are not logged.

Through main.py on 3 ranks (tests/straggler_worker.py) with rank 2 sleeping in every
block's forward, under ddp_bucket (waits in the bucket all-reduces) and fsdp ZeRO-3
(waits in every block's all-gather): rank 2 is named at every logged step, and its busy
time is well above the others'.
"""

import os

import pytest

from harness import REPO, TINY, job_env, python, read_metrics, run_tree


@pytest.mark.parametrize("layout", [["parallel.dp=ddp_bucket"],
                                    ["parallel.dp=fsdp", "parallel.zero_stage=3"]],
                         ids=["ddp_bucket", "fsdp3"])
def test_a_rank_slowed_on_purpose_is_named(tmp_path, layout):
    cmd = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           os.path.join(REPO, "tests", "straggler_worker.py"), "2", "40"] + TINY + layout + [
        "trainer.max_steps=6", "trainer.log_every=2", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.batch_size=12"]
    result = run_tree(cmd, 240, "straggler job", cwd=tmp_path, env=job_env(forked=False))
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    print([(r["step"], r["straggler_rank"], round(r["busy_spread"], 2)) for r in records])
    assert [r["step"] for r in records] == [2, 4, 6]
    assert all(r["straggler_rank"] == 2 for r in records), records
    # two blocks x 40 ms a micro-batch: the others wait about that long for rank 2
    assert all(r["straggler_busy_ms"] >= 60 and r["busy_spread"] > 1.5 for r in records), records
