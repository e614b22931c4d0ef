"""`python -m bench.shakespeare_curve`: a real-text learning curve, ours beside nanoGPT's.

configs/shakespeare-char.yaml (nanoGPT's config/train_shakespeare_char.py) trained on a
Shakespeare text with the character tokenizer, one process on whatever device is there;
with `--nanogpt PATH` (a checkout of karpathy/nanoGPT) nanoGPT's own train.py runs the same
configuration on the same text and device right after, from a copy of its checkout (its
prepare.py writes data files beside itself; the user's checkout is left as it was). Both
split the text the same way (the last 10% validates) and evaluate 200 x 64 validation
windows; their validation losses are printed step by step, with the best, the last and the
wall time of each. The goal at full size is nanoGPT's reported best, 1.4697 (issue 46).

    python -m bench.shakespeare_curve --data tinyshakespeare.txt --nanogpt ../nanoGPT
    python -m bench.shakespeare_curve --data tinyshakespeare.txt --size laptop   # on a CPU

`--size laptop` is the CPU run of nanoGPT's README (4 x 128, context 64, batch 12, 2000
steps, no dropout; it reports a validation loss of about 1.88); `--size small` (2 x 64,
60 steps) is the suite's.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench import report
from bench.nanogpt_runner import checkout_commit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = "configs/shakespeare-char.yaml"
GOAL = 1.47  # nanoGPT's README: best validation loss 1.4697 with this configuration
# the shape both runs get: our key, nanoGPT's name
SHAPE_KEYS = [("model.n_layer", "n_layer"), ("model.n_head", "n_head"), ("model.n_embd", "n_embd"),
              ("data.block_size", "block_size"), ("trainer.batch_size", "batch_size"),
              ("trainer.max_steps", "max_iters"), ("trainer.eval_every", "eval_interval"),
              ("trainer.eval_batches", "eval_iters"), ("trainer.warmup_steps", "warmup_iters"),
              ("model.dropout", "dropout")]
SIZES = {  # values in SHAPE_KEYS' order
    "full": (6, 6, 384, 256, 64, 5000, 250, 200, 100, 0.2),   # config/train_shakespeare_char.py
    "laptop": (4, 4, 128, 64, 12, 2000, 250, 20, 100, 0.0),   # its README's CPU run: val ~1.88
    "small": (2, 2, 64, 64, 8, 60, 20, 4, 10, 0.2),           # the suite's: seconds
}
NANOGPT_STEP = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)", re.M)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.shakespeare_curve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="the text (tinyshakespeare.txt): file or URL")
    p.add_argument("--nanogpt", default="", help="a checkout of karpathy/nanoGPT: its train.py too")
    p.add_argument("--size", choices=SIZES, default="full",
                   help="full (nanoGPT's config), laptop (its README's CPU run), small (the tests')")
    p.add_argument("--device", default="auto", help="auto (a GPU if there is one) | cpu | cuda")
    p.add_argument("--compile", choices=("auto", "true", "false"), default="auto",
                   help="torch.compile both (auto: on a GPU, as nanoGPT does)")
    p.add_argument("--out", default="runs/bench/shakespeare_curve", help="results folder")
    p.add_argument("--budget-s", type=float, default=0,
                   help="seconds for both runs (0: no limit): ours gets half of it when nanoGPT "
                        "runs too, nanoGPT what is left; a run past its share is stopped and its "
                        "curve so far reported")
    p.add_argument("--rows", default="", metavar="FILE",
                   help="append each validation point to FILE (run, step, val loss, seconds) "
                        "as soon as the run reports it")
    return p.parse_args(argv)


def settings(args):
    """device, compile, dtype (nanoGPT's name) and the shape's values, as both runs get them."""
    from launch.devices import precision_for
    from parallel.grid import uses_cuda
    cuda = uses_cuda(args.device)
    compiled = args.compile == "true" or (args.compile == "auto" and cuda)
    bf16 = precision_for(args.device) == "bf16"  # trainer.precision=auto's choice, ours' too
    shape = [(ours, theirs, value) for (ours, theirs), value in zip(SHAPE_KEYS, SIZES[args.size])]
    return {"device": "cuda" if cuda else "cpu", "compile": compiled,
            "dtype": "bfloat16" if bf16 else "float32", "shape": shape}


def run_ours(args, s, workdir, seconds_left=None):
    run_dir = os.path.join(workdir, "ours")
    cmd = [sys.executable, os.path.join(REPO, "main.py"), f"config={os.path.join(REPO, PRESET)}",
           f"data.path={args.data}", f"trainer.run_dir={run_dir}", f"trainer.device={s['device']}",
           f"trainer.compile={str(s['compile']).lower()}", "trainer.precision=auto",
           "trainer.save_every=0", "wandb.mode=disabled", "sample.length=0",
           *[f"{ours}={value}" for ours, _, value in s["shape"]]]

    def curve(_log):  # metrics.jsonl's validation points so far (a line being written: later)
        points, path = [], os.path.join(run_dir, "metrics.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        r = json.loads(line)
                    except ValueError:
                        break
                    if "val_loss" in r:
                        points.append((r["step"], r["val_loss"]))
        return points
    seconds, out, points, cut = followed(cmd, REPO, os.path.join(workdir, "ours.log"), curve,
                                         seconds_left, lambda p: row(args.rows, "ours", p))
    return {"seconds": seconds, "curve": points, "precision": _resolved(run_dir), "cut": cut}


def check_nanogpt(path):
    """Before anything runs: a folder without nanoGPT's files is refused in one line."""
    for need in ("train.py", "model.py", "configurator.py", "data/shakespeare_char/prepare.py"):
        if not os.path.exists(os.path.join(path, need)):
            raise SystemExit(f"--nanogpt {path}: no {need}; give a checkout of "
                             "https://github.com/karpathy/nanoGPT")


def run_nanogpt(args, s, workdir, seconds_left=None):
    """nanoGPT's own train.py with its shakespeare_char config, from a copy of the checkout."""
    copy = os.path.join(workdir, "nanoGPT")
    shutil.copytree(args.nanogpt, copy, ignore=shutil.ignore_patterns(".git", "out*"))
    data_dir = os.path.join(copy, "data", "shakespeare_char")
    from char_dataset import load_text
    with open(os.path.join(data_dir, "input.txt"), "w") as f:  # prepare.py downloads it when absent
        f.write(load_text(args.data))
    subprocess.run([sys.executable, "prepare.py"], cwd=data_dir, check=True, capture_output=True)
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py",
           f"--out_dir={os.path.join(workdir, 'nanogpt-out')}", f"--device={s['device']}",
           f"--compile={s['compile']}", f"--dtype={s['dtype']}",
           *[f"--{theirs}={value}" for _, theirs, value in s["shape"]],
           f"--lr_decay_iters={dict((t, v) for _, t, v in s['shape'])['max_iters']}"]
    def curve(log):
        return [(int(m[0]), float(m[2])) for m in NANOGPT_STEP.findall(log)]
    seconds, out, points, cut = followed(cmd, copy, os.path.join(workdir, "nanogpt.log"), curve,
                                         seconds_left, lambda p: row(args.rows, "nanoGPT", p))
    return {"seconds": seconds, "curve": points, "precision": s["dtype"], "cut": cut,
            "commit": checkout_commit(args.nanogpt)}


def followed(cmd, cwd, log, curve, seconds_left, on_point, poll_s=1.0):
    """Run cmd (output to `log`), reporting each new point of curve(log text) to on_point
    as it comes; stopped (its process group killed) after seconds_left (None: no limit).
    Returns (seconds, output, the curve, whether it was stopped); a run that fails on its
    own ends the command with its output's tail."""
    t0, seen = time.perf_counter(), 0
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    cut = False
    while True:
        try:
            proc.wait(timeout=poll_s)
            done = True
        except subprocess.TimeoutExpired:
            done = False
        with open(log) as f:
            out = f.read()
        points = curve(out)
        for point in points[seen:]:
            on_point(point)
        seen = len(points)
        if done:
            break
        if seconds_left is not None and time.perf_counter() - t0 > seconds_left:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            cut = True
            print(f"{os.path.basename(cmd[1])}: stopped after {seconds_left:.0f} s (--budget-s), "
                  f"{len(points)} validation point(s) reported", flush=True)
            break
    if proc.returncode != 0 and not cut:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}):\n" + out[-3000:])
    return time.perf_counter() - t0, out, points, cut


def row(path, run, point):
    if path:
        with open(path, "a") as f:
            f.write(f"{run}\t{point[0]}\t{point[1]:.4f}\t{time.strftime('%H:%M:%S')}\n")


def _resolved(run_dir):
    from omegaconf import OmegaConf
    path = os.path.join(run_dir, "config.yaml")
    return OmegaConf.load(path).trainer.precision if os.path.exists(path) else "?"


def summary(run):
    losses = [v for _, v in run["curve"]]
    return {"best": min(losses) if losses else None, "last": losses[-1] if losses else None,
            "seconds": round(run["seconds"], 1)}


def tables(runs, size):
    names = list(runs)
    steps = sorted({step for run in runs.values() for step, _ in run["curve"]})
    at = {name: dict(run["curve"]) for name, run in runs.items()}
    curve = report.table(["step", *(f"{n} val loss" for n in names)],
                         [[str(step), *(f"{at[n][step]:.4f}" if step in at[n] else "-" for n in names)]
                          for step in steps], "r" * (1 + len(names)))
    goal = f" (goal <= {GOAL})" if size == "full" else ""
    def loss(v):
        return "-" if v is None else f"{v:.4f}"

    def wall(run):
        return f"{summary(run)['seconds']:.1f}" + (" (stopped: --budget-s)" if run.get("cut") else "")
    best = report.table(["run", "precision", f"best val loss{goal}", "last val loss", "wall s"],
                        [[n, runs[n]["precision"], loss(summary(runs[n])['best']),
                          loss(summary(runs[n])['last']), wall(runs[n])]
                         for n in names], "llrrr")
    return curve, best


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command, load_before = report.command_line("-m bench.shakespeare_curve", argv), os.getloadavg()
    if args.nanogpt:
        check_nanogpt(args.nanogpt)
    s = settings(args)
    begun = time.perf_counter()

    def left(share=1.0):
        if not args.budget_s:
            return None
        return max(1.0, share * (args.budget_s - (time.perf_counter() - begun)))
    with tempfile.TemporaryDirectory() as workdir:
        runs = {"ours": run_ours(args, s, workdir, left(0.5 if args.nanogpt else 1.0))}
        if args.nanogpt:
            runs["nanoGPT"] = run_nanogpt(args, s, workdir, left())
    env = report.environment(load_before)
    curve, best = tables(runs, args.size)
    shape = ", ".join(f"{theirs} {value}" for _, theirs, value in s["shape"])
    nano = [f"nanoGPT at commit {runs['nanoGPT']['commit'] or '?'}: its train.py with "
            "config/train_shakespeare_char.py"] if "nanoGPT" in runs else []
    text = "\n".join(report.header("Shakespeare, character level: validation loss", command, [
        f"configs/shakespeare-char.yaml ({args.size}: {shape}), "
        f"device {s['device']}, compile {s['compile']}", *nano], env) + ["", *best, "", *curve])
    doc = {"command": command, "environment": env, "settings": {**vars(args), **s},
           "runs": {n: {**r, **summary(r)} for n, r in runs.items()}}
    report.write_results(args.out, doc, text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
