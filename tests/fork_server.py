"""Test-only: a `python` whose `import torch` is already done (the harness's fresh jobs).

    python tests/fork_server.py DIR      # serves DIR/socket; DIR/python is the stand-in

Every fresh process of the suite (each torchrun launcher, each rank, each worker) spends
about 4.7 CPU-s importing torch and dynamo before it does anything, and 1.3 more tearing
torch's modules down at exit; the suite starts some two hundred. This server imports them
once, then forks a process for each `python ...` the suite starts, so a fresh job pays
for its own work only. What a forked process runs is what `python` would: the script
(or -m module, or -c code) as `__main__`, its argv, environment, working directory,
stdin/stdout/stderr, scheduling policy, PYTHONPATH on sys.path and its sitecustomize.py
imported; it is a real process of its own, on its own gloo sockets, with its own exit.
What it skips is the imports and the teardown (`leave`): whatever the interpreter's
start reads from the environment (OMP_NUM_THREADS, TORCH_*, ...) must equal this
server's, or the request is refused and the stand-in starts a real interpreter; a
PYTHONPATH of its own is taken unless a module imported here would come from elsewhere
in the interpreter it stands for (_pythonpath_refusal).

DIR/python (forked_python.py behind a shebang of this interpreter) is what the harness
starts in place of sys.executable, what torchrun starts for its ranks (PYTHON_EXEC) and
a forked process's sys.executable. It sends its argv, environment and standard streams
here, gets the forked pid, forwards the signals it receives to it (torchrun's SIGTERM to
its workers, a test's SIGTERM to a rank) and leaves with its exit status, or dies of its
signal. A stand-in that dies without a word (SIGKILL) has its process killed here at
once, and DIR/forked/<its pid> names its process meanwhile, so harness.kill_tree and
harness.workers_of walk a launch's tree through the stand-ins. Tests of an interpreter's
own start or exit use real ones (harness.job_env(forked=False)).

Single-threaded by construction (the environment holds OpenMP and BLAS at one thread;
checked before serving): a fork copies only the thread that calls it.
"""

import json
import os
import re
import selectors
import signal
import socket
import sys

# what the interpreter's start (or a preloaded import) reads from the environment: a
# request that differs from the server here gets a real interpreter (torchrun's
# TORCHELASTIC_* and TORCH_NCCL_* for its ranks are read later, by the launch and by NCCL;
# TORCHINDUCTOR_CACHE_DIR each time inductor looks for its cache: bench.run's per variant)
STARTUP_ENV = re.compile(r"^(PYTHON(?!UNBUFFERED$).*|TORCH(?!ELASTIC_|_NCCL_|INDUCTOR_CACHE_DIR$).*|"
                         r"PYTORCH.*|OMP_.*|MKL_.*|KMP_.*|GOMP_.*|OPENBLAS_.*|LD_.*|CUDA.*|NCCL.*)$")
# torch's intra-op threads, which OpenMP and MKL read at load: a request for another count
# (bench.run's one process gets as many threads as the others have ranks) is taken where
# both name it, and the child sets it before anything runs (become), as the interpreter
# would have at its start. The server holds no thread pool yet (a fork copies one thread).
THREAD_COUNTS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.run", "numpy", "omegaconf", "fsspec",
           "tiktoken", "ctypes"]


def _directories(pythonpath, base=None):
    """PYTHONPATH's directories, absolute (a relative one from `base`, default the cwd)."""
    return [os.path.abspath(os.path.join(base or os.getcwd(), p))
            for p in (pythonpath or "").split(os.pathsep) if p]


def _found_in(module):
    """The sys.path entries a top-level module was found in: DIR of DIR/m.py, DIR/m.*.so
    or DIR/m/__init__.py, or of each portion DIR/m of a namespace package."""
    file, path = getattr(module, "__file__", None), getattr(module, "__path__", None)
    if file:
        return [os.path.dirname(os.path.dirname(file)) if path is not None else os.path.dirname(file)]
    try:
        return [os.path.dirname(p) for p in path or ()]
    except TypeError:
        return []


def _top_level_names(directory):
    """The top-level modules a sys.path entry holds ahead of any later entry: m.py,
    m.pyc, m.*.so, packages m/__init__.* (a bare directory is a namespace portion, which
    every later module or package of that name wins over)."""
    import importlib.machinery
    suffixes = importlib.machinery.all_suffixes()
    try:
        entries = os.listdir(directory)
    except OSError:  # not a directory (os.devnull), or gone: it holds nothing
        return set()
    names = set()
    for entry in entries:
        if os.path.isdir(os.path.join(directory, entry)):
            if any(os.path.isfile(os.path.join(directory, entry, "__init__" + s)) for s in suffixes):
                names.add(entry)
        else:
            names.update(entry[:-len(s)] for s in suffixes if entry.endswith(s))
    return names


def _pythonpath_refusal(request, mine):
    """Why a request with a PYTHONPATH of its own cannot be forked, or "". The child puts
    the request's directories on sys.path in place of the server's and imports their
    sitecustomize (become), which is what the interpreter would have done unless a module
    the server imported would come from elsewhere in it: one the server found in a
    directory of its own PYTHONPATH (the child cannot unimport it), or one a directory of
    the request's holds (the interpreter would import that one). Where a module was found
    is the sys.path entry it came from, not a directory above its file: a PYTHONPATH of
    the checkout, which holds the server's script and a venv, shadows nothing."""
    server_dirs = set(_directories(mine.get("PYTHONPATH")))
    held = {name: module for name, module in list(sys.modules.items())
            if "." not in name and name != "__main__"}
    from_server = sorted(name for name, module in held.items()
                         if server_dirs.intersection(map(os.path.abspath, _found_in(module))))
    if from_server:
        return f"the server imported {from_server[:3]} from its own PYTHONPATH"
    for directory in _directories(request["env"].get("PYTHONPATH"), request["cwd"]):
        shadowed = sorted(_top_level_names(directory).intersection(held))
        if shadowed:
            return f"the request's PYTHONPATH holds {shadowed[:3]}, which the server imported"
    return ""


def _pythonpath(entries, server_entries):
    """As the interpreter's start does: PYTHONPATH's directories after the script's, in
    place of the server's, and their sitecustomize.py imported (after the server's
    imports, not before: the tests' hooks patch fsspec or a rank's start, which works
    either way)."""
    import importlib.machinery
    import importlib.util
    sys.path[:] = [p for p in sys.path if not p or os.path.abspath(p) not in server_entries]
    paths = _directories(entries)
    sys.path[1:1] = paths
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


def write_stand_in(directory, real_python):
    """DIR/python: forked_python.py run by `real_python` without site (milliseconds)."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "forked_python.py")) as f:
        source = f.read().replace("REAL_PYTHON = None", f"REAL_PYTHON = {real_python!r}", 1)
    path = os.path.join(directory, "python")
    with open(path, "w") as f:
        f.write(f"#!{real_python} -IS\n{source}")
    os.chmod(path, 0o755)
    return path


def startup_env(env):
    return {k: v for k, v in env.items() if STARTUP_ENV.match(k)}


def serve(directory):
    """Answer requests until stdin closes (the harness exits); returns (request, fds) in a
    forked child, which then runs the program."""
    before = dict(os.environ)
    # FORK_SERVER_PRELOAD=a,b: only those (test_fork_server's private servers start in a
    # fraction of a second)
    preload = os.environ["FORK_SERVER_PRELOAD"].split(",") if "FORK_SERVER_PRELOAD" in os.environ else PRELOAD
    for name in preload:
        __import__(name)
    # what the imports set (TORCHINDUCTOR_CACHE_DIR): a fresh interpreter would set it too
    added = {k: v for k, v in os.environ.items() if k not in before}
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        sys.exit(f"fork_server: {threads} threads after the imports; a fork would copy one")
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        # a forked child cannot use a CUDA context its parent made: its first CUDA call fails
        sys.exit("fork_server: the imports initialized CUDA; a forked process could not use it")
    mine = startup_env(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(directory, "socket"))
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through wake_w
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    children = {}  # pid -> (the stand-in's connection, its pid)
    os.mkdir(os.path.join(directory, "forked"))
    print("ready", flush=True)
    while True:
        for event, _ in selector.select():
            what = event.data
            if what == "stdin":
                if not os.read(sys.stdin.fileno(), 1024):  # the harness is gone: so are we
                    for pid in children:
                        _kill(pid)
                    os._exit(0)
            elif what == "child":
                os.read(wake_r, 4096)
                _reap(children, selector, directory)
            elif what == "accept":
                conn, _ = listener.accept()
                request, fds = _receive(conn)
                if request is None:  # a stand-in gone before it asked
                    conn.close()
                    continue
                request["env"] = {**added, **request["env"]}
                refusal = _refusal(request, mine)
                if refusal:
                    print(f"refused {request['kind']} {request['target']}: {refusal}",
                          file=sys.stderr, flush=True)
                    _send(conn, f"refused {refusal}")
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for fileobj in [conn, *(c for c, _ in children.values())]:
                        fileobj.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    request["stand_in"] = os.path.join(directory, "python")
                    return request, fds
                for fd in fds:
                    os.close(fd)
                _record(directory, request["pid"], pid)
                children[pid] = conn, request["pid"]
                selector.register(conn, selectors.EVENT_READ, pid)
                if not _send(conn, f"pid {pid}"):
                    _kill(pid)
            else:  # a stand-in closed its end before its process ended: it was killed
                try:
                    gone = not event.fileobj.recv(64)
                except OSError:
                    gone = True
                if gone:
                    _kill(what)
                    selector.unregister(event.fileobj)  # _reap closes it


def _receive(conn):
    """A stand-in's request (one line of JSON) and its three streams; (None, []) if it
    went away first."""
    data, fds = b"", []
    try:
        while not data.endswith(b"\n"):
            chunk, more, _, _ = socket.recv_fds(conn, 1 << 16, 8)
            if not chunk:
                break
            data, fds = data + chunk, fds + more
        return json.loads(data.decode()), fds
    except (OSError, ValueError):
        for fd in fds:
            os.close(fd)
        return None, []


def _send(conn, line):
    try:
        conn.sendall(f"{line}\n".encode())
        return True
    except OSError:  # the stand-in is gone
        return False


def _threads_asked(env):
    """The thread count a request names in OMP_NUM_THREADS and MKL_NUM_THREADS alike (a
    positive integer), or None."""
    counts = {env.get(k) for k in THREAD_COUNTS}
    count = counts.pop() if len(counts) == 1 else None
    return int(count) if count and count.isdigit() and int(count) > 0 else None


def _refusal(request, mine):
    theirs = startup_env(request["env"])
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)
                    and k != "PYTHONPATH"
                    and not (k in THREAD_COUNTS and _threads_asked(theirs)))
    if differ:
        return f"startup environment differs: {differ}"
    # the directories, not the string: PYTHONPATH=. is the server's directory for the
    # server, the request's for the request
    if _directories(mine.get("PYTHONPATH")) != _directories(theirs.get("PYTHONPATH"), request["cwd"]):
        return _pythonpath_refusal(request, mine)
    return ""


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _record(directory, stand_in, pid):
    """DIR/forked/<stand-in's pid> holds the pid forked for it, while it runs: a process
    tree walked through the stand-ins (harness.kill_tree, harness.workers_of)."""
    path = os.path.join(directory, "forked", str(stand_in))
    with open(path + ".tmp", "w") as f:
        f.write(str(pid))
    os.replace(path + ".tmp", path)


def forked_for(directory, stand_in):
    """The pid forked for the stand-in `stand_in`, or None."""
    try:
        with open(os.path.join(directory, "forked", str(stand_in))) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _reap(children, selector, directory):
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn, stand_in = children.pop(pid, (None, None))
        if conn is not None:
            try:
                os.remove(os.path.join(directory, "forked", str(stand_in)))
            except OSError:
                pass
            if conn.fileno() in selector.get_map():  # not if its stand-in went away first
                selector.unregister(conn)
            _send(conn, f"status {status}")
            conn.close()


def become(request, fds):
    """In the forked child: take on the stand-in's streams, place and environment."""
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the server
    server_paths = _directories(os.environ.get("PYTHONPATH"))  # the server's own, from its cwd
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    policy, priority = request["sched"]
    try:  # the stand-in's priority (prefetch.py's idle sessions); never above the server's
        if policy != os.sched_getscheduler(0):
            os.sched_setscheduler(0, policy, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, priority)
    except OSError:
        pass
    os.environ.clear()
    os.environ.update(request["env"])
    # what the child starts with sys.executable (bench's launches, inductor's workers) is
    # forked too; the stand-in starts the real interpreter where it cannot
    sys.executable = request["stand_in"]
    import random
    random.seed()  # a fresh interpreter seeds from the OS; a fork would share the server's
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    import io
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = io.TextIOWrapper(open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  encoding=getattr(sys, name).encoding, errors="backslashreplace"
                                  if fd == 2 else "strict", line_buffering=not unbuffered and fd == 2,
                                  write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False))
    if _directories(os.environ.get("PYTHONPATH")) != server_paths:  # _refusal let it through
        _pythonpath(os.environ.get("PYTHONPATH"), server_paths)
    threads = _threads_asked(os.environ)
    if threads and "torch" in sys.modules and threads != sys.modules["torch"].get_num_threads():
        sys.modules["torch"].set_num_threads(threads)  # OpenMP's and MKL's (THREAD_COUNTS)


def run(request):
    """What `python -u? (SCRIPT | -m MODULE | -c CODE) ARGS` runs, as __main__; then leave."""
    try:
        _run_main(request)
        code = 0
    except SystemExit as done:  # as python reads sys.exit's argument
        code = done.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException as error:  # python's own report: the traceback, without this file
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(error), error.with_traceback(tb), tb)
        if isinstance(error, KeyboardInterrupt):  # python dies of the SIGINT then
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        code = 1
    leave(code)


def _run_main(request):
    import runpy
    import types
    kind, target, args = request["kind"], request["target"], request["args"]
    if kind == "module":
        sys.argv = ["-m", *args]
        sys.path[0] = os.getcwd()
        sys.modules["__main__"] = types.ModuleType("__main__")  # runpy runs it in there
        sys.modules.pop(target, None)  # preloaded: python -m runs it anew, as __main__
        runpy._run_module_as_main(target)  # what python -m calls: the same frames in a traceback
        return
    if kind == "code":
        sys.argv, sys.path[0], source, filename = ["-c", *args], "", target, "<string>"
    else:
        sys.argv, sys.path[0] = [target, *args], os.path.dirname(os.path.realpath(target))
        with open(target, "rb") as f:
            source, filename = f.read(), target
    module = types.ModuleType("__main__")
    module.__dict__.update(__builtins__=__builtins__, __cached__=None, __spec__=None,
                           __package__=None)
    if kind == "script":
        module.__file__ = filename
    sys.modules["__main__"] = module
    exec(compile(source, filename, "exec"), module.__dict__)


def leave(code):
    """An interpreter's way out as a program sees it: non-daemon threads joined, atexit
    handlers run, the script's objects finalized (a file left open is flushed), output
    flushed. Not done: tearing down every module, which for torch costs about 1.3 CPU-s
    and nothing a program can see (main.py itself leaves by os._exit past it).
    FORK_SERVER_FULL_EXIT=1: the interpreter's own way out, the teardown included
    (test_clean_exit: an abort there is what it looks for)."""
    if os.environ.get("FORK_SERVER_FULL_EXIT") == "1":
        raise SystemExit(code)
    import atexit
    import gc
    import threading
    threading._shutdown()
    atexit._run_exitfuncs()
    program = sys.modules.get("__main__")
    if program is not None and program.__dict__ is not globals():
        program.__dict__.clear()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)


if __name__ == "__main__":
    request, fds = serve(sys.argv[1])
    become(request, fds)
    del request["env"]
    run(request)
