"""python -m bench.gpu_vs_nanogpt end to end, against a stand-in nanoGPT checkout: the
suite has no network and needs nothing outside the repository, so tmp_path gets a
bench.py and configurator.py that take bench.py's `--key=value` options and print its
final line (a tiny model: fast), and our side runs at a tiny shape. The numbers the
command prints and records must be the runs' own, and the committed results must
render from their results.json as committed."""

import glob
import json
import os
import re
import shlex
from statistics import median
from types import SimpleNamespace

import pytest

from bench import gpu_vs_nanogpt as cmd_module
from harness import REPO, job_env, python, run_tree

# bench.py's option block and loop, the shape of karpathy/nanoGPT's (torch.cuda.synchronize
# included, unconditionally: the runner must make it a no-op without CUDA), on a model of
# one 8 x 8 matrix; it writes the options it got to argv.json and its last line to printed.txt
STAND_IN_BENCH = '''
import json, sys, time
import torch
batch_size = 12
block_size = 1024
bias = False
real_data = True
seed = 1337
device = 'cuda'
dtype = 'bfloat16'
compile = True
profile = False
exec(open('configurator.py').read())
with open('argv.json', 'a') as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
assert not real_data, "the stand-in has no openwebtext either"
torch.manual_seed(seed)
model = torch.nn.Linear(8, 8, bias=bias).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-2, betas=(0.9, 0.95))
x = torch.randn(batch_size * block_size, 8, device=device)
torch.cuda.synchronize()
for stage, num_steps in enumerate([10, 20]):
    t0 = time.time()
    for k in range(num_steps):
        loss = model(x).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"{k}/{num_steps} loss: {loss.item():.4f}")
    torch.cuda.synchronize()
    dt = time.time() - t0
    mfu = 1e9 * batch_size * block_size * num_steps / dt / 312e12   # any figure: it is parsed
    if stage == 1:
        print(f"time per iteration: {dt/num_steps*1000:.4f}ms, MFU: {mfu*100:.2f}%")
        with open('printed.txt', 'a') as f:
            f.write(f"time per iteration: {dt/num_steps*1000:.4f}ms, MFU: {mfu*100:.2f}%\\n")
'''

# the essence of nanoGPT's configurator: --key=value over bench.py's globals, types kept
STAND_IN_CONFIGURATOR = '''
import sys
from ast import literal_eval
for arg in sys.argv[1:]:
    assert arg.startswith('--') and '=' in arg, arg
    key, val = arg[2:].split('=')
    if key not in globals():
        raise ValueError(f"Unknown config key: {key}")
    try:
        attempt = literal_eval(val)
    except (SyntaxError, ValueError):
        attempt = val
    assert type(attempt) == type(globals()[key]), (key, attempt)
    globals()[key] = attempt
'''

# ours at its smallest: one 16-wide layer on 8 tokens (its 50304-row embedding and LM head stay)
TINY = ["--layers", "1", "--heads", "1", "--width", "16", "--block", "8", "--batch", "2"]
ROUNDS = 2

pytestmark = pytest.mark.long  # the long tier (tests/README.md): a benchmark command's own test


def stand_in_checkout(path):
    path.mkdir()
    (path / "bench.py").write_text(STAND_IN_BENCH)
    (path / "configurator.py").write_text(STAND_IN_CONFIGURATOR)
    (path / "model.py").write_text("# the stand-in's bench.py needs no model of its own\n")
    return path


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One run of the command: (checkout, out, stdout, results.json, results.md)."""
    tmp = tmp_path_factory.mktemp("nanogpt")
    checkout, out = stand_in_checkout(tmp / "nanoGPT"), tmp / "out"
    cmd = [python(), "-m", "bench.gpu_vs_nanogpt", "--nanogpt", str(checkout), *TINY,
           "--rounds", str(ROUNDS), "--threads", "1", "--out", str(out), "--rows", str(tmp / "rows.jsonl")]
    result = run_tree(cmd, 240, "bench.gpu_vs_nanogpt", cwd=REPO, env=job_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return (checkout, out, result.stdout, json.loads((out / "results.json").read_text()),
            (out / "results.md").read_text())


def test_both_sides_run_alternately_at_the_shape_asked(bench_run):
    checkout, out, stdout, doc, md = bench_run
    got = [json.loads(line) for line in (checkout / "argv.json").read_text().splitlines()]
    assert got == [doc["nanogpt_args"]] * ROUNDS   # bench.py ran once a round, with these options
    assert {"--batch_size=2", "--block_size=8", "--real_data=False", "--device=cpu",
            "--dtype=float32", "--compile=False"} <= set(got[0])
    # the printed progress alternates: nanoGPT, ours, nanoGPT, ours
    sides = re.findall(r"^round (\d)/\d (nanoGPT|ours)", stdout, re.M)
    assert sides == [(str(r), s) for r in range(1, ROUNDS + 1) for s in ("nanoGPT", "ours")]
    keys = dict(o.split("=", 1) for o in doc["our_overrides"])
    assert (keys["model.n_layer"], keys["model.n_embd"], keys["data.block_size"],
            keys["trainer.batch_size"], keys["model.vocab_pad_to"]) == ("1", "16", "8", "2", "50304")
    assert keys["trainer.grad_clip"] == "0" and keys["trainer.lr"] == keys["trainer.min_lr"]
    assert "**shapes differ**" in md   # --layers/--width shrank ours only


def test_figures_are_the_runs_own(bench_run):
    """tokens/s from each side's time per iteration, the ratio ours/theirs within each
    round, the summary their median and range, our MFU the formula's."""
    checkout, _, stdout, doc, md = bench_run
    s, tokens = doc["settings"], 2 * 8
    theirs_lines = (checkout / "printed.txt").read_text().splitlines()
    fpt = {side: cmd_module.flops_per_token(s, s[f"{side}_shape"]) for side in ("nanogpt", "ours")}
    for r in doc["rounds"]:
        theirs, ours = r["nanogpt"], r["ours"]
        printed = theirs_lines[r["round"] - 1]   # bench.py's last line of this round
        assert theirs["ms_per_iter"] == float(re.findall(r"iteration: ([0-9.]+)ms", printed)[0])
        assert theirs["tokens_per_s"] == pytest.approx(tokens * 1000 / theirs["ms_per_iter"], rel=1e-4)
        # bench.py's own MFU is kept as printed; both sides' are the one formula's (each its shape)
        assert theirs["mfu_pct"] == float(re.findall(r"MFU: ([0-9.]+)%", printed)[0])
        assert theirs["mfu_a100_pct"] == pytest.approx(100 * fpt["nanogpt"] * theirs["tokens_per_s"] / 312e12,
                                                       rel=1e-6)
        timed = [rec["step_ms"] for rec in ours["records"][10:]]
        assert len(ours["records"]) == 30 and len(timed) == 20
        assert ours["ms_per_iter"] == pytest.approx(sum(timed) / 20, rel=1e-4)
        assert ours["tokens_per_s"] == pytest.approx(tokens * 1000 / ours["ms_per_iter"], rel=1e-4)
        assert ours["mfu_a100_pct"] == pytest.approx(100 * fpt["ours"] * ours["tokens_per_s"] / 312e12,
                                                     rel=1e-6)
        assert r["ratio"] == pytest.approx(ours["tokens_per_s"] / theirs["tokens_per_s"], rel=1e-3)
        assert theirs["mfu_device_pct"] is None and ours["mfu_device_pct"] is None  # a CPU has no peak
    summ = doc["summary"]
    ratios = [r["ratio"] for r in doc["rounds"]]
    assert summ["rounds_ok"] == ROUNDS
    assert summ["ratio"] == {"median": median(ratios), "min": min(ratios), "max": max(ratios)}
    for side in ("nanogpt", "ours"):
        assert summ[side]["tokens_per_s"]["median"] == median(r[side]["tokens_per_s"] for r in doc["rounds"])
    line = f"ours / nanoGPT tokens/s: **{summ['ratio']['median']:.3f}**"
    assert line in stdout and line in md      # printed, and in results.md
    for side in ("nanogpt", "ours"):          # both tokens/s and both MFUs, printed
        assert cmd_module.fmt(summ[side]["tokens_per_s"]["median"]) in stdout
        assert cmd_module.fmt_mfu(summ[side]["mfu_a100_pct"]["median"]) in stdout


def test_results_render_from_their_json(bench_run):
    _, _, _, doc, md = bench_run
    assert cmd_module.markdown(doc) == md


def test_each_run_is_a_row_of_rows_as_it_ends(bench_run):
    """--rows (a device call's file): one JSON line per run, in the order they ran, with
    the figures results.json holds."""
    checkout, _, _, doc, _ = bench_run
    rows = [json.loads(line) for line in (checkout.parent / "rows.jsonl").read_text().splitlines()]
    assert [(r["round"], r["side"]) for r in rows] == [
        (n, side) for n in range(1, ROUNDS + 1) for side in ("nanogpt", "ours")]
    for r in rows:
        assert r["tokens_per_s"] == doc["rounds"][r["round"] - 1][r["side"]]["tokens_per_s"]


class FakeRuns:
    """Both sides in process: each run takes 40 s on a fake clock; nanoGPT 10 ms an
    iteration, ours 20; ours raises in round `fail_round`. Records the timeouts given."""

    def __init__(self, monkeypatch, fail_round=None):
        from bench.run_engine import jobs
        self.now, self.timeouts, self.fail_round, self.round = 1000.0, [], fail_round, 0
        monkeypatch.setattr(cmd_module, "time", SimpleNamespace(monotonic=lambda: self.now))
        monkeypatch.setattr(cmd_module.nano, "run", self.nanogpt)
        monkeypatch.setattr(jobs, "run_job", self.ours)

    def nanogpt(self, path, args, threads, timeout, cache):
        self.round += 1
        self.now += 40
        self.timeouts.append(timeout)
        return {"returncode": 0, "seconds": 40, "ms_per_iter": 10.0, "mfu_pct": 1.0, "error": ""}

    def ours(self, ranks, threads, overrides, run_dir, timeout, cache):
        if self.round == self.fail_round:
            raise RuntimeError("the call's time ran out here")
        self.now += 40
        self.timeouts.append(timeout)
        return {"returncode": 0, "seconds": 40, "records": [{"step_ms": 20.0}] * 30, "error": ""}


def test_a_budget_starts_only_the_rounds_that_fit(tmp_path, monkeypatch):
    """--budget-s 100, rounds of 80 s (on a fake clock): round 1 runs, its runs given what
    is left of the budget as their timeouts (100 s, then 60 s); round 2 would end past the
    budget and is not started; the results hold round 1 and the exit status is 0. Red
    when the budget is ignored (3 rounds)."""
    runs = FakeRuns(monkeypatch)
    checkout = stand_in_checkout(tmp_path / "nanoGPT")
    code = cmd_module.main(["--nanogpt", str(checkout), *TINY, "--rounds", "3", "--threads", "1",
                            "--budget-s", "100", "--out", str(tmp_path / "out")])
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert code == 0 and [r["round"] for r in doc["rounds"]] == [1]
    assert runs.timeouts == [100, 60] and doc["summary"]["ratio"]["median"] == 0.5


def test_the_results_are_written_after_every_round(tmp_path, monkeypatch):
    """Ours fails hard in round 2 (a call killed there): results.json and results.md
    already hold round 1, --rows the three runs that ended. Red when the results are
    written only at the end."""
    FakeRuns(monkeypatch, fail_round=2)
    checkout = stand_in_checkout(tmp_path / "nanoGPT")
    with pytest.raises(RuntimeError):
        cmd_module.main(["--nanogpt", str(checkout), *TINY, "--rounds", "3", "--threads", "1",
                         "--out", str(tmp_path / "out"), "--rows", str(tmp_path / "rows.jsonl")])
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["round"] for r in doc["rounds"]] == [1] and "over 1 round(s)" in (tmp_path / "out" / "results.md").read_text()
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 3


def test_not_a_checkout_is_one_line_and_fails(tmp_path):
    (tmp_path / "bench.py").write_text("")  # bench.py but no model.py / configurator.py
    for path in (tmp_path, tmp_path / "missing"):
        result = run_tree([python(), "-m", "bench.gpu_vs_nanogpt", "--nanogpt", str(path)], 60,
                          "bench.gpu_vs_nanogpt", cwd=REPO, env=job_env())
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.count("\n") == 1 and "nanoGPT" in result.stderr, result.stderr


COMMITTED = sorted(glob.glob(os.path.join(REPO, "docs", "bench", "gpu-vs-nanogpt", "*", "results.json")))


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: os.path.basename(os.path.dirname(p)))
def test_committed_results_render_as_committed(path):
    """A committed run's results.md is its results.json rendered by today's code, and its
    command names the checkout by a placeholder, not a directory of one machine."""
    doc = json.loads(open(path).read())
    assert cmd_module.markdown(doc) == open(os.path.join(os.path.dirname(path), "results.md")).read()
    argv = shlex.split(doc["command"])
    assert argv[argv.index("--nanogpt") + 1] == cmd_module.PLACEHOLDER
