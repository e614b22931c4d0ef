"""`python -m bench.fault_tolerance`: what ft.enabled costs a step, and how long a lost
replica group takes to recover.

    python -m bench.fault_tolerance                 # 2 rounds and a recovery: ~5 min on 2 cores
    python -m bench.fault_tolerance --steps 8 --warmup 2 --rounds 1 --out "$(mktemp -d)"   # smoke test

Each round runs two layouts of the same run (model, embedded corpus, global batch), in an
order that alternates between rounds so a noisy neighbour hits both alike; gloo, 1 thread
per rank, 4 ranks in all:

- `hsdp`: one torchrun of 4 ranks, parallel.dp=fsdp (ZeRO-3) with parallel.dp_replicate=2:
  two replica groups of 2, gradient shards summed across them by our own code; the same
  math with no fault tolerance;
- `ft`: a lighthouse (mode=lighthouse) and two torchruns of 2 ranks (fsdp ZeRO-3) with
  ft.enabled, ft.replicas=2: the quorum before every step, the sum across groups over
  torchft's gloo group, the commit vote. The groups start, wait for the lighthouse with
  their models built, and the lighthouse starts once both wait, so both take every step.

Time per step, the headline: the wall-clock time from step --warmup's console line to the
last step's, per step (group 0's for ft): everything a step costs, the quorum included.
Beside it the median step_ms (rank 0's record) over the steps after --warmup, which leaves
out what runs between steps. Each ratio ft / hsdp is taken within a round, then the median
over rounds.

Then one recovery job: `ft` run on past --kill-at, where group 1 is SIGKILLed (its whole
process tree). Measured: from the kill to group 0's next committed step (the
ft_committed_at stamp of its metrics record), and ft_recovery_s, which group 0 logs itself:
from the start of the step the group died in to the commit of its redo. Group 0 is never
restarted. Results: --out's results.json (every job) and results.md (bench/report.py).
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import re
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import report  # noqa: E402
from launch import process_tree  # noqa: E402

MAIN = os.path.join(REPO, "main.py")
MODEL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "data.block_size=64",
         "trainer.batch_size=16"]
COMMON = ["parallel.dp=fsdp", "parallel.zero_stage=3", "trainer.log_every=1",
          "trainer.eval_every=0", "trainer.save_every=0", "trainer.warmup_steps=2",
          "sample.length=0", "wandb.mode=disabled", "parallel.timeout_s=300"]
FT = ["ft.enabled=true", "ft.replicas=2", "ft.timeout_s=240"]  # below parallel.timeout_s: the rule of fault_tolerance/config.py
WAITING = "ft: waiting up to"
STEP_LINE = re.compile(rb"^\r?step (\d+)/\d+ \|")  # telemetry/metrics.py's console line


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=REPO,
             WANDB_SILENT="true")
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        e.pop(key, None)
    return e


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class Launch:
    """main.py in its own run directory, its console in console.log there; `stamps`: the
    wall-clock time each step's console line arrived (rank 0 prints it, flushed, right
    after the step's record), the throughput's clock."""

    def __init__(self, run_dir, nproc, overrides):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir, self.stamps = run_dir, {}
        cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone",
                                   f"--nproc_per_node={nproc}"] if nproc > 1 else [])
        self.proc = subprocess.Popen(cmd + [MAIN, *overrides, f"trainer.run_dir={run_dir}"],
                                     cwd=REPO, env=env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        with open(os.path.join(self.run_dir, "console.log"), "wb") as log:
            for line in self.proc.stdout:
                found = STEP_LINE.match(line)
                if found:
                    self.stamps.setdefault(int(found.group(1)), time.time())
                log.write(line)
                log.flush()

    def wall_ms(self, first, last):
        """Wall-clock milliseconds per step from step `first`'s line to step `last`'s."""
        self.reader.join(timeout=60)
        return 1000 * (self.stamps[last] - self.stamps[first]) / (last - first)

    def console(self):
        with open(os.path.join(self.run_dir, "console.log")) as f:
            return f.read()

    def records(self):
        import json
        try:
            with open(os.path.join(self.run_dir, "metrics.jsonl")) as f:
                return [json.loads(line) for line in f if line.endswith("\n")]
        except OSError:
            return []

    def stop(self):
        """SIGKILL the launch with every process below it (launch/process_tree.py)."""
        if self.proc.poll() is None:
            process_tree.kill_tree(self.proc.pid)
        self.proc.wait()


def wait_until(what, ok, launches, timeout=900):
    deadline = time.time() + timeout
    while not ok():
        gone = [x for x in launches if x.proc.poll() is not None]
        if gone or time.time() > deadline:
            for x in launches:
                x.stop()
            raise SystemExit(f"gave up waiting for {what}:\n" +
                             "\n".join(x.console()[-2000:] for x in launches))
        time.sleep(0.05)


def ft_groups(tmp, name, steps):
    """A lighthouse and two groups, started so that both take every step; returns
    (lighthouse, [group 0, group 1])."""
    port = free_port()
    groups = [Launch(os.path.join(tmp, f"{name}-group{i}"), 2, MODEL + COMMON + FT + [
        f"trainer.max_steps={steps}", f"ft.replica_id={i}", f"ft.lighthouse=localhost:{port}"])
        for i in range(2)]
    wait_until("the groups waiting for the lighthouse",
               lambda: all(WAITING in g.console() for g in groups), groups)
    beacon = Launch(os.path.join(tmp, f"{name}-lighthouse"), 1, [
        "mode=lighthouse", f"ft.lighthouse=localhost:{port}", "ft.min_replicas=1"])
    return beacon, groups


def step_times(mode, args, tmp, i):
    if mode == "hsdp":
        job = Launch(os.path.join(tmp, f"hsdp-{i}"), 4, MODEL + COMMON + [
            "parallel.dp_replicate=2", f"trainer.max_steps={args.steps}"])
        if job.proc.wait(timeout=900):
            raise SystemExit(f"hsdp job failed:\n{job.console()[-3000:]}")
        records, wall = job.records(), job.wall_ms(args.warmup, args.steps - 1)
    else:
        beacon, groups = ft_groups(tmp, f"ft-{i}", args.steps)
        for g in groups:
            if g.proc.wait(timeout=900):
                raise SystemExit(f"ft group failed:\n{g.console()[-3000:]}")
        beacon.stop()
        # the steps both groups took (the first quorum may form before the second group
        # asks: it then joins a step later, healing from the first)
        records = [r for r in groups[0].records() if r["ft_live_groups"] == 2]
        wall = groups[0].wall_ms(args.warmup, args.steps - 1)
    return {"mode": mode, "step_ms": statistics.median(
        r["step_ms"] for r in records if args.warmup < r["step"] < args.steps),
        "wall_ms": wall, "records": records}


def recovery(args, tmp):
    beacon, (g0, g1) = ft_groups(tmp, "recovery", 100000)
    launches = [beacon, g0, g1]
    last = lambda: max((r["step"] for r in g0.records()), default=0)  # noqa: E731
    wait_until(f"step {args.kill_at}", lambda: last() >= args.kill_at, launches)
    committed_before = last()
    killed = time.time()
    g1.stop()
    after = lambda: [r for r in g0.records() if r["ft_committed_at"] > killed]  # noqa: E731
    wait_until("the survivor's next committed steps",
               lambda: len(after()) >= 3 and any("ft_recovery_s" in r for r in g0.records()),
               [beacon, g0])
    records = g0.records()
    for x in (g0, beacon):
        x.stop()
    first = after()[0]
    recovered = next(r for r in records if "ft_recovery_s" in r)
    return {"killed_after_step": committed_before, "next_commit_step": first["step"],
            "kill_to_next_commit_s": first["ft_committed_at"] - killed,
            "ft_recovery_s": recovered["ft_recovery_s"], "redone_step": recovered["step"],
            "uncommitted_steps": recovered["ft_uncommitted_steps"],
            "survivor_restarted": g0.console().count("ProcessGrid(") != 1}


def tables(s):
    """results.md's lines after its header, from the summary."""
    rec = s["recovery"]
    return [*report.table(["layout", "wall ms per step", "median step_ms"], [
        ["hsdp (dp_replicate=2, one launch)", f"{s['wall_ms']['hsdp']:.1f}", f"{s['step_ms']['hsdp']:.1f}"],
        ["ft (2 launches + lighthouse)", f"{s['wall_ms']['ft']:.1f}", f"{s['step_ms']['ft']:.1f}"]], "lrr"),
        "", f"ft / hsdp wall time per step: **{s['ft_over_hsdp_wall']:.3f}** (median over rounds; "
            f"range {s['wall_ratio_range'][0]:.3f}-{s['wall_ratio_range'][1]:.3f})", "",
        f"ft / hsdp step_ms: {s['ft_over_hsdp']:.3f} (range {s['ratio_range'][0]:.3f}-"
        f"{s['ratio_range'][1]:.3f}): step_ms leaves out what runs between steps, where ft "
        "now waits for its quorum's answer; the wall time per step counts everything", "",
        f"Recovery: group 1 SIGKILLed after step {rec['killed_after_step']}; group 0's next "
        f"committed step ({rec['next_commit_step']}) **{rec['kill_to_next_commit_s']:.2f} s** "
        f"after the kill; from the start of the step it redid to that commit (ft_recovery_s): "
        f"{rec['ft_recovery_s']:.2f} s; steps not committed: {rec['uncommitted_steps']}; "
        f"group 0 restarted: {'yes' if rec['survivor_restarted'] else 'no'}."]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.fault_tolerance",
                                description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="steps per timing job")
    p.add_argument("--warmup", type=int, default=5, help="steps not timed")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=10, help="recovery: group 1 killed after this step")
    p.add_argument("--out", default="runs/bench/fault_tolerance")
    args = p.parse_args(argv)
    command, load_before, jobs = report.command_line("-m bench.fault_tolerance", argv), os.getloadavg(), []
    with tempfile.TemporaryDirectory(prefix="bench-ft-") as tmp:
        for i in range(args.rounds):
            for mode in (("hsdp", "ft") if i % 2 == 0 else ("ft", "hsdp")):
                j = step_times(mode, args, tmp, i)
                jobs.append({"round": i, **j})
                print(f"round {i} {mode}: step_ms {j['step_ms']:.1f}, wall {j['wall_ms']:.1f} ms a step",
                      flush=True)
        rec = recovery(args, tmp)
        print(f"recovery: {rec}", flush=True)
    ratios, walls = ([next(j[key] for j in jobs if j["round"] == i and j["mode"] == "ft") /
                      next(j[key] for j in jobs if j["round"] == i and j["mode"] == "hsdp")
                      for i in range(args.rounds)] for key in ("step_ms", "wall_ms"))
    summary = {**{key: {m: statistics.median(j[key] for j in jobs if j["mode"] == m)
                        for m in ("hsdp", "ft")} for key in ("step_ms", "wall_ms")},
               "ft_over_hsdp": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
               "ft_over_hsdp_wall": statistics.median(walls),
               "wall_ratio_range": [min(walls), max(walls)], "recovery": rec}
    e = report.environment(load_before)
    text = "\n".join(report.header("Fault-tolerant replica groups: step time and recovery", command, [
        f"4 ranks x 1 thread, gloo, fsdp ZeRO-3 inside 2 replica groups of 2, {' '.join(MODEL)}, "
        f"{args.steps} steps, the first {args.warmup} not timed, {args.rounds} rounds"], e)
        + ["", *tables(summary), ""])
    report.write_results(args.out, {"command": command, "environment": e, "settings": vars(args),
                                    "summary": summary, "jobs": jobs}, text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
