"""What a user sees at the command line: `--help`, a finished run run again, the console of
a default run (the program's lines, not a library's), and the hints of common mistakes."""

import ast
import os
import re

import pytest

import config
from harness import MAIN, REPO, command, job_env, python, read_metrics, run_job, run_tree


def test_help_lists_the_modes_and_every_key_with_its_default_and_exits_0():
    for flag in ("--help", "-h"):
        result = run_tree([python(), MAIN, flag, "trainer.max_steps=bad"], 120, flag,
                          cwd=REPO, env=job_env())
        assert result.returncode == 0 and not result.stderr, result.stderr[-3000:]
        out = result.stdout
        assert out.startswith("usage: python main.py") and "gpt2_train_cfg.yaml" in out
        assert all(f"  {mode} " in out for mode in config.MODES)
        missing = [k.name for k in config.describe_keys()
                   if f"    {k.name}={config._typed(k.default)} " not in out]
        assert not missing, missing
        assert "docs/configuration.md" in out


def files_of(directory):
    """{relative path: (bytes, mtime)} of everything under `directory`."""
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, directory)] = (f.read(), os.stat(path).st_mtime_ns)
    return found


def test_the_command_of_a_finished_run_run_again_says_so_and_changes_nothing(tmp_path):
    """Rerunning a run that reached trainer.max_steps (same command, same run directory)
    is one line saying how to go on, exit 0: no training, no metrics, the snapshot and
    the run directory untouched (it used to resume silently, print a sample and end)."""
    args = ["parallel.dp=single", "trainer.max_steps=2", "sample.length=5"]
    first = run_job(tmp_path, 1, args)
    assert first.returncode == 0 and "---- sample ----" in first.stdout, first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "default"
    before = files_of(run_dir)
    again = run_job(tmp_path, 1, args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines() == [
        "run runs/default already finished at step 2 (trainer.max_steps=2): raise "
        "trainer.max_steps to continue, or set a new trainer.run_dir for a fresh run"], again.stdout
    assert files_of(run_dir) == before


# what requirements-dev.txt adds to requirements.txt (the optional features' packages and
# the tests'): the README's first command must train without any of them
NOT_FOR_TRAINING = ["s3fs", "aiohttp", "torchft", "matplotlib", "tensorboard", "transformers", "moto",
                    "pytest"]
BLOCKER = f"""import sys

class Missing:  # a test's stand-in for an environment without {NOT_FOR_TRAINING}
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {NOT_FOR_TRAINING!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Missing())
"""


def runtime_only(env, directory):
    """`env` in which the packages requirements.txt does not list cannot be imported (a
    sitecustomize.py on PYTHONPATH, which every process of the job reads)."""
    directory.mkdir(exist_ok=True)
    (directory / "sitecustomize.py").write_text(BLOCKER)
    return dict(env, PYTHONPATH=str(directory))


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The README's first command, shortened: 2 ranks, the default config, wandb offline,
    in an environment without WANDB_SILENT (what a user has) and with requirements.txt's
    packages only (requirements-dev.txt's others unimportable)."""
    workdir = tmp_path_factory.mktemp("default")
    env = runtime_only(job_env(), tmp_path_factory.mktemp("runtime-only"))
    env.pop("WANDB_SILENT", None)
    result = run_tree(command(2, ["trainer.max_steps=2", "trainer.eval_every=2", "sample.length=20"]),
                      240, "the default run", cwd=workdir, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return workdir, result


def test_default_run_console_shows_the_programs_lines_not_wandbs(default_run):
    """wandb's banner, sync hints and run summary (some 30 lines) are quieted; one line of
    ours says where the offline run is and how to upload it."""
    workdir, result = default_run
    lines = (result.stdout + result.stderr).splitlines()
    ours = [ln for ln in lines if ln.startswith("wandb: offline run in")]
    from_wandb = [ln for ln in lines if "wandb" in ln.lower() and ln not in ours]
    assert not from_wandb, "\n".join(from_wandb)
    assert len(ours) == 1 and "upload it with `wandb sync runs/default/wandb/offline-run-" in ours[0]
    run = ours[0].split("`wandb sync ")[1].rstrip("`")
    assert os.path.isdir(workdir / run)
    program = [ln for ln in result.stdout.splitlines()
               if ln.startswith(("ProcessGrid(", "step ", "wandb: ", "---- sample ----"))]
    assert len(program) == 4, result.stdout


def test_the_default_run_trains_with_requirements_txt_only(default_run):
    """The run above had none of requirements-dev.txt's own packages (importing one raised):
    it trained, sampled, and imported none of them."""
    workdir, result = default_run
    assert "---- sample ----" in result.stdout and "No module named" not in result.stderr


@pytest.mark.parametrize("asked,package", [
    (["trainer.snapshot_path=s3://bucket/run1"], "s3fs"),
    (["data.path=https://example.com/corpus.txt"], "aiohttp"),
    (["ft.enabled=true"], "torchft==0.2.0"),
    (["mode=lighthouse"], "torchft==0.2.0"),
    (["mode=plot"], "matplotlib"),
    (["metrics.tensorboard=true"], "tensorboard"),
])
def test_a_feature_whose_package_is_missing_is_one_line_naming_it(tmp_path, asked, package):
    """With requirements.txt only, a run that asks for an optional feature stops with one
    line naming the package to install (not an ImportError's traceback, at whatever point
    the package is first imported), exit status 2."""
    result = run_tree(command(1, asked), 120, f"{asked}", cwd=tmp_path,
                      env=runtime_only(job_env(), tmp_path / "runtime-only"))
    lines = result.stderr.splitlines()
    print(lines)
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"error: {asked[0]} needs ") and \
        lines[0].endswith(f"pip install {package} (requirements-dev.txt has it)"), lines


def test_requirements_txt_holds_what_training_needs_and_dev_the_rest():
    """requirements.txt (the README's first command) lists no test or optional package;
    requirements-dev.txt (the second, .ci/run's) includes it and adds each of them."""
    def names(path):
        with open(os.path.join(REPO, path)) as f:
            lines = [ln.split("#")[0].strip() for ln in f]
        return [re.split(r"[\[=<>~ ]", ln)[0] for ln in lines if ln]
    runtime, dev = names("requirements.txt"), names("requirements-dev.txt")
    assert "torch" in runtime and not set(runtime) & set(NOT_FOR_TRAINING), runtime
    assert dev[0] == "-r" or dev[0].startswith("-r"), dev
    assert set(NOT_FOR_TRAINING) <= set(dev), dev


def test_missing_tokens_of_the_gpt2_preset_hint_the_prepare_command_with_its_config(tmp_path,
                                                                                   monkeypatch):
    """The preset trains on prepared tokens; before they exist, the error gives the command
    that makes them, config=... included (without it, prepare would read the default YAML:
    another tokenizer and split)."""
    from char_dataset import open_data
    from errors import UserError
    monkeypatch.chdir(REPO)
    tokens = tmp_path / "tokens"
    cfg = config.load_config(["config=configs/gpt2-124m.yaml", f"data.tokens_path={tokens}"], 1)
    with pytest.raises(UserError) as e:
        open_data(cfg.data, config_file=cfg.config)
    assert str(e.value).endswith(
        f"prepare it first, python main.py config=configs/gpt2-124m.yaml mode=prepare "
        f"data.path=<text> data.tokens_path={tokens} data.tokenizer=gpt2")


def documented_metrics():
    """The names in the first column of docs/metrics.md's metrics.jsonl table, as
    patterns (`comm_<kind>_calls` matches comm_all_reduce_calls)."""
    with open(os.path.join(REPO, "docs", "metrics.md")) as f:
        text = f.read().split("## metrics.jsonl", 1)[1].split("\n## ", 1)[0]
    names = [name for line in text.splitlines() if line.startswith("| `")
             for name in re.findall(r"`([^`]+)`", line.split("|")[1])]
    return [re.compile(re.sub(r"<\w+>", r"\\w+", re.escape(n).replace(r"\<", "<").replace(r"\>", ">"))
                       + "$") for n in names]


def written_statically():
    """Keys the code writes into a step's record by name (AST: dict literals of the
    trainer's step and save, of the record and its sources (fault tolerance's have a
    section of their own) and of telemetry's peak_memory,
    record["x"] = ..., record.update(x=...)): some appear only on CUDA, which no test
    here has."""
    found = set()
    for path, functions in (("trainer.py", {"train", "save"}),
                            ("telemetry/step_record.py", {"after_step"}),
                            ("telemetry/compile_time.py", {"figures", "after_eval"}),
                            ("telemetry/activation_meter.py", {"figures"}),
                            ("checkpoint/async_snapshot.py", {"save_step"}),
                            ("telemetry/metrics.py", {"peak_memory"})):
        with open(os.path.join(REPO, path)) as f:
            tree = ast.parse(f.read())
        for fn in ast.walk(tree):
            if not (isinstance(fn, ast.FunctionDef) and fn.name in functions):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Dict):
                    found |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
                elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                        and getattr(node.value, "id", "") == "record" \
                        and isinstance(node.slice, ast.Constant):
                    found.add(node.slice.value)
                elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "update" \
                        and getattr(node.func.value, "id", "") == "record":
                    found |= {k.arg for k in node.keywords if k.arg}
    return found


def test_every_metrics_field_is_documented(default_run, tmp_path):
    """Every key of metrics.jsonl has a row in docs/metrics.md: the default run's, a
    2-rank pipeline job's with fp16, asynchronous snapshots, the activation meter and
    compilation (eager backend: no code generation), and the keys the code writes by
    name (CUDA-only ones included)."""
    workdir, _ = default_run
    seen = {k for r in read_metrics(workdir / "runs" / "default") for k in r}
    features = ["parallel.dp=single", "parallel.pp=2", "parallel.microbatches=2",
                "trainer.precision=fp16", "trainer.snapshot_async=true", "trainer.save_every=2",
                "trainer.eval_every=2", "trainer.max_steps=4", "trainer.measure_activations=true",
                "trainer.compile=true", "trainer.compile_backend=eager"]
    result = run_job(tmp_path, 2, features)
    assert result.returncode == 0, result.stderr[-3000:]
    seen |= {k for r in read_metrics(tmp_path / "runs" / "default") for k in r}
    assert {"pp_bubble", "snapshot_wait_ms", "loss_scale", "compile_ms", "activation_peak_mb",
            "comm_send_bytes"} <= seen, seen
    documented = documented_metrics()
    missing = sorted(k for k in seen | written_statically()
                     if not any(p.match(k) for p in documented))
    assert not missing, f"metrics.jsonl fields without a row in docs/metrics.md: {missing}"
