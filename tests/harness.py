"""Run real jobs (python / torchrun, gloo, 1 thread per rank) and compare them.

The parity harness every strategy's tests use:

    ref = run_metrics(tmp_path, 1, ["parallel.dp=single"])
    got = run_metrics(tmp_path, 2, ["parallel.dp=torch_ddp"])
    assert_parity(ref, got)            # rtol 1e-5 per step; returns the max diff

Jobs run main.py in a fresh directory under tmp_path with a tiny model
(TINY) on the embedded corpus, so no test needs ../shared or a network.
Every job has a timeout: a hang fails the test instead of stalling CI, and
kills the job's whole process tree (kill_tree: torchrun's workers run in
sessions of their own, so killing the launcher alone leaves them running).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(REPO, "main.py")
if REPO not in sys.path:  # a worker started as a script has only tests/ on its path
    sys.path.insert(1, REPO)
from launch import process_tree  # noqa: E402
import fork_server  # noqa: E402  (tests/: beside this file)
import prefetch  # noqa: E402

# batch 12 divides by dp 1, 2, 3, 4 and 6; a 2-layer model keeps every job short
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "data.block_size=16",
        "trainer.batch_size=12", "trainer.max_steps=6", "trainer.warmup_steps=2",
        "trainer.log_every=1", "trainer.eval_every=0", "trainer.save_every=0",
        "sample.length=0", "wandb.mode=disabled", "parallel.timeout_s=60",
        "trainer.device=cpu"]  # the gloo matrix: on CPU also on a machine with GPUs


def job_env(forked=True):
    """The environment of a job's processes: one thread per rank, unbuffered output, no
    inherited MASTER_ADDR. `forked`: its interpreters come from the session's fork server
    (tests/fork_server.py: torch imported once, not in every process); False for a test
    whose processes must start and leave as real interpreters."""
    # PYTHON: the interpreter scripts (scripts/gpu_smoke.sh) start jobs with; this one, not
    # whatever `python` PATH finds (without the environment activated: no torch)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_SILENT="true",
               PYTHONUNBUFFERED="1", PYTHON=sys.executable)
    for name in ("MASTER_ADDR", "FORK_SERVER_SOCKET", "PYTHON_EXEC"):
        env.pop(name, None)
    directory = _fork_server(env) if forked and FORK_SERVER else None
    if directory:
        env.update(stand_in_env(directory))
    return env


FORK_SERVER = os.environ.get("TEST_FORK_SERVER", "1") != "0"
_fork = {}  # "proc", "dir": the session's fork server, once started; or "failure"


def python():
    """The `python` a test starts processes with: the fork server's stand-in, which
    behaves as this interpreter (and starts it when job_env(forked=False) says so)."""
    directory = _fork_server(job_env(forked=False)) if FORK_SERVER else None
    return os.path.join(directory, "python") if directory else sys.executable


def stand_in_env(directory):
    """Where the stand-in asks, and the stand-in as PYTHON (scripts/gpu_smoke.sh's
    interpreter) and PYTHON_EXEC (what torchrun starts its ranks with)."""
    stand_in = os.path.join(directory, "python")
    return dict(FORK_SERVER_SOCKET=os.path.join(directory, "socket"), PYTHON=stand_in,
                PYTHON_EXEC=stand_in)


def _fork_server(env):
    """Start the session's fork server (first use); returns its directory, or None when it
    could not start: the session then runs real interpreters, and test_fork_server.py
    fails with the reason (fork_server_failure)."""
    if "dir" in _fork or "failure" in _fork:
        return _fork.get("dir")
    proc, directory, failure = start_fork_server(env)
    if failure:
        _fork["failure"] = failure
        return None
    _fork.update(proc=proc, dir=directory)
    return directory


def start_fork_server(env):
    """A fork server started with `env`: (its process, its directory, None), or (None,
    None, why it did not start). Its stand-in is DIR/python; closing the process's stdin
    stops it."""
    import select
    import tempfile
    directory = tempfile.mkdtemp(prefix="fork-server-")
    if len(directory) > 80 and os.path.isdir("/tmp"):  # a socket's path has at most 107 bytes
        os.rmdir(directory)
        directory = tempfile.mkdtemp(prefix="fork-server-", dir="/tmp")
    fork_server.write_stand_in(directory, sys.executable)
    env = dict(env, **stand_in_env(directory))
    with open(os.path.join(directory, "server.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, fork_server.__file__, directory], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                cwd=directory)
    ready, _, _ = select.select([proc.stdout], [], [], 300)
    if not ready or proc.stdout.readline() != b"ready\n":
        kill_tree(proc.pid)
        proc.wait()
        failure = f"the fork server did not start:\n{_read(log.name)[-3000:]}"
        shutil.rmtree(directory, ignore_errors=True)
        return None, None, failure
    return proc, directory, None


def fork_server_failure():
    """Why the session's fork server did not start (None: it runs, or is turned off)."""
    python()  # starts it if it is on and not started yet
    return _fork.get("failure")


def stop_fork_server():
    """Its forked processes die with it (it kills them; PR_SET_PDEATHSIG besides)."""
    proc = _fork.pop("proc", None)
    if proc is not None:
        stop_a_fork_server(proc, _fork.pop("dir"))


def stop_a_fork_server(proc, directory):
    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
    shutil.rmtree(directory, ignore_errors=True)


def command(nproc, overrides, launcher_args=()):
    if nproc == 1 and not launcher_args:
        launcher = [python(), MAIN]
    else:  # --standalone picks a free port for the rendezvous
        launcher = [python(), "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={nproc}", *launcher_args, MAIN]
    return launcher + list(overrides)


def run_tree(cmd, timeout, what, **popen_kw):
    """Run `cmd` to completion, output captured; returns the CompletedProcess (never
    raises on exit code). On timeout its whole process tree is killed (torchrun's
    workers outlive a killed launcher) and the test fails with the output so far."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen_kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"{what} hung for {timeout}s\n{out[-3000:]}\n{err[-5000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_job(workdir, nproc, overrides, timeout=240, tiny=True, fresh=False, forked=True,
            compile_in_server=False):
    """Run main.py in `workdir`; returns the CompletedProcess (never raises on exit code).

    By default the job runs in this session's job server for `nproc` ranks (JobServer:
    main.py's own code in long-lived torchrun workers, a fraction of a fresh job's CPU);
    `fresh=True` starts torchrun (or python) for this job alone: for jobs whose exit through
    a real launch (its status, its console) is what the test checks; `forked=False`, with
    interpreters that start and leave for real (not forked by the fork server).
    `compile_in_server`: a compiling job runs in the server too, after dynamo's caches are
    reset there (tests/job_server.py), for tests of its numbers, not of its compilations."""
    os.makedirs(workdir, exist_ok=True)
    args = (TINY if tiny else []) + list(overrides)
    if not fresh and not needs_own_process(args, compile_in_server):
        return job_server(nproc).run(args, str(workdir), timeout)
    return run_tree(command(nproc, args), timeout, f"job {args}", cwd=workdir,
                    env=job_env(forked=forked))


def needs_own_process(args, compile_in_server=False):
    """Jobs whose process-wide state would outlive them in a job server: compilation
    (dynamo's caches: a later compiled job would compile nothing, unless the server resets
    them first) and wandb (its run and service belong to the process)."""
    value = lambda key, default: next((a.split("=", 1)[1] for a in reversed(args)
                                       if a.startswith(key + "=")), default)
    compiles = value("trainer.compile", "false") == "true" and not compile_in_server
    return compiles or value("wandb.mode", "offline") != "disabled"


# launcher variables: the server's own, never a job's
LAUNCHER_ENV = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|"
                          r"ROLE_RANK|ROLE_WORLD_SIZE|ROLE_NAME|MASTER_ADDR|MASTER_PORT|"
                          r"TORCHELASTIC_.*|TORCH_NCCL_ASYNC_ERROR_HANDLING|OMP_NUM_THREADS)$")


class JobServer:
    """One torchrun launch of tests/job_server.py on `nproc` ranks that runs main.py's jobs
    one after another (its docstring says why and what it leaves to fresh jobs). Each rank
    reads a job from its FIFO and answers on another with the exit status and whether it
    can run the next job (0, or 2 with its process group destroyed); a job after which a
    rank cannot, or that hangs (its whole tree killed), ends the server, and the next job
    starts a new one."""

    def __init__(self, nproc):
        import tempfile
        self.nproc, self.jobs = nproc, 0
        self.control = tempfile.mkdtemp(prefix=f"job-server-{nproc}-")
        for rank in range(nproc):
            for kind in ("jobs", "done"):
                os.mkfifo(os.path.join(self.control, f"{kind}-{rank}.fifo"))
        # read-write ends: opening never blocks, and the server's opens never wait for us
        self.job_fds = [os.open(os.path.join(self.control, f"jobs-{r}.fifo"), os.O_RDWR)
                        for r in range(nproc)]
        self.done_fds = [os.open(os.path.join(self.control, f"done-{r}.fifo"), os.O_RDWR)
                         for r in range(nproc)]
        self.env = job_env()
        self.log = open(os.path.join(self.control, "torchrun.log"), "w")
        self.proc = subprocess.Popen(
            [python(), "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={nproc}", os.path.join(REPO, "tests", "job_server.py"), self.control],
            stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=self.control)

    def alive(self):
        return self.proc.poll() is None

    def run(self, args, workdir, timeout):
        import select
        self.jobs += 1
        out = os.path.join(workdir, f"job-server-{self.jobs:04d}")
        env = {k: v for k, v in job_env().items() if not LAUNCHER_ENV.match(k)}
        job = {"argv": list(args), "cwd": workdir, "out": out, "env": env}
        line = (json.dumps(job) + "\n").encode()
        for fd in self.job_fds:
            os.write(fd, line)
        codes, again, pending = {}, {}, dict(zip(self.done_fds, range(self.nproc)))
        deadline = time.time() + timeout
        try:
            while pending and self.alive() and time.time() < deadline:
                ready, _, _ = select.select(list(pending), [], [], min(1.0, deadline - time.time()))
                for fd in ready:
                    rank = pending.pop(fd)
                    code, then = os.read(fd, 64).decode().split()[:2]
                    codes[rank], again[rank] = int(code), then == "next"
        except BaseException:  # pytest's timeout, Ctrl-C: the job may still be running
            self.stop()
            raise
        output = lambda kind: "".join(_read(f"{out}-rank{r}.{kind}") for r in range(self.nproc))
        if pending:
            what = "hung" if time.time() >= deadline else "died"
            self.stop()  # killed first: its ranks' last output is in the files now
            raise AssertionError(f"job {args} {what} in the {self.nproc}-rank job server\n"
                                 f"{output('out')[-3000:]}\n{output('err')[-5000:]}\n"
                                 f"torchrun: {self.launcher_log[-3000:]}")
        code = next((c for c in codes.values() if c != 0), 0)
        if not all(again.values()):  # a rank has left the server: no next job here
            self.stop()
        return subprocess.CompletedProcess(["job-server", *args], code, output("out"), output("err"))

    def stop(self):
        for fd in self.job_fds + self.done_fds:
            os.close(fd)
        self.job_fds = self.done_fds = []
        if self.alive():
            kill_tree(self.proc.pid)
        self.proc.wait()
        self.log.close()
        self.launcher_log = _read(self.log.name)
        shutil.rmtree(self.control, ignore_errors=True)  # FIFOs and torchrun's log


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


_servers = {}


RANK_BYTES = 400 << 20  # what an idle server's rank holds (about 330 MB), with a margin


def _rank_budget():
    """Ranks the idle servers may hold together: half the memory free when the session
    starts. Each process count the suite uses (1, 2, 3, 4, 8) keeps its server where that
    fits: a server stopped for room costs a new launch (about 3.5 CPU-s a rank) when its
    process count comes back."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 10
    # at least 10: one server for each of 1, 2, 3 and 4 ranks, the counts jobs mix
    # (test_resume_matrix.py's chain goes 1-2-3-2-3-2-2-4-4-1)
    return max(10, int(free // 2 // RANK_BYTES))


RANK_BUDGET = _rank_budget()


def job_server(nproc):
    """This session's job server for `nproc` ranks (started on first use, or again after
    a job ended the last one); past RANK_BUDGET ranks the least recently used ones stop."""
    server = _servers.pop(nproc, None)
    if server is not None and not (server.alive() and server.job_fds):
        if server.job_fds:
            server.stop()
        server = None
    if server is None:
        while _servers and sum(_servers) + nproc > RANK_BUDGET:
            _servers.pop(next(iter(_servers))).stop()
        server = JobServer(nproc)
    _servers[nproc] = server  # most recently used last
    return server


def stop_job_servers():
    for server in _servers.values():
        if server.job_fds:
            server.stop()
    _servers.clear()


def kill_tree(launcher_pid, timeout=10):
    """SIGKILL a launcher and every process below it (launch/process_tree.py), the
    processes forked for stand-ins included, and fail if any survives."""
    killed, survivors = process_tree.kill_tree(launcher_pid, timeout, children=_children)
    assert not survivors, f"processes {survivors} survived SIGKILL"
    return killed


def forked_process(pid):
    """The process the fork server forked for stand-in `pid` (None if it is none)."""
    return fork_server.forked_for(_fork["dir"], pid) if "dir" in _fork else None


def workers_of(launcher_pid):
    """A launch's ranks (torchrun's children), whether its torchrun was forked for a
    stand-in or started for real. A rank is its stand-in where it has one: a signal sent
    to it reaches the rank, and /proc/<pid>/environ holds the rank's RANK."""
    return process_tree.workers_of(forked_process(launcher_pid) or launcher_pid)


def _children(pid):
    forked = forked_process(pid)
    return process_tree.workers_of(pid) + ([forked] if forked else [])


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_metrics(tmp_path, nproc, overrides, **kw):
    """Run a job that must succeed; return its metrics.jsonl records (loss,
    grad_norm, ...: what assert_parity compares)."""
    workdir = os.path.join(str(tmp_path), f"job-{uuid.uuid4().hex[:8]}")
    result = run_job(workdir, nproc, overrides, **kw)
    assert result.returncode == 0, f"job failed ({result.returncode}): {overrides}\n" \
                                   f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return read_metrics(os.path.join(workdir, "runs", "default"))


def snapshot_model(snapshot_dir):
    """The canonical model parameters of the snapshot in `snapshot_dir`, in the
    model's own parameter order."""
    from model import GPT, GPTConfig
    from checkpoint.snapshot_reader import open_snapshot
    reader = open_snapshot(str(snapshot_dir))
    names = [n for n, _ in GPT(GPTConfig(**reader.meta["gpt_config"])).named_parameters()]
    return {n: reader.read_full(f"model/{n}") for n in names}


def snapshot_state(snapshot_dir):
    """{"model": {name: tensor}, "optimizer": {"state": {name: {field: tensor}}}} of a
    snapshot, in canonical names, for comparing final states across layouts."""
    from checkpoint.canonical import optimizer_state_from
    from checkpoint.snapshot_reader import open_snapshot
    return {"model": snapshot_model(snapshot_dir),
            "optimizer": {"state": optimizer_state_from(open_snapshot(str(snapshot_dir)))}}


def our_frames(text):
    """The traceback frames (`File "..."` lines) of `text` that are in this project's
    own source: under the checkout, but not in a virtual environment or a
    site-packages that happens to live there (`python -m venv .venv` in the
    repository root puts torchrun's own frames under the checkout too)."""
    repo = os.path.realpath(REPO)
    ours = []
    for path in re.findall(r'File "([^"]+)"', text):
        real = os.path.realpath(path)
        if not os.path.isabs(path) or not real.startswith(repo + os.sep):  # "<frozen runpy>"
            continue
        parts = os.path.relpath(real, repo).split(os.sep)
        in_env = any(p in ("site-packages", "dist-packages") for p in parts) or any(
            os.path.exists(os.path.join(repo, *parts[:i], "pyvenv.cfg")) for i in range(1, len(parts)))
        if not in_env:
            ours.append(path)
    return ours


def max_rel_diff(ref, got):
    return max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref, got))


def assert_parity(ref, got, rtol=1e-5):
    """Per-step losses -- and pre-clip gradient norms, where both sides are metrics
    records -- equal within rtol. Returns the max relative loss difference.

    The gradient norm matters: AdamW is invariant to the gradient's scale, so a
    strategy that sums gradients instead of averaging them trains identical losses;
    its gradient norm is dp times too large."""
    assert len(ref) == len(got) and ref, f"different step counts: {len(ref)} vs {len(got)}"
    loss = lambda rs: [r["loss"] if isinstance(r, dict) else r for r in rs]
    diff = max_rel_diff(loss(ref), loss(got))
    assert diff <= rtol, f"max relative loss difference {diff:.3g} > {rtol}\n{loss(ref)}\n{loss(got)}"
    message = f"parity: max relative loss difference {diff:.3g}"
    if all(isinstance(r, dict) and "grad_norm" in r for r in list(ref) + list(got)):
        norms = [[r["grad_norm"] for r in rs] for rs in (ref, got)]
        norm_diff = max_rel_diff(*norms)
        assert norm_diff <= rtol, f"max relative grad-norm difference {norm_diff:.3g} > {rtol}\n{norms}"
        message += f", grad norm {norm_diff:.3g}"
    print(f"{message} over {len(ref)} steps")
    return diff


_worker_results = {}


def worker_result(script, world, timeout, *args):
    """The RESULT dict a torchrun test worker (tests/<script>, built on dp_worker.serve)
    prints, on `world` ranks with `args`: run once per test session and shared by every
    test that asks (run ahead on idle CPU when a test module declares it: prefetch.py);
    a failure or a hang (its whole process tree killed) fails every test that asks, with
    the worker's output."""
    key = prefetch.key((script, world, timeout, *args))
    if key not in _worker_results:
        ran_ahead, outcome = prefetch.claim(key)
        _worker_results[key] = outcome if ran_ahead else _run_worker((script, world, timeout, *args))
    result, failure = _worker_results[key]
    assert failure is None, failure
    return result


def _worker_command(spec):
    script, world, _timeout, *args = spec
    return [python(), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
            os.path.join(REPO, "tests", script), *args], f"{script} on {world} ranks"


def _run_worker(spec):
    """(RESULT dict, None), or (None, why it failed) for spec (script, world, timeout, *args)."""
    cmd, what = _worker_command(spec)
    try:
        out = run_tree(cmd, spec[2], what, env=job_env())
    except AssertionError as hung:  # run_tree killed the tree
        return None, str(hung)
    return _worker_outcome(what, out)


def _worker_outcome(what, out):
    found = re.search(r"^RESULT (.*)$", out.stdout, re.M)
    if out.returncode == 0 and found:
        return json.loads(found.group(1)), None
    return None, f"{what} failed ({out.returncode})\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"


def _launch_ahead(spec):
    """A session run ahead (prefetch.py): idle priority, its output in files."""
    import tempfile
    cmd, _ = _worker_command(spec)
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=prefetch.env_for_background(job_env()),
                            preexec_fn=prefetch.idle_priority)
    return proc, out, err


def _finish_ahead(spec, handle, hung):
    proc, *files = handle
    cmd, what = _worker_command(spec)
    if hung:
        kill_tree(proc.pid)
    proc.wait()
    out, err = map(_read_back, files)
    if hung:
        return None, f"{what} hung for {spec[2] * prefetch.SLACK}s\n{out[-3000:]}\n{err[-5000:]}"
    return _worker_outcome(what, subprocess.CompletedProcess(cmd, proc.returncode, out, err))


def _read_back(file):
    with file:
        file.seek(0)
        return file.read().decode(errors="replace")


def prefetch_worker_sessions(specs):
    """Start the worker sessions `specs` ((script, world, timeout, *args), in the order
    the tests will ask) ahead, on idle CPU (conftest.py, after collection)."""
    prefetch.start(specs, _launch_ahead, _finish_ahead, kill_tree)


def layout_session(world):
    """tests/layout_worker.py on `world` ranks, as worker_result and the worker_sessions
    mark name it."""
    return ("layout_worker.py", world, 600)


LAYOUT_SESSIONS = [layout_session(world) for world in (2, 4, 8)]  # layout_worker.CASES' worlds


def layout_worker_result(world):
    """tests/layout_worker.py's RESULT on `world` ranks (tests/test_tp.py, test_pp.py,
    test_cp.py and others share it)."""
    return worker_result(*layout_session(world))


# tests/experts_worker.py launched alone: the mixture-of-experts layouts of 6 and 12 ranks
# (experts_worker.CASES' worlds that no layout session has)
EXPERTS_SESSIONS = [("experts_worker.py", world, 600) for world in (6, 12)]


def experts_worker_result(world):
    """{case name: measurements} of experts_worker.CASES[world]: from the layout session
    of `world` ranks, or from the experts' own (EXPERTS_SESSIONS)."""
    own = [s for s in EXPERTS_SESSIONS if s[1] == world]
    return worker_result(*own[0]) if own else layout_worker_result(world)["experts"]


def save_then_resume(tmp_path, saved, resumed, common=()):
    """Train 3 steps under one layout, (nproc, overrides); resume a copy of that snapshot
    under another to step 6. Returns the resumed job's records (steps 4-6)."""
    import shutil
    nproc, args = saved
    save_dir = tmp_path / f"save-{uuid.uuid4().hex[:6]}"
    result = run_job(save_dir, nproc, list(args) + list(common) + ["trainer.max_steps=3"])
    assert result.returncode == 0, result.stderr[-3000:]
    snapshot = tmp_path / f"snapshot-{uuid.uuid4().hex[:6]}"
    shutil.copytree(save_dir / "runs" / "default" / "snapshot", snapshot)
    nproc, args = resumed
    resume_dir = tmp_path / f"resume-{uuid.uuid4().hex[:6]}"
    result = run_job(resume_dir, nproc, list(args) + list(common) +
                     ["trainer.max_steps=6", f"trainer.snapshot_path={snapshot}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 3" in result.stdout, result.stdout[-2000:]
    records = read_metrics(resume_dir / "runs" / "default")
    assert [r["step"] for r in records] == [4, 5, 6]
    return records


def assert_layout_matches(r):
    """A layout_worker case: the single-process run, step by step, to fp32 tolerance."""
    assert r["loss_rel_diff"] <= 1e-5, r
    assert r["norm_rel_diff"] <= 1e-5, r
    assert r["eval_rel_diff"] <= 1e-5, r  # validation loss of the trained model
    assert all(r["replicated_equal"]), f"replicated tensors differ across TP ranks: {r}"
    assert r["shapes_canonical"], "state_dict() must hold single-device names and shapes only"
    # AdamW's first steps move every element by about lr (3e-3) whatever its gradient's size,
    # so elements whose gradient is ~1e-8 may differ by a fraction of that; a wrong slice
    # or a lost update would differ by whole steps
    assert r["param_max_abs_diff"] < 1e-3, r


# words of the embedded corpus, and runs of spaces and line breaks: merges that make a
# tokenization change when a chunk boundary splits a pre-tokenizer piece
TINY_BPE_WORDS = ["the", " the", " river", " crown", " tower", "KING", "QUEEN", " old", " my",
                  " lord", "ing", " sh", " shall", "  ", "   ", "\n\n", " \n", "ab", " a"]


def tiny_gpt2_cache(directory, words=TINY_BPE_WORDS):
    """A TIKTOKEN_CACHE_DIR holding a small BPE in GPT-2's two files, named as tiktoken
    caches GPT-2's own (the sha1 of the download URL): data.tokenizer=gpt2 then loads it
    through the code path of the real one, with no network. Returns the directory."""
    from data.tokenizer import cache_gpt2_files, data_gym_files
    return cache_gpt2_files(directory, data_gym_files(words))
