"""scripts/gpu_smoke.sh, the first command to run on a GPU node, runs here with --cpu:
its 2-process tier through main.py on gloo at tiny sizes, each row against `single`;
it must print its table with every layout passing and exit 0 (and it exits 1 on any
difference, crash or hang: seen by breaking a strategy on purpose, docs/testing-layouts.md).
Every row of every tier (2, 4, 8 GPUs and two nodes) passes main.py's config checks
at both sizes; a worker that hangs on purpose is killed with its whole job and the
row reruns with the backends' debug output; the table's columns (replicas,
determinism, the kill-and-resume row, PyTorch's references) are checked on fake job
directories, in process."""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess

import pytest

from config import load_config
from harness import REPO, job_env, run_tree

TIERS = {
    "1": ["single", "single-ddp_bucket", "single-fsdp3", "single-fsdp3-offload",
          "single-fsdp3-offload-fp16", "single-torch_fsdp-offload", "single-bf16", "single-fp16",
          "single-recompute", "single-recompute-selective", "single-compile", "single-profile", "single-kill-resume",
          "single-dropout"],
    "2": ["ddp_naive", "ddp_bucket", "ddp_bucket-ring", "torch_ddp", "fsdp1", "fsdp2",
          "fsdp3-prefetch", "fsdp3-noprefetch", "torch_fsdp", "tp2", "tp2-torch", "tp2-sp",
          "pp2-gpipe", "pp2-1f1b", "pp2-interleaved-v2", "pp2-zb1p", "pp2-zbv", "cp2",
          "cp2-allgather", "ddp_bucket-fp16", "ddp_bucket-bf16", "tp2-sp-bf16", "pp2-1f1b-bf16",
          "cp2-bf16", "ddp_bucket-reduce-bf16", "fsdp2-reduce-bf16", "ddp_bucket-recompute",
          "tp2-sp-recompute", "ddp_bucket-compile", "snapshot-kill-resume", "tp2-sp-dropout",
          "cp2-dropout"],
    "4": ["dp2-tp2", "dp2-tp2-fsdp1", "dp2-pp2", "dp2-cp2", "pp2-tp2", "cp2-tp2", "dp4-ddp_bucket",
          "dp4-torch_ddp", "dp4-fsdp3", "dp4-torch_fsdp", "tp4", "tp4-torch"],
    "8": ["dp2-pp2-tp2", "dp2-pp2-tp2-zbv", "dp2-cp2-tp2", "pp2-cp2-tp2", "dp2-pp2-tp2-bf16",
          "dp8-fsdp3", "dp8-torch_fsdp"],
    "2x8": ["dp2-pp2-cp2-tp2", "dp2-pp2-tp4", "dp16-ddp_bucket", "dp16-torch_ddp", "dp16-fsdp3",
            "dp16-torch_fsdp"],
}
MATRIX = [name for rows in TIERS.values() for name in rows]
PROCESSES = {"1": 1, "2": 2, "4": 4, "8": 8, "2x8": 16}
# run for real: the reference, a 2-rank layout and the bf16 tolerance (each layout of the
# matrix is at parity in its own tests; here the script, its table and its exit status are
# under test, and every row's arguments are checked in process below)
LAYOUTS = ["single", "pp2-zbv", "ddp_bucket-bf16"]


def script_rows(*mode):
    script = os.path.join(REPO, "scripts", "gpu_smoke.sh")
    listed = subprocess.run(["bash", script, *mode, "--list"], capture_output=True, text=True,
                            check=True, env=job_env()).stdout.splitlines()
    return [row.split("|") for row in listed]


def test_the_matrix_names_every_layout():
    """The script's matrix is the one listed here, tier by tier (a renamed or dropped row
    shows), and every path the issue names has a row."""
    rows = script_rows()
    tiers = {}
    for tier, name, nproc, _ in rows:
        tiers.setdefault(tier, []).append(name)
        assert int(nproc) == PROCESSES[tier], (name, nproc)
    assert tiers == TIERS
    args = {name: a for _, name, _, a in rows}
    for name, keys in {"fsdp1": "zero_stage=1", "fsdp2": "zero_stage=2", "fsdp3-prefetch": "prefetch=true",
                       "fsdp3-noprefetch": "prefetch=false", "ddp_naive": "dp=ddp_naive",
                       "ddp_bucket-ring": "allreduce=ring", "ddp_bucket-fp16": "precision=fp16",
                       "tp2-sp-bf16": "precision=bf16", "pp2-1f1b-bf16": "precision=bf16",
                       "cp2-bf16": "precision=bf16", "ddp_bucket-reduce-bf16": "reduce_dtype=bf16",
                       "ddp_bucket-recompute": "activation_checkpointing=true",
                       "ddp_bucket-compile": "compile=true", "snapshot-kill-resume": "snapshot_async=true",
                       "cp2-allgather": "cp_impl=allgather", "cp2-dropout": "dropout=0.1",
                       "torch_ddp": "dp=torch_ddp", "torch_fsdp": "dp=torch_fsdp",
                       "tp2-torch": "tp_impl=torch", "single-fsdp3": "zero_stage=3",
                       "single-fp16": "precision=fp16", "single-compile": "compile=true",
                       "single-profile": "memory_snapshot=true",
                       "single-kill-resume": "snapshot_async=true",
                       "single-fsdp3-offload": "offload=true",
                       "single-fsdp3-offload-fp16": "offload=true trainer.precision=fp16",
                       "single-torch_fsdp-offload": "dp=torch_fsdp parallel.offload=true"}.items():
        assert keys in args[name], (name, args[name])


@pytest.mark.parametrize("mode", [["--cpu"], []], ids=["cpu", "gpu"])
def test_every_row_is_a_layout_main_accepts(mode):
    """Each row's arguments, at both sizes (the GPU one too: a refused or misspelt row
    would first show on a GPU node), pass main.py's config checks for its process
    count, in every tier (16 processes for the two-node tier)."""
    rows = script_rows(*mode)
    assert [name for _, name, _, _ in rows] == MATRIX
    for tier, name, nproc, args in rows:
        cfg = load_config(args.split(), int(nproc))
        assert cfg.trainer.device == ("cpu" if mode else "cuda"), name


@pytest.mark.long  # the long tier: the GPU script's own run (tests/README.md)
def test_gpu_smoke_passes_on_cpu(tmp_path):
    script = os.path.join(REPO, "scripts", "gpu_smoke.sh")
    # a `python` first on PATH that fails: the script must run $PYTHON (job_env: the
    # interpreter running pytest), whatever PATH holds where the tests run
    decoy = tmp_path / "bin"
    decoy.mkdir()
    (decoy / "python").write_text('#!/bin/sh\necho "python from PATH, not \\$PYTHON" >&2; exit 3\n')
    (decoy / "python").chmod(0o755)
    env = dict(job_env(), TMPDIR=str(tmp_path),  # the jobs' directories go under tmp_path
               SMOKE_LAYOUTS=" ".join(LAYOUTS), PATH=f"{decoy}{os.pathsep}{os.environ['PATH']}",
               SMOKE_ROWS=str(tmp_path / "rows.txt"), SMOKE_TABLE=str(tmp_path / "table.txt"))
    result = run_tree(["bash", script, "--cpu"], 600, "gpu_smoke.sh --cpu", cwd=tmp_path, env=env)
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr[-3000:]}"
    # a device call's files: a line per row as it ended (single with its rerun), the table
    noted = (tmp_path / "rows.txt").read_text().splitlines()
    assert [ln.split("|")[:2] for ln in noted] == [["single", "exit 0, rerun exit 0"]] + [
        [name, "exit 0"] for name in LAYOUTS[1:]], noted
    assert (tmp_path / "table.txt").read_text() in out and "layouts pass" in (tmp_path / "table.txt").read_text()
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.split() and line.split()[0] in LAYOUTS}
    assert {name: line.split()[-1] for name, line in rows.items()} == \
        {name: "pass" for name in LAYOUTS}, out
    assert f"{len(LAYOUTS)} of {len(LAYOUTS)} layouts pass" in out, out
    # single ran twice (SMOKE_RERUN's default on CPU): bitwise the same; the 2-rank rows'
    # replicas (ddp_bucket's every parameter on both ranks) hold the same weights
    assert " bitwise " in rows["single"] and " equal (" in rows["ddp_bucket-bf16"], out
    assert "ran on cpu" in out, out


@pytest.mark.long  # the long tier: the GPU script's own run (tests/README.md)
def test_a_deadline_stops_starting_rows_and_each_row_is_written_as_it_ends(tmp_path):
    """SMOKE_DEADLINE (a device call's limit) of 4 s: the reference row's job, which hangs
    (a sitecustomize sleeps in every job's process), is killed when the deadline comes,
    not at SMOKE_JOB_TIMEOUT; no debug rerun and no further row starts; SMOKE_ROWS has a
    line for each, SMOKE_TABLE the table of what ran. Red when the deadline is ignored
    (the job waits its own 180 s) or a row's line waits for the table."""
    script = os.path.join(REPO, "scripts", "gpu_smoke.sh")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('SMOKE_JOB_TAG'):\n    time.sleep(300)\n")
    rows, table = tmp_path / "rows.txt", tmp_path / "table.txt"
    env = dict(job_env(), TMPDIR=str(tmp_path), SMOKE_LAYOUTS="single ddp_bucket", SMOKE_RERUN="",
               SMOKE_DEADLINE="4", SMOKE_ROWS=str(rows), SMOKE_TABLE=str(table), PYTHONPATH=str(hook))
    result = run_tree(["bash", script, "--cpu"], 170, "gpu_smoke.sh --cpu", cwd=tmp_path, env=env)
    out = result.stdout
    print(out)
    assert re.fullmatch(r"single\|exit 124\|[3-9] s\nddp_bucket\|not run: SMOKE_DEADLINE 4 s\|0 s\n",
                        rows.read_text()), rows.read_text()
    assert "not run, SMOKE_DEADLINE 4 s reached: ddp_bucket" in out and "debug" not in out, out
    assert result.returncode == 1 and "0 of 1 layouts pass" in table.read_text(), out
    assert "killed after 4s" in table.read_text(), table.read_text()


def hang_hook(directory):
    """A sitecustomize.py that makes rank SMOKE_HANG_RANK of a torchrun job hang at start
    (ignoring SIGTERM, as a worker stuck in a collective may) and say so in a file (written
    whole, then named hung-<pid>: the job's deadline comes once that name shows)."""
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(
        "import os, signal, time\n"
        "if 'TORCHELASTIC_RUN_ID' in os.environ and os.environ.get('RANK') == os.environ.get('SMOKE_HANG_RANK'):\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "    mark = os.path.join(os.environ['SMOKE_HANG_DIR'], f'hung-{os.getpid()}')\n"
        "    with open(mark + '.tmp', 'w') as f:\n"
        "        f.write(os.environ.get('NCCL_DEBUG', '-') + ' ' + os.environ.get('TORCH_DISTRIBUTED_DEBUG', '-'))\n"
        "    os.rename(mark + '.tmp', mark)\n"
        "    while True:\n"
        "        time.sleep(3600)\n")


def deadline_at_the_hang(directory, marks, deadline):
    """A `sleep` first on PATH for gpu_smoke.sh, whose job deadline is a background
    `sleep $SMOKE_JOB_TIMEOUT`: this one ends as soon as a worker has newly hung (one more
    hung-<pid> in `marks`), else after `deadline` seconds as the real one would; any other
    sleep is the real one. So a hung row costs no fixed wait, while the deadline stays long
    enough for the reference row on a loaded machine."""
    real = shutil.which("sleep")
    directory.mkdir()
    hung = f"ls {shlex.quote(str(marks))} | grep -c -v '[.]tmp$'"
    (directory / "sleep").write_text(
        "#!/bin/sh\n"
        f'[ "$*" = "{deadline}" ] || exec {real} "$@"\n'
        f"before=$({hung}); waited=0\n"
        f'while [ "$({hung})" -le "$before" ] && [ $waited -lt {deadline * 10} ]; do\n'
        f"  {real} 0.1; waited=$((waited + 1))\n"
        "done\n")
    (directory / "sleep").chmod(0o755)


@pytest.mark.long  # the long tier: the GPU script's own run (tests/README.md)
def test_a_hung_worker_is_killed_with_its_job_and_the_row_reruns_with_debug_output(tmp_path):
    """Rank 1 of the ddp_bucket row hangs on purpose (ignoring SIGTERM). The job's
    deadline must kill every process of the job: torchrun starts each worker in a session
    of its own, and `timeout -k` (the old way) killed torchrun and left the worker
    holding its GPU. The row is then run once more with NCCL_DEBUG=WARN and
    TORCH_DISTRIBUTED_DEBUG=DETAIL (it hangs again, and is killed again), its logs kept."""
    from launch.process_tree import alive
    script = os.path.join(REPO, "scripts", "gpu_smoke.sh")
    hook, marks, timer = tmp_path / "hook", tmp_path / "hung", tmp_path / "timer"
    hang_hook(hook)
    marks.mkdir()
    # the reference row's, long enough on a loaded machine: the hung rows' comes when they hang
    deadline = 600
    deadline_at_the_hang(timer, marks, deadline)
    env = dict(job_env(), TMPDIR=str(tmp_path), SMOKE_LAYOUTS="single ddp_bucket", SMOKE_RERUN="",
               SMOKE_JOB_TIMEOUT=str(deadline), PYTHONPATH=str(hook), SMOKE_HANG_RANK="1",
               SMOKE_HANG_DIR=str(marks), PATH=f"{timer}{os.pathsep}{os.environ['PATH']}")
    result = run_tree(["bash", script, "--cpu"], 3 * deadline + 60, "gpu_smoke.sh --cpu",
                      cwd=tmp_path, env=env)
    hung = {int(p.name.split("-")[1]): p.read_text() for p in marks.iterdir()}
    alive = [pid for pid in hung if alive(pid)]
    for pid in alive:  # ours: left behind by the script, cleaned up here
        os.kill(pid, 9)
    out = result.stdout
    print(out, hung)
    assert not alive, f"hung workers {alive} outlived gpu_smoke.sh\n{out}"
    assert sorted(hung.values()) == ["- -", "WARN DETAIL"], hung  # the row, then its debug rerun
    rows = {line.split()[0]: line for line in out.split("\n----")[0].splitlines() if line.split()}
    assert result.returncode == 1 and rows["ddp_bucket"].endswith("FAIL: hung (timeout)"), out
    assert rows["single"].endswith("pass") and "rerun with NCCL_DEBUG=WARN" in out, out
    debug_log = re.search(r"NCCL flight recorder: (\S+/debug/log)", out).group(1)
    assert f"killed after {deadline}s" in open(debug_log).read()


def smoke_table():
    spec = importlib.util.spec_from_file_location(
        "smoke_table", os.path.join(REPO, "scripts", "smoke_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_job(out, name, status, losses=(), ranks=None, ms=10.0, log=""):
    """What gpu_smoke.sh leaves for one layout: status, log, run/metrics.jsonl and (ranks)
    run/ranks.json."""
    os.makedirs(os.path.join(out, name, "run"))
    with open(os.path.join(out, name, "status"), "w") as f:
        f.write(f"{status}\n")
    with open(os.path.join(out, name, "log"), "w") as f:
        f.write(f"{name} started\n{log}last words of {name}\n")
    if losses:
        with open(os.path.join(out, name, "run", "metrics.jsonl"), "w") as f:
            for step, loss in enumerate(losses, 1):
                f.write(json.dumps({"step": step, "loss": loss, "grad_norm": 1.5,
                                    "step_ms": ms + step, "peak_mem_mb": 64.0}) + "\n")
    if ranks is not None:
        with open(os.path.join(out, name, "run", "ranks.json"), "w") as f:
            json.dump(ranks, f)


def ranks_json(n=2, differ=(), digest="d1", model="NVIDIA H100 80GB HBM3"):
    return {"ranks": [{"rank": r, "device_name": model, "peak_mem_mb": 100.0 + r} for r in range(n)],
            "replicas_checked": 12, "replicas_equal": not differ, "replicas_differ": list(differ),
            "weights_digest": digest}


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


def test_the_table_checks_replicas_determinism_the_kill_and_resume_and_times_torch(tmp_path, capsys):
    """The columns past parity, in process on fake job directories: replicas that differ,
    a rerun that is not bitwise equal, a kill-and-resume row whose retrained step differs
    and one that passes, an own strategy timed against PyTorch's, and the line saying which
    GPU model ran which rows."""
    out = str(tmp_path)
    losses = [4.0, 3.5, 3.0]
    fake_job(out, "single", 0, losses, ranks_json(1))
    fake_job(out, "ddp_bucket", 0, losses, ranks_json(), ms=10.0)
    fake_job(out, "torch_ddp", 0, losses, ranks_json(), ms=20.0)
    fake_job(out, "tp2", 0, losses, ranks_json(differ=["transformer.ln_f.weight[[0, 32]]"]))
    fake_job(out, "fsdp1", 0, losses, ranks_json())
    fake_job(os.path.join(out, "fsdp1"), "rerun", 0, [4.0, 3.5, 3.0000001], ranks_json())
    fake_job(os.path.join(out, "ddp_bucket"), "rerun", 0, losses, ranks_json())
    for name, retrained in (("kill-ok", 3.0), ("kill-bad", 3.1)):
        fake_job(out, name, 0, losses + [2.5], ranks_json(),
                 log="resuming from snapshot /x/snapshot at step 2\n")
        with open(os.path.join(out, name, "kill.json"), "w") as f:
            json.dump({"killed_running": 1, "logged_before_kill": 3}, f)
        with open(os.path.join(out, name, "killed.jsonl"), "w") as f:
            for step, loss in enumerate([4.0, 3.5, retrained], 1):
                f.write(json.dumps({"step": step, "loss": loss, "grad_norm": 1.5}) + "\n")
    os.environ["SMOKE_SPEED_PAIRS"] = "ddp_bucket=torch_ddp"
    try:
        status = smoke_table().main(out, ["single:0", "ddp_bucket:1e-5", "torch_ddp:1e-5", "tp2:1e-5",
                                          "fsdp1:1e-5", "kill-ok:1e-5", "kill-bad:1e-5"])
    finally:
        del os.environ["SMOKE_SPEED_PAIRS"]
    printed = capsys.readouterr().out
    rows = {line.split()[0]: line for line in printed.split("\n----")[0].splitlines() if line.split()}
    assert status == 1, printed
    assert rows["ddp_bucket"].endswith("pass") and " 0.56x torch_ddp " in rows["ddp_bucket"], printed
    assert " bitwise " in rows["ddp_bucket"] and " equal (12) " in rows["ddp_bucket"], printed
    assert "100/101" in rows["ddp_bucket"], printed  # every rank's peak memory
    assert rows["tp2"].endswith("FAIL: replicas differ: transformer.ln_f.weight[[0, 32]]"), printed
    assert rows["fsdp1"].endswith("FAIL: not deterministic") and "DIFFERS: loss at step 3" in rows["fsdp1"]
    assert rows["kill-ok"].endswith("pass (killed at step 3, resumed from 2)"), printed
    assert rows["kill-bad"].endswith("FAIL: step 3 trained again differs"), printed
    assert "ran on NVIDIA H100 80GB HBM3: single (1), ddp_bucket (2)" in printed, printed
    assert "4 of 7 layouts pass" in printed, printed
