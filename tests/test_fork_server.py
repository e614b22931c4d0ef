"""The fork server (tests/fork_server.py) forks the suite's fresh processes from one that
has imported torch. What a test sees of a forked process must be what the interpreter it
stands for gives: each program below runs both ways, real (job_env(forked=False)) and
forked, and their exit status, stdout and stderr must be equal; a signal to the stand-in
reaches the process, a SIGKILL of the stand-in kills it, and a request whose startup
environment differs from the server's gets a real interpreter. test_job_server.py holds
a forked job's metrics and snapshot to a real one's, to the bit."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from harness import fork_server_failure, job_env, python


@pytest.fixture(autouse=True)
def server_running():
    """Every test here needs the server; one that could not start says why (the rest of
    the suite then runs real interpreters)."""
    import harness
    if not harness.FORK_SERVER:
        pytest.skip("TEST_FORK_SERVER=0: no fork server in this session")
    assert fork_server_failure() is None, fork_server_failure()

PROGRAMS = {
    "status and streams": "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)",
    "sys.exit with a message": "import sys; sys.exit('stopped: bad input')",
    "a traceback": "def f():\n    raise ValueError('boom')\nf()",
    "argv, cwd, environment, path": "import os, sys; print(sys.argv, os.getcwd(), "
                                    "os.environ['PROBE'], sys.path[0], __name__)",
    # what an interpreter does on its way out: a non-daemon thread finishes, atexit runs,
    # a file the program left open is flushed
    "leaving": "import atexit, threading, time\n"
               "atexit.register(lambda: print('atexit'))\n"
               "def late():\n    time.sleep(0.2)\n    print('thread')\n"
               "threading.Thread(target=late).start()\n"
               "f = open('left-open.txt', 'w'); f.write('flushed')\n",
    # PYTHONPATH's directories on sys.path, after the script's; its sitecustomize imported
    "PYTHONPATH and sitecustomize": "import sys, hook; print(sys.path.index(hook.HERE), hook.STARTED)",
    "a SIGTERM handler": "import os, signal, sys, time\n"
                         "signal.signal(signal.SIGTERM, lambda *_: (print('term'), sys.exit(7)))\n"
                         "open('ready', 'w').close()\n"
                         "time.sleep(60)\n",
    "no handler": "import time; open('ready', 'w').close(); time.sleep(60)",
    # a process that SIGKILLs itself (tests/ft_kill_worker.py): the stand-in dies of it too
    "killing itself": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
}
SIGNALLED = ("a SIGTERM handler", "no handler")


def run(how, args, cwd, signal_when_ready=None, env_extra=None):
    site = os.path.join(cwd, "site")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write("import hook\nhook.STARTED = True\n")
    with open(os.path.join(site, "hook.py"), "w") as f:
        f.write("import os\nHERE = os.path.dirname(os.path.abspath(__file__))\nSTARTED = False\n")
    env = dict(job_env(forked=how == "forked"), PROBE="probe", PYTHONPATH=site, **(env_extra or {}))
    interpreter = python() if how == "forked" else sys.executable
    proc = subprocess.Popen([interpreter, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if signal_when_ready:
        deadline = time.time() + 60
        while not os.path.exists(os.path.join(cwd, "ready")) and time.time() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal_when_ready)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out.replace(str(cwd), "CWD"), err.replace(str(cwd), "CWD")


@pytest.mark.parametrize("name", PROGRAMS)
def test_a_forked_process_gives_what_the_interpreter_gives(tmp_path, name):
    results = {}
    for how in ("real", "forked"):
        cwd = tmp_path / how
        cwd.mkdir()
        results[how] = run(how, ["-c", PROGRAMS[name], "an argument"], cwd,
                           signal.SIGTERM if name in SIGNALLED else None)
        if name == "leaving":
            assert (cwd / "left-open.txt").read_text() == "flushed", how
    print(results)
    assert results["forked"] == results["real"]


def test_a_script_and_a_module_run_as_main_with_their_argv(tmp_path):
    (tmp_path / "probe.py").write_text(
        "import sys\nprint(__name__, sys.argv[1:], sys.path[0] == %r, __file__.endswith('probe.py'))\n"
        "raise SystemExit(int(sys.argv[1]))\n" % str(tmp_path))
    for status, args in ((4, ["probe.py", "4", "x"]), (5, [str(tmp_path / "probe.py"), "5"]),
                         (6, ["-u", "-m", "probe", "6"])):
        real, forked = (run(how, args, tmp_path) for how in ("real", "forked"))
        assert forked == real and real[0] == status, (args, real, forked)


def preloaded(env_extra=None):
    env = dict(job_env(), **(env_extra or {}))
    out = subprocess.run([python(), "-c", "import sys; print('torch' in sys.modules)"],
                         env=env, capture_output=True, text=True, timeout=120)
    return out.stdout.strip()


def test_the_stand_in_is_forked_unless_the_startup_environment_differs():
    assert preloaded() == "True"  # the server's process: torch imported already
    # TORCH_LOGS is read when torch is imported: the server's import did not see it
    assert preloaded({"TORCH_LOGS": "+dynamo"}) == "False"
    assert preloaded({"FORK_SERVER_SOCKET": ""}) == "False"
    assert preloaded({"PYTHONPATH": os.devnull}) == "True"  # taken: become() puts it on the path
    # thread counts: taken where OpenMP's and MKL's agree (become() sets torch's)
    assert preloaded({"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}) == "True"
    assert preloaded({"OMP_NUM_THREADS": "2"}) == "False"  # MKL's still 1
    assert preloaded({"TORCHINDUCTOR_CACHE_DIR": os.devnull}) == "True"  # read when compiling


def test_the_server_has_not_initialized_cuda_when_it_forks():
    """On a GPU machine a forked process can use CUDA only if the server never initialized
    it (its imports must not; it refuses to serve otherwise). A forked process sees the
    server's state (a CPU machine: never initialized; the check matters on a GPU one)."""
    out = subprocess.run([python(), "-c", "import sys, torch; print('torch' in sys.modules "
                          "and not torch.cuda.is_initialized())"], env=job_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out


def test_another_thread_count_and_inductor_cache_are_what_the_interpreter_sees(tmp_path):
    """bench.run's jobs: the single process with 2 threads, each variant's own inductor
    cache. Forked (not refused: above), the process must see both as a real interpreter
    started with them does."""
    extra = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
             "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    code = ("import torch\nfrom torch._inductor.runtime.cache_dir_utils import cache_dir\n"
            "print(torch.get_num_threads(), torch.get_num_interop_threads(), cache_dir())")
    real, forked = (run(how, ["-c", code], tmp_path, env_extra=extra) for how in ("real", "forked"))
    assert forked == real, (real, forked)
    assert real[1].split()[0] == "2" and real[1].split()[2] == "CWD/inductor", real


# the session's PYTHONPATH (the server's), what a request adds to its own, whether it forks
SESSION_PYTHONPATHS = {
    "unrelated": (["users"], [], True),
    # the checkout (which holds the server's script, and may hold the venv: a clone in the
    # system's temporary directory with PYTHONPATH=/tmp is this case) and the interpreter's
    # prefix: directories above the files of what the server imported, not where it found them
    "above the server's modules": (["users", "REPO", "PREFIX"], [], True),
    # a package the server preloads, imported from the session's PYTHONPATH: the child
    # cannot unimport it
    "holds a preloaded package": (["users", "packages"], [], False),
    # the request's own PYTHONPATH holds one: a real interpreter would import that copy
    "the request's holds a preloaded package": (["users"], ["packages"], False),
}


@pytest.mark.parametrize("case", SESSION_PYTHONPATHS)
def test_a_session_with_its_own_pythonpath_forks_requests_with_another(tmp_path, case):
    """A user's shell (a cluster's module) may set PYTHONPATH: the server (started with the
    session's environment) then has it on its sys.path. A request that sets its own (the
    tests' sitecustomize hooks) is still forked, with the request's directories in place
    of the server's, as the interpreter would have them, unless a module the server
    imported would come from elsewhere in that interpreter (fork_server._pythonpath_refusal):
    then it gets a real interpreter."""
    from harness import REPO, stand_in_env, start_fork_server, stop_a_fork_server
    import omegaconf
    session, added, forks = SESSION_PYTHONPATHS[case]
    (tmp_path / "users").mkdir()
    (tmp_path / "users" / "users_module.py").write_text("")
    shutil.copytree(os.path.dirname(omegaconf.__file__), tmp_path / "packages" / "omegaconf")
    where = dict(REPO=REPO, PREFIX=sys.prefix)
    pythonpath = lambda names: [where.get(n) or str(tmp_path / n) for n in names]
    probe = ("import importlib.util, sys, hook\n"
             "print(sys.path.index(hook.HERE), hook.STARTED, importlib.util.find_spec('users_module'))\n"
             "print('omegaconf' in sys.modules)")
    # a server that preloads only omegaconf: whether a process has it shows it forked
    server_env = dict(job_env(forked=False), PYTHONPATH=os.pathsep.join(pythonpath(session)),
                      FORK_SERVER_PRELOAD="omegaconf")
    proc, directory, failure = start_fork_server(server_env)
    assert failure is None, failure
    try:
        results = {}
        for how in ("real", "forked"):
            cwd = tmp_path / how
            site = cwd / "site"
            site.mkdir(parents=True)
            (site / "sitecustomize.py").write_text("import hook\nhook.STARTED = True\n")
            (site / "hook.py").write_text("import os\nHERE = os.path.dirname(os.path.abspath(__file__))\n"
                                          "STARTED = False\n")
            env = dict(server_env, **stand_in_env(directory),
                       PYTHONPATH=os.pathsep.join([str(site), *pythonpath(added)]))
            interpreter = os.path.join(directory, "python") if how == "forked" else sys.executable
            out = subprocess.run([interpreter, "-c", probe], cwd=cwd, env=env, capture_output=True,
                                 text=True, timeout=120)
            results[how] = out.returncode, out.stdout.splitlines(), out.stderr
    finally:
        log = open(os.path.join(directory, "server.log")).read()
        stop_a_fork_server(proc, directory)
    print(case, results, log)
    (code, lines, err), (real_code, real_lines, real_err) = results["forked"], results["real"]
    assert (code, lines[0], err) == (real_code, real_lines[0], real_err)
    assert lines[0] == "1 True None"  # the request's site after the script's; not the server's
    # forked (omegaconf preloaded) unless a module the server imported would come from elsewhere
    assert lines[1] == str(forks) and real_lines[1] == "False", log
    assert ("refused" in log) != forks, log


def test_a_sigkill_of_the_stand_in_kills_the_forked_process(tmp_path):
    from launch.process_tree import alive
    proc = subprocess.Popen([python(), "-c", "import os, time\nopen('pid', 'w').write(str(os.getpid()))\n"
                             "time.sleep(60)"], cwd=tmp_path, env=job_env())
    deadline = time.time() + 60
    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
        assert time.time() < deadline and proc.poll() is None, "the program never started"
        time.sleep(0.01)
    forked = int((tmp_path / "pid").read_text())
    assert forked != proc.pid
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while alive(forked) and time.time() < deadline:
        time.sleep(0.01)
    assert not alive(forked), "the forked process outlived its stand-in"


def test_stand_ins_that_vanish_leave_the_server_serving(tmp_path):
    """A stand-in killed before it asks, while it asks, or right after (a SIGKILLed
    launch's ranks): the server goes on, and the process forked for the last one dies."""
    import json
    import socket
    from launch.process_tree import alive
    path = job_env()["FORK_SERVER_SOCKET"]
    request = dict(kind="code", target="import os, time\nopen('pid', 'w').write(str(os.getpid()))\n"
                   "time.sleep(60)", args=[], unbuffered=True, env=job_env(), cwd=str(tmp_path),
                   umask=0o22, pid=os.getpid(), sched=(os.sched_getscheduler(0), 0))
    line = json.dumps(request).encode() + b"\n"
    with open(os.devnull, "r+") as null:
        for sent in (b"", line[:40], line):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(path)
                if sent:
                    socket.send_fds(conn, [sent], [null.fileno()] * 3)
                if sent == line:  # gone once the process runs
                    deadline = time.time() + 60
                    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
                        assert time.time() < deadline, "the program never started"
                        time.sleep(0.01)
    forked = int((tmp_path / "pid").read_text())
    deadline = time.time() + 10
    while alive(forked) and time.time() < deadline:
        time.sleep(0.01)
    assert not alive(forked), "the forked process outlived its stand-in"
    assert preloaded() == "True"  # the server still serves


def test_the_full_exit_tears_down_as_the_interpreter_does(tmp_path):
    """FORK_SERVER_FULL_EXIT=1 (test_clean_exit's jobs): the forked process leaves through
    the interpreter's teardown, which finalizes what other modules hold; the default way
    out skips it (what a program sees otherwise is the same: the programs above)."""
    code = ("import sys, types\nclass Last:\n    def __del__(self):\n        print('torn down')\n"
            "sys.modules['holder'] = types.ModuleType('holder')\nsys.modules['holder'].last = Last()\n")
    results = {}
    for how, full in (("real", "1"), ("forked", "1"), ("forked", "0")):
        env = dict(job_env(forked=how == "forked"), FORK_SERVER_FULL_EXIT=full)
        out = subprocess.run([python() if how == "forked" else sys.executable, "-c", code],
                             env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        results[how, full] = out.returncode, out.stdout, out.stderr
    assert results["forked", "1"] == results["real", "1"] == (0, "torn down\n", ""), results
    assert results["forked", "0"] == (0, "", ""), results
