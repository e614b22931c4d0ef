"""configs/shakespeare-char.yaml is nanoGPT's train_shakespeare_char configuration, and
`python -m bench.shakespeare_curve` reports the validation losses the runs really had:
ours against the same preset run directly, nanoGPT's against what a stand-in of its
train.py printed and was given (the suite has no nanoGPT checkout; the real one ran as
docs/benchmarks.md says)."""

import pytest
import json
import os
import subprocess
import sys
import textwrap
import time

from char_dataset import embedded_corpus
from config import load_config
from harness import REPO, job_env, read_metrics, run_job

PRESET = os.path.join(REPO, "configs", "shakespeare-char.yaml")

pytestmark = pytest.mark.long  # the long tier (tests/README.md): a benchmark command's own test


def test_preset_is_nanogpts_shakespeare_char():
    cfg = load_config([f"config={PRESET}", "trainer.device=cpu"], 1)
    m, d, t = cfg.model, cfg.data, cfg.trainer
    # nanoGPT's config/train_shakespeare_char.py, value by value
    assert (m.n_layer, m.n_head, m.n_embd, m.dropout, m.bias) == (6, 6, 384, 0.2, False)
    assert (d.block_size, d.tokenizer, d.val_fraction) == (256, "char", 0.1)
    assert (t.batch_size, t.grad_accum, t.max_steps, t.lr, t.min_lr) == (64, 1, 5000, 1e-3, 1e-4)
    assert (t.warmup_steps, t.beta2, t.eval_every, t.eval_batches) == (100, 0.99, 250, 200)
    assert t.precision == "fp32"  # auto, on a CPU


STAND_IN_TRAIN = '''
import json, os, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[2:])
with open(os.environ["STAND_IN_LOG"], "w") as f:
    json.dump({"argv": sys.argv[1:], "input": open("data/shakespeare_char/input.txt").read(),
               "prepared": os.path.exists("data/shakespeare_char/train.bin")}, f)
for step in range(0, int(args["max_iters"]) + 1, int(args["eval_interval"])):
    print(f"step {step}: train loss 9.0000, val loss {4 - step / 100:.4f}")
'''
STAND_IN_PREPARE = 'open("train.bin", "w").write("ids")\n'


def stand_in_nanogpt(root):
    """A checkout with nanoGPT's file names and command lines, not its code."""
    for path, text in {"train.py": STAND_IN_TRAIN, "model.py": "", "configurator.py": "",
                       "config/train_shakespeare_char.py": "",
                       "data/shakespeare_char/prepare.py": STAND_IN_PREPARE}.items():
        os.makedirs(os.path.dirname(root / path), exist_ok=True)
        (root / path).write_text(textwrap.dedent(text))
    return root


def test_curve_command_reports_both_runs_as_they_ran(tmp_path):
    text = tmp_path / "shakespeare.txt"
    text.write_text(embedded_corpus(60_000, seed=3))
    nanogpt = stand_in_nanogpt(tmp_path / "nanoGPT")
    out = tmp_path / "out"
    env = dict(job_env(forked=False), STAND_IN_LOG=str(tmp_path / "stand_in.json"))
    result = subprocess.run([sys.executable, "-m", "bench.shakespeare_curve", "--size=small",
                             f"--data={text}", f"--nanogpt={nanogpt}", f"--out={out}",
                             f"--rows={tmp_path / 'rows.tsv'}"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    runs = json.loads((out / "results.json").read_text())["runs"]

    # ours: exactly the validation losses of the preset run directly, same shape
    direct = run_job(tmp_path / "direct", 1, [
        f"config={PRESET}", f"data.path={text}", "trainer.device=cpu", "trainer.compile=false",
        "trainer.save_every=0", "wandb.mode=disabled", "sample.length=0", "model.n_layer=2",
        "model.n_head=2", "model.n_embd=64", "data.block_size=64", "trainer.batch_size=8",
        "trainer.max_steps=60", "trainer.eval_every=20", "trainer.eval_batches=4",
        "trainer.warmup_steps=10", "model.dropout=0.2", f"trainer.run_dir={tmp_path / 'direct' / 'run'}"], tiny=False)
    assert direct.returncode == 0, direct.stderr[-3000:]
    expected = [[r["step"], r["val_loss"]] for r in read_metrics(tmp_path / "direct" / "run")
                if "val_loss" in r]
    assert [s for s, _ in expected] == [20, 40, 60]
    assert runs["ours"]["curve"] == expected  # one machine, one thread: bitwise
    assert runs["ours"]["best"] == min(v for _, v in expected)
    assert runs["ours"]["last"] == expected[-1][1]

    # nanoGPT's: what its train.py printed, given the same shape and its own data files
    assert runs["nanoGPT"]["curve"] == [[s, 4 - s / 100] for s in (0, 20, 40, 60)]
    given = json.loads((tmp_path / "stand_in.json").read_text())
    assert given["argv"][0] == "config/train_shakespeare_char.py" and given["prepared"]
    for arg in ("--n_layer=2", "--n_embd=64", "--block_size=64", "--batch_size=8",
                "--max_iters=60", "--lr_decay_iters=60", "--eval_iters=4", "--device=cpu",
                "--compile=False", "--dtype=float32", "--dropout=0.2"):
        assert arg in given["argv"], (arg, given["argv"])
    assert given["input"] == text.read_text()
    assert not (nanogpt / "data" / "shakespeare_char" / "input.txt").exists()  # a copy ran
    assert "| ours | fp32 |" in result.stdout
    # --rows: every validation point of both runs, as a line (ours first: it runs first)
    rows = [ln.split("\t")[:3] for ln in (tmp_path / "rows.tsv").read_text().splitlines()]
    assert rows == [["ours", str(s), f"{v:.4f}"] for s, v in expected] + [
        ["nanoGPT", str(s), f"{v:.4f}"] for s, v in runs["nanoGPT"]["curve"]]


def test_curve_command_refuses_a_folder_that_is_not_nanogpt(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(embedded_corpus(20_000, seed=3))
    result = subprocess.run([sys.executable, "-m", "bench.shakespeare_curve", "--size=small",
                             f"--data={text}", f"--nanogpt={tmp_path}", f"--out={tmp_path / 'o'}"],
                            cwd=REPO, env=job_env(forked=False), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert "no train.py; give a checkout of https://github.com/karpathy/nanoGPT" in result.stderr


def test_a_run_past_its_budget_is_stopped_and_its_points_so_far_kept(tmp_path):
    """--budget-s's mechanics (bench.shakespeare_curve.followed): a run that prints a
    validation point, another a second later, then hangs, given 3 s: both points reach
    --rows as they come (a second apart, before the stop), the run is stopped (its
    process group killed) at 3 s, not waited for, and its curve so far is reported, the
    table saying it was stopped. Red when the run is waited for, or the rows are written
    only at its end."""
    from bench import shakespeare_curve as curve_module
    script = ("import time\nprint('step 0: train loss 9.0, val loss 4.5000', flush=True)\ntime.sleep(1)\n"
              "print('step 250: train loss 2.0, val loss 2.2500', flush=True)\ntime.sleep(300)\n")
    seen, rows = [], tmp_path / "rows.tsv"

    def on_point(point):
        seen.append(time.monotonic())
        curve_module.row(str(rows), "nanoGPT", point)
    started = time.monotonic()
    seconds, _, points, cut = curve_module.followed(
        [sys.executable, "-c", script], tmp_path, str(tmp_path / "log"),
        lambda log: [(int(m[0]), float(m[2])) for m in curve_module.NANOGPT_STEP.findall(log)],
        3.0, on_point, poll_s=0.1)
    print(seconds, points, [t - started for t in seen])
    assert cut and points == [(0, 4.5), (250, 2.25)] and 3.0 <= seconds < 20
    assert seen[1] - seen[0] > 0.5 and seen[1] < started + 3.0  # each as it came
    assert [ln.split("\t")[:3] for ln in rows.read_text().splitlines()] == [
        ["nanoGPT", "0", "4.5000"], ["nanoGPT", "250", "2.2500"]]
    _, best = curve_module.tables({"nanoGPT": {"precision": "bfloat16", "curve": points, "seconds": seconds,
                                               "cut": True}}, "full")
    assert "| 2.2500 | 2.2500 |" in best[2] and "(stopped: --budget-s)" in best[2], best
