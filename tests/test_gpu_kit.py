"""The device kit (scripts/gpu_kit.py) and a GPU session's device command
(scripts/gpu_session.sh), on a stand-in for the GPU machine, so that the first lent call
is not the first time they run.

The stand-in: the checkout as a call sends it (the tracked and untracked-not-ignored
files, no .git; the kit built in it first, from a git work tree, as here), a virtual
environment whose `python3` sees this Python's torch but not omegaconf, wandb or torchft
(a sitecustomize hides the system's copies: the image has none), a `python` on PATH that
fails (PYTHON unset), and the kit's wheel (omegaconf, repacked from the installed
copy: the suite has no network) installed by the device command itself into a folder on
PYTHONPATH, as there. The smoke part runs for real at one tiny row on the CPU (about 20
CPU-s: three interpreters); the other parts' commands are printed (GPU_SESSION_DRY=1)
and parsed by their programs' own argument parsers here.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from harness import REPO
from test_gpu_vs_nanogpt import stand_in_checkout
from test_shakespeare_curve import stand_in_nanogpt

# the image has no omegaconf, wandb or torchft: this Python's copies are hidden, the
# kit's (installed there into a folder on PYTHONPATH) are found
HIDE = '''
import importlib.machinery, os, site, sys
HIDDEN = {"omegaconf", "wandb", "torchft"}
SYSTEM = {os.path.realpath(p) for p in site.getsitepackages([sys.base_prefix])}

class NotInTheImage:
    def find_spec(self, name, path=None, target=None):
        if path is not None or name.partition(".")[0] not in HIDDEN:
            return None
        spec = importlib.machinery.PathFinder.find_spec(
            name, [p for p in sys.path if os.path.realpath(p or ".") not in SYSTEM])
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the GPU image)", name=name)
        return spec

sys.meta_path.insert(0, NotInTheImage())
'''
PART_S = 300

pytestmark = pytest.mark.long  # the long tier (tests/README.md): the device kit's stand-in run


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """(the checkout's copy with its kit, the virtual environment's bin, the kit's manifest)."""
    root = tmp_path_factory.mktemp("gpu-machine")
    copy = root / "checkout"
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, names):
        if os.path.isfile(os.path.join(REPO, name)):
            os.makedirs(copy / os.path.dirname(name), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), copy / name)
    nanogpt = stand_in_nanogpt(root / "nanoGPT")  # train.py and prepare.py: the curve's
    for path in stand_in_checkout(root / "bench-side").iterdir():  # bench.py: the side's
        shutil.copy(path, nanogpt / path.name)
    text = root / "tinyshakespeare.txt"
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40)
    git = ["git", "-c", "user.email=kit@test", "-c", "user.name=kit"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "the checkout"]):
        subprocess.run(git + cmd, cwd=copy, check=True, capture_output=True)
    built = subprocess.run([sys.executable, "scripts/gpu_kit.py", "--nanogpt", str(nanogpt),
                            "--text", str(text), "--wheels-from", "installed"],
                           cwd=copy, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    print(built.stdout)
    assert re.search(r"\d+\.\d+ MiB .* of 64 MiB", built.stdout), built.stdout
    shutil.rmtree(copy / ".git")  # the call's copy has none
    venv = root / "image"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, capture_output=True)
    site = subprocess.run([str(venv / "bin" / "python3"), "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(HIDE)
    real = os.path.realpath(venv / "bin" / "python3")  # python3 alone there (a link of its
    for name in ("python3", "python"):                   # own: the venv's is one to `python`);
        (venv / "bin" / name).unlink()                   # any other `python` fails:
    (venv / "bin" / "python3").symlink_to(real)
    decoy = venv / "no-python"
    decoy.mkdir()
    (decoy / "python").write_text('#!/bin/sh\necho "python: no such interpreter on the GPU image" >&2; exit 127\n')
    (decoy / "python").chmod(0o755)
    return copy, venv / "bin", json.loads((copy / "peers" / "kit.json").read_text())


def device_env(machine, tmp_path, **extra):
    """The device call's environment: its interpreter first on PATH, no PYTHON, $OUT."""
    _, bin_dir, _ = machine
    env = {k: v for k, v in os.environ.items() if k not in (
        "PYTHON", "PYTHONPATH", "FORK_SERVER_SOCKET", "PYTHON_EXEC", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PATH=os.pathsep.join([str(bin_dir), str(bin_dir.parent / "no-python"), env["PATH"]]),
               OUT=str(tmp_path / "out"),
               KIT_SITE=str(tmp_path / "site"), GPU_PART_S=str(PART_S), OMP_NUM_THREADS="1", **extra)
    return env


def test_the_stand_in_hides_the_packages_the_image_lacks(machine):
    """The stand-in is one: its python3 imports none of omegaconf, wandb, torchft (the
    image's PyYAML it does), so the device command must bring what it needs."""
    _, bin_dir, _ = machine
    probe = subprocess.run([str(bin_dir / "python3"), "-c", "import yaml\n"
                            "for m in ('omegaconf', 'wandb', 'torchft'):\n"
                            "    try:\n        __import__(m); print(m, 'FOUND')\n"
                            "    except ImportError:\n        print(m, 'absent')"],
                           capture_output=True, text=True, timeout=120)
    assert probe.stdout.split() == ["omegaconf", "absent", "wandb", "absent", "torchft", "absent"], probe


def test_the_smoke_part_runs_on_the_stand_in_with_the_kit_alone(machine, tmp_path):
    """`bash scripts/gpu_session.sh smoke` as a device call runs it, one row on the CPU:
    python3 is the image's, omegaconf comes from the kit's wheel (installed into KIT_SITE),
    wandb is never imported, the commit is the kit's (the copy has no .git), every file
    under $OUT is one a call brings back (at most 8, 2 folders down, plain names), the
    row's line is written when it ends and the table at the end. Red when the script
    names `python`, installs nothing, or records no commit."""
    copy, bin_dir, kit = machine
    env = device_env(machine, tmp_path, GPU_SESSION_CPU="1", SMOKE_LAYOUTS="single", SMOKE_RERUN="")
    result = subprocess.run(["bash", "scripts/gpu_session.sh", "smoke"], cwd=copy, env=env,
                            capture_output=True, text=True, timeout=PART_S + 60)
    print(result.stdout[-4000:], result.stderr[-2000:])
    assert result.returncode == 0
    out = tmp_path / "out"
    session = (out / "session.txt").read_text()
    assert f"commit {kit['commit']}," in session and "-changed-since-kit" not in session
    assert f"at {bin_dir / 'python3'}" in session, session
    assert "check: ok" in session and "wandb: absent" in session, session
    assert (tmp_path / "site" / "omegaconf" / "__init__.py").exists()
    assert re.fullmatch(r"single\|exit 0\|\d+ s\n", (out / "smoke" / "rows.txt").read_text())
    assert "1 of 1 layouts pass" in (out / "smoke" / "table.txt").read_text()
    assert "gpu_session: smoke ended with status 0" in (out / "smoke.log").read_text()
    files = [p.relative_to(out) for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(f.parts) <= 3 for f in files), files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for f in files for part in f.parts), files


@pytest.mark.parametrize("part", ["smoke", "side", "curve"])
def test_each_parts_command_is_one_its_program_accepts(machine, tmp_path, monkeypatch, part):
    """GPU_SESSION_DRY=1 prints the command a part would run there: the image's python3,
    the kit's nanoGPT and text, rows and results under $OUT, a budget inside the part's
    seconds; the program's own argument parser accepts it (a misspelt option would first
    fail on the GPU machine)."""
    copy, bin_dir, _ = machine
    result = subprocess.run(["bash", "scripts/gpu_session.sh", part], cwd=copy, timeout=120,
                            env=device_env(machine, tmp_path, GPU_SESSION_DRY="1"),
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(ln for ln in result.stdout.splitlines() if "gpu_smoke.sh" in ln or " -m bench." in ln)
    words, out = shlex.split(line), str(tmp_path / "out")
    print(words)
    monkeypatch.chdir(copy)
    if part == "smoke":
        env = dict(w.split("=", 1) for w in words[1:] if "=" in w and not w.startswith("-"))
        assert words[0] == "env" and env["PYTHON"] == str(bin_dir / "python3")
        assert 0 < int(env["SMOKE_DEADLINE"]) < PART_S and env["SMOKE_ROWS"].startswith(out)
        assert words[-4:] == ["bash", "scripts/gpu_smoke.sh", "--gpus", "1"]
        return
    assert words[:2] == [str(bin_dir / "python3"), "-m"]
    if part == "side":
        from bench import gpu_vs_nanogpt
        args = gpu_vs_nanogpt.parse_args(words[3:])  # refuses a folder that is no checkout
        assert args.nanogpt == "peers/nanoGPT" and args.rows.startswith(out)
    else:
        from bench import shakespeare_curve
        args = shakespeare_curve.parse_args(words[3:])
        shakespeare_curve.check_nanogpt(args.nanogpt)
        assert os.path.isfile(args.data) and args.rows.startswith(out) and args.size == "full"
    assert args.out.startswith(out) and 0 < args.budget_s < PART_S


def test_the_copys_commit_says_when_its_files_differ_from_the_kits(machine, tmp_path):
    """A file changed after the kit was built: the recorded commit is marked, not passed
    off as the code that ran."""
    copy, _, kit = machine
    target = copy / "README.md"
    before = target.read_text()
    try:
        target.write_text(before + "\nchanged\n")
        said = subprocess.run([sys.executable, "scripts/gpu_kit.py", "--commit"], cwd=copy,
                              capture_output=True, text=True, timeout=60)
    finally:
        target.write_text(before)
    assert said.stdout.strip() == kit["commit"] + "-changed-since-kit" and "README.md" in said.stderr


def test_results_name_the_kits_commits_where_there_is_no_git(tmp_path, monkeypatch):
    """A copy without .git: git prints nothing, so the results' commit is MINGPT_COMMIT
    (gpu_session.sh sets it from the kit), and the nanoGPT copy's is its .commit. Red
    when either records '?' instead."""
    from bench import nanogpt_runner, report
    monkeypatch.setattr(report.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 128, stdout="", stderr="not a git repository"))
    monkeypatch.setenv("MINGPT_COMMIT", "abc1234-changed-since-kit")
    assert report.environment(os.getloadavg())["git"] == "abc1234-changed-since-kit"
    (tmp_path / ".commit").write_text("3adf61e154c3fe3fca428ad6bc3818b27a3b8291\n")
    assert nanogpt_runner.checkout_commit(str(tmp_path)) == "3adf61e154c3"
