import os
import sys

# tests import the harness and the project's modules by plain name
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


import pytest  # noqa: E402


@pytest.fixture
def one_rank_grid():
    """A one-rank gloo group in this process, for in-process snapshot tests."""
    import torch
    import torch.distributed as dist
    from parallel.grid import ProcessGrid
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield ProcessGrid({}, torch.device("cpu"))
    dist.destroy_process_group()


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="also run the long tier (tests marked `long`: tools, benchmarks' "
                          "commands and the slowest fault scenarios; tests/README.md)")


def pytest_collection_modifyitems(config, items):
    """The suite (the README's command, CI's) leaves the long tier out; `--long` adds it,
    `--long -m long` runs it alone. Then the modules that read worker sessions go last, in
    their order: the sessions run ahead on idle CPU beside every other module's tests
    (prefetch.py), instead of being waited for by the first of them."""
    if not config.getoption("--long"):
        long = [item for item in items if item.get_closest_marker("long")]
        if long:
            config.hook.pytest_deselected(items=long)
            items[:] = [item for item in items if not item.get_closest_marker("long")]
    reading = {item.module for item in items if item.get_closest_marker("worker_sessions")}
    items.sort(key=lambda item: item.module in reading)  # stable: each module stays whole


def pytest_collection_finish(session):
    """The worker sessions the collected tests' modules declare (`pytestmark =
    pytest.mark.worker_sessions(...)`) start ahead of them on idle CPU (tests/prefetch.py),
    in the order the tests come."""
    from harness import prefetch_worker_sessions
    # TEST_PREFETCH=0: every session runs when its first test asks (to time one alone)
    if session.config.option.collectonly or os.environ.get("TEST_PREFETCH") == "0":
        return
    specs = []
    for item in session.items:
        for mark in item.iter_markers("worker_sessions"):
            specs += [s for s in mark.args if s not in specs]
    prefetch_worker_sessions(specs)


def pytest_runtest_teardown(item):
    """Between tests the sessions run ahead move on: the one that ended is collected, the
    next one starts."""
    import prefetch
    prefetch.advance()


def pytest_sessionfinish(session, exitstatus):
    """The job servers (harness.run_job's long-lived torchrun launches), the worker
    sessions still running ahead and the fork server end with the session."""
    import prefetch
    from harness import stop_fork_server, stop_job_servers
    prefetch.stop()
    stop_job_servers()
    stop_fork_server()
