"""The one writer of every bench command's results: results.json, results.md opened by the
command line that made them and the machine it ran on, and charts (bench/README.md).

A command composes its own tables; this module gives them the same frame and files.
Imports nothing of the project, so any command (and its workers) can use it.
"""

import json
import os
import platform
import shlex
import subprocess
import time


def command_line(command, argv):
    """What to type from the repository root: command_line("-m bench.run", argv)."""
    return shlex.join(["python", *command.split(), *argv])


def environment(load_before):
    """What a reader needs to judge the numbers: code version, machine, how busy it was."""
    import torch
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit = ""
    # a copy without .git (a GPU machine's): the commit the device kit recorded and checked
    # the files against (scripts/gpu_session.sh sets it)
    commit = commit or os.environ.get("MINGPT_COMMIT", "")
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "git": commit, "torch": torch.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}


def busy_warning(env):
    # a load average near the core count means other work shared the cores: ratios
    # within a round still compare, absolute times do not
    # (only "before" tells: "after" includes the benchmark's own jobs)
    load = env["loadavg_before"][0]
    if load < 0.5 * (env["cpus"] or 1):
        return []
    return [f"- **the machine was busy** (1-min load average {load} on {env['cpus']} CPUs): "
            "treat absolute times as noisy"]


def header(title, cmd, details, env):
    """results.md's opening lines: title, command, the command's own settings (bullets),
    then the machine (environment()) and a warning if it was busy."""
    return [f"# {title}", "", "Command (from the repository root):", "", f"    {cmd}", "",
            *[f"- {d}" for d in details],
            f"- {env['date']}, git {env['git'] or '?'}, torch {env['torch']}, python "
            f"{env['python']}, {env['cpus']} CPUs, 1-min load average {env['loadavg_before'][0]} "
            f"before the run ({env['loadavg_after'][0]} after, its own jobs included)",
            *busy_warning(env)]


def table(columns, rows, align=""):
    """A markdown table's lines: rows of cells; align, a letter per column, "l" (the
    default) or "r" for numbers."""
    rule = ("---:" if a == "r" else "---" for a in align.ljust(len(columns), "l"))
    return ["| " + " | ".join(columns) + " |", "|" + "|".join(rule) + "|",
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def write_json(path, doc):
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def write_markdown(path, text):
    with open(path, "w") as f:
        f.write(text)
    return path


def write_results(out, doc, text):
    """out/results.json (doc) and out/results.md (text); returns their paths."""
    os.makedirs(out, exist_ok=True)
    return {"json": write_json(os.path.join(out, "results.json"), doc),
            "md": write_markdown(os.path.join(out, "results.md"), text)}


def draw(path, plot, *data):
    """Saves the figure plot(pyplot, *data) returns (None: nothing to draw) to path; returns
    its file name, or None. Without matplotlib too: a chart is optional, the tables carry
    every figure."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display here
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = plot(plt, *data)
    if fig is None:
        return None
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.basename(path)
