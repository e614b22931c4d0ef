"""Draws a run directory's charts (series.py) into <run_dir>/plots/ as PNGs, the last
step's pipeline timeline through bench's own chart, and the page that shows them."""

import os

from bench.run_engine import charts as bench_charts
from errors import missing_package
from plots import page, series


def pyplot():
    """matplotlib's pyplot without a display; one line naming the package without it."""
    try:
        import matplotlib
    except ImportError:
        raise missing_package("mode=plot", "matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def line_chart(plt, title, ylabel, lines):
    """One line per field against the step; a field of one point (the final val_loss of a
    short run) shows as a marker."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for field, (steps, values) in lines.items():
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3,
                label=field)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=7, loc="best")
    return fig


def stragglers(records, fig):
    """busy_spread's points labelled by the rank the others waited for (straggler_rank)."""
    ax = fig.axes[0]
    for r in records:
        if r.get("busy_spread") is not None:
            ax.annotate(f"r{r['straggler_rank']}", (r["step"], r["busy_spread"]), fontsize=6,
                        textcoords="offset points", xytext=(0, 4), ha="center")
    return fig


def schedule_bubble(fig, timeline):
    """The schedule's own bubble (F = B = W: planner/step_time.bubble) as a dashed line on
    the measured one: the gap is what message latency and uneven stages add."""
    from planner.step_time import bubble
    P, M, V = len(timeline["stages"]), timeline["microbatches"], timeline["virtual_stages"]
    fig.axes[0].axhline(bubble(timeline["schedule"], P, M, V), color="grey", linestyle="--",
                        label=f"{timeline['schedule']} at unit time (P={P}, M={M}, V={V})")
    fig.axes[0].legend(fontsize=7, loc="best")
    return fig


def figures(run_dir):
    """[(file name, caption, figure)] of the run's charts (matplotlib's figures, open)."""
    plt = pyplot()
    records = series.read_records(run_dir)
    timeline = series.timeline(run_dir)
    # an earlier pipeline run's file in a run directory a run without pp started over in
    timeline = timeline if any("pp_bubble" in r for r in records) else None
    out = []
    for file, title, ylabel, lines in series.series(records):
        fig = line_chart(plt, title, ylabel, lines)
        if file == "stragglers.png":
            fig = stragglers(records, fig)
        if file == "pp_bubble.png" and timeline is not None:
            fig = schedule_bubble(fig, timeline)
        out.append((file, title, fig))
    if timeline is not None:
        # bench's chart: a panel per run, one run here
        fig = bench_charts.pipeline_timeline(plt, {"last step": {"pipeline": {"timeline": timeline}}})
        out.append(("pipeline_timeline.png", "pipeline timeline of the last step", fig))
    return out


def write_plots(run_dir):
    """Every chart's PNG and index.html into <run_dir>/plots/; returns the page's path and
    the PNGs' names."""
    plt = pyplot()
    where = os.path.join(run_dir, "plots")
    drawn = figures(run_dir)
    os.makedirs(where, exist_ok=True)
    ours = {file for file, *_ in series.CHARTS} | {"pipeline_timeline.png"}
    for stale in ours & set(os.listdir(where)) - {file for file, _, _ in drawn}:
        os.remove(os.path.join(where, stale))  # a chart an earlier run in this directory had
    for file, _, fig in drawn:
        fig.tight_layout()
        fig.savefig(os.path.join(where, file), dpi=80)
        plt.close(fig)
    return (page.write(where, run_dir, [(file, caption) for file, caption, _ in drawn]),
            [file for file, _, _ in drawn])
