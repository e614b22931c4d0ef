"""Test-only: main.py's jobs, many in one torchrun launch (harness.run_job's fast path).

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/job_server.py CONTROL

A 2-rank main.py job costs about 8 s of CPU, nearly all of it starting interpreters:
torchrun's and each rank's `import torch` (with dynamo, which torch.optim imports on the
first step). The training itself takes a fraction of a second. So the harness keeps one
launch of this server per process count and hands it jobs: each rank reads the job (its
argv and working directory) from its own FIFO in CONTROL, runs `main.run` there with
its output going to files of the job, and writes the exit status to its result FIFO.
Everything a job does is main.py's own code on real processes, gloo and torchrun's
rendezvous; what it does not exercise is starting and leaving an interpreter, which the
tests of exit statuses, signals, kills and restarts check with jobs of their own
(run_job(..., fresh=True), and every test that starts torchrun itself).

After a job each rank says whether it can run the next: yes when main.run returned 0, or
2 (a UserError: every rank says one line and returns; main leaves its process group
started then, and the rank destroys it here, as a process exiting would). The harness
keeps the server only when every rank returned and said yes: a rank that returned is in
no collective, so none is left waiting in one. Any other status (a traceback, a signal's
status), a rank that never answers or a server that died ends it, and the next job
starts a new one. Bad input in the server thus costs no new server; the tests of how a
bad-input job leaves through torchrun (exit status, console) run fresh jobs.
"""

import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

import main as entry  # noqa: E402  (every import a job needs, once)
from harness import LAUNCHER_ENV  # noqa: E402  (this directory is the script's: on sys.path)


def run_one(job, rank, world_size, local_rank):
    """Run one job in its directory and environment (the harness's job_env() at the time,
    torchrun's variables kept), stdout and stderr into its files; returns the status."""
    os.chdir(job["cwd"])
    environ = dict(os.environ)
    os.environ.clear()
    os.environ.update({k: v for k, v in environ.items() if LAUNCHER_ENV.match(k)}, **job["env"])
    saved = os.dup(1), os.dup(2)
    with open(f"{job['out']}-rank{rank}.out", "wb") as out, \
            open(f"{job['out']}-rank{rank}.err", "wb") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            as_a_fresh_process(job)
            return entry.run(job["argv"], rank, world_size, local_rank)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            os.environ.clear()
            os.environ.update(environ)


def as_a_fresh_process(job):
    """Forget what an earlier job left in this process that a new one would not find: the
    grouped product's probe (the first MoE forward of a process runs it, inside whatever
    recompute that forward is in: moe/experts.py), and, for a compiling job
    (harness.run_job(compile_in_server=True)), dynamo's caches."""
    import moe.experts
    moe.experts._GROUPED_OK.clear()
    if "trainer.compile=true" in job["argv"]:
        import torch._dynamo
        torch._dynamo.reset()  # compiles its blocks anew, within dynamo's limits


def can_run_another(code):
    """After a job that returned `code` on this rank: 0, or 2 with the job's process group
    (if it got that far) destroyed; anything else may have left state behind."""
    if code not in (0, 2):
        return False
    if dist.is_initialized():  # a UserError after main's init_process_group
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001  (a group that cannot be left: a new server)
            return False
    return True


def serve(control):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    with open(os.path.join(control, f"jobs-{rank}.fifo")) as jobs, \
            open(os.path.join(control, f"done-{rank}.fifo"), "w") as done:
        for line in jobs:  # blocks until the harness sends a job; ends when it closes
            code = run_one(json.loads(line), rank, world_size, local_rank)
            again = can_run_another(code)
            gc.collect()  # the job's cycles (its process groups among them) go now, as at exit
            done.write(f"{code} {'next' if again else 'end'}\n")
            done.flush()
            if not again:
                break  # the harness stops the server, and the next job starts a new one


if __name__ == "__main__":
    serve(sys.argv[1])
    entry.flush_and_exit(0)
