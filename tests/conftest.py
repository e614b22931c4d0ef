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


def pytest_sessionfinish(session, exitstatus):
    """The job servers (harness.run_job's long-lived torchrun launches) end with the session."""
    from harness import stop_job_servers
    stop_job_servers()
