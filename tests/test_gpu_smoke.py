"""scripts/gpu_smoke.sh, the first command to run on a GPU node, runs here with --cpu:
the same matrix of layouts through main.py on gloo at tiny sizes, each against
`single`; it must print its table with every layout passing and exit 0 (and it
exits 1 on any difference, crash or hang: seen by breaking a strategy on purpose,
docs/testing-layouts.md)."""

import importlib.util
import json
import os
import re
import subprocess

import pytest

from config import load_config
from harness import REPO, job_env, run_tree

MATRIX = ["single", "ddp_bucket", "ddp_bucket-ring", "fsdp3-prefetch", "tp2-sp", "pp2-gpipe",
          "pp2-1f1b", "pp2-interleaved-v2", "pp2-zb1p", "pp2-zbv", "ddp_bucket-bf16", "cp2"]
# run for real: the reference, a 2-rank layout and the bf16 tolerance (each layout of the
# matrix is at parity in its own tests; here the script, its table and its exit status are
# under test, and every row's arguments are checked in process below)
LAYOUTS = ["single", "pp2-zbv", "ddp_bucket-bf16"]


def test_the_matrix_names_every_layout():
    """The script's matrix is the one listed here (a renamed or dropped row shows)."""
    with open(os.path.join(REPO, "scripts", "gpu_smoke.sh")) as f:
        rows = re.findall(r'^  "([^|"]+)\|', f.read(), re.M)
    assert rows == MATRIX


@pytest.mark.parametrize("mode", [["--cpu"], []], ids=["cpu", "gpu"])
def test_every_row_is_a_layout_main_accepts(mode):
    """Each row's arguments, at both sizes (the GPU one too: a refused or misspelt row
    would first show on a GPU node), pass main.py's config checks for its process count."""
    script = os.path.join(REPO, "scripts", "gpu_smoke.sh")
    listed = subprocess.run(["bash", script, *mode, "--list"], capture_output=True, text=True,
                            check=True, env=job_env()).stdout.splitlines()
    assert [row.split("|")[0] for row in listed] == MATRIX
    for row in listed:
        name, nproc, args = row.split("|")
        cfg = load_config(args.split(), int(nproc))
        assert cfg.trainer.device == ("cpu" if mode else "cuda"), name


def test_gpu_smoke_passes_on_cpu(tmp_path):
    script = os.path.join(REPO, "scripts", "gpu_smoke.sh")
    # a `python` first on PATH that fails: the script must run $PYTHON (job_env: the
    # interpreter running pytest), whatever PATH holds where the tests run
    decoy = tmp_path / "bin"
    decoy.mkdir()
    (decoy / "python").write_text('#!/bin/sh\necho "python from PATH, not \\$PYTHON" >&2; exit 3\n')
    (decoy / "python").chmod(0o755)
    env = dict(job_env(), TMPDIR=str(tmp_path),  # the jobs' directories go under tmp_path
               SMOKE_LAYOUTS=" ".join(LAYOUTS), PATH=f"{decoy}{os.pathsep}{os.environ['PATH']}")
    result = run_tree(["bash", script, "--cpu"], 600, "gpu_smoke.sh --cpu", cwd=tmp_path, env=env)
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr[-3000:]}"
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines()
            if line.split() and line.split()[0] in LAYOUTS}
    assert rows == {name: "pass" for name in LAYOUTS}, out
    assert f"{len(LAYOUTS)} of {len(LAYOUTS)} layouts pass" in out, out


def smoke_table():
    spec = importlib.util.spec_from_file_location(
        "smoke_table", os.path.join(REPO, "scripts", "smoke_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_job(out, name, status, losses=()):
    """What gpu_smoke.sh leaves for one layout: status, log, run/metrics.jsonl."""
    os.makedirs(os.path.join(out, name, "run"))
    with open(os.path.join(out, name, "status"), "w") as f:
        f.write(f"{status}\n")
    with open(os.path.join(out, name, "log"), "w") as f:
        f.write(f"{name} started\nlast words of {name}\n")
    if losses:
        with open(os.path.join(out, name, "run", "metrics.jsonl"), "w") as f:
            for step, loss in enumerate(losses):
                f.write(json.dumps({"step": step, "loss": loss, "grad_norm": 1.5,
                                    "step_ms": 10.0 + step, "peak_mem_mb": 64.0}) + "\n")


def test_the_table_fails_a_loss_difference_and_a_hang(tmp_path, capsys):
    """The failure path of gpu_smoke.sh, in process: a loss beyond tolerance and a job
    killed by its timeout (exit 124) are FAIL rows, their logs' last lines are printed,
    and the exit status is 1; a layout within tolerance still passes."""
    out = str(tmp_path)
    fake_job(out, "single", 0, [4.0, 3.5, 3.0])
    fake_job(out, "tp2-sp", 0, [4.0, 3.5, 3.0 * (1 + 1e-6)])
    fake_job(out, "ddp_bucket", 0, [4.0, 3.5, 3.0 * (1 + 1e-3)])
    fake_job(out, "pp2-gpipe", 124)
    status = smoke_table().main(out, ["single:0", "tp2-sp:1e-5", "ddp_bucket:1e-5", "pp2-gpipe:1e-5"])
    printed = capsys.readouterr().out
    table = printed.split("\n----")[0]  # the table, above the failed jobs' log tails
    rows = {line.split()[0]: line for line in table.splitlines() if line.split()}
    assert status == 1, printed
    assert rows["single"].endswith("pass") and rows["tp2-sp"].endswith("pass"), printed
    assert rows["ddp_bucket"].endswith("FAIL: > 1e-05") and " 0.001 " in rows["ddp_bucket"], printed
    assert rows["pp2-gpipe"].endswith("FAIL: hung (timeout)"), printed
    assert "last words of ddp_bucket" in printed and "last words of pp2-gpipe" in printed, printed
    assert "last words of tp2-sp" not in printed and "2 of 4 layouts pass" in printed, printed
