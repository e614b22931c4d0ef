"""bench.run's charts, as figures for bench.report.draw: step_time.png and pipeline_timeline.png."""

MiB = 2**20


def step_time(plt, summary):
    """Left: step time vs single (bar = median, dots = rounds). Right: traffic vs textbook."""
    names = list(summary)[::-1]  # first variant on top
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.45 * len(names) + 1.6), sharey=True)
    for i, n in enumerate(names):
        r = summary[n]["vs_single"]
        if r:
            left.barh(i, r["median"], color="tab:blue", alpha=0.6)
            left.plot(r["per_round"], [i] * len(r["per_round"]), "k.", markersize=4)
    left.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    left.set_yticks(range(len(names)), names)
    left.set_xlabel("step time / single (same round)")
    wire = [summary[n]["comm"]["wire_bytes_est"] / MiB for n in names]
    book = [(summary[n]["textbook"] or {}).get("wire_bytes", 0) / MiB for n in names]
    right.barh([i + 0.2 for i in range(len(names))], wire, height=0.4, label="est. wire (counted)")
    right.barh([i - 0.2 for i in range(len(names))], book, height=0.4, label="textbook")
    right.set_xlabel("MiB sent per rank per step")
    right.legend(loc="best", fontsize=8)
    return fig


COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}


def pipeline_timeline(plt, summary):
    """One panel per pipeline variant: a row per stage, a box per forward (blue), backward
    (orange; under zb1p / zbv the input gradient B only) and weight gradient W (green),
    labelled by micro-batch (and chunk, with several per rank). None without any."""
    runs = {n: v["pipeline"]["timeline"] for n, v in summary.items()
            if v.get("pipeline") and v["pipeline"]["timeline"]}
    if not runs:
        return None
    height = sum(1.0 + 0.5 * len(t["stages"]) for t in runs.values())
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, height), squeeze=False)
    for ax, (name, t) in zip(axes[:, 0], runs.items()):
        for s, actions in enumerate(t["stages"]):
            for kind, chunk, m, t0, t1 in actions:
                ax.broken_barh([(t0, t1 - t0)], (s - 0.4, 0.8), color=COLORS[kind],
                               alpha=0.55 if kind == "F" else 0.85, edgecolor="black", linewidth=0.4)
                label = f"{m}" if t["virtual_stages"] == 1 else f"{m}.{chunk}"
                ax.text((t0 + t1) / 2, s, label, ha="center", va="center", fontsize=6)
        ax.set_yticks(range(len(t["stages"])), [f"stage {s}" for s in range(len(t["stages"]))])
        ax.invert_yaxis()
        ax.set_title(f"{name}: {t['schedule']}, M={t['microbatches']}"
                     + (f", V={t['virtual_stages']}" if t["virtual_stages"] > 1 else "")
                     + " (blue F, orange B, green W; label = micro-batch[.chunk])", fontsize=8)
        ax.set_xlabel("ms since the step's first action")
    return fig
