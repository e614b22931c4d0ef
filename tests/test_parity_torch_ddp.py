"""torch_ddp must compute the same training run as one process (the parity rule: same global batch, seed and weights)."""

import pytest

from harness import assert_parity, run_metrics


@pytest.fixture(scope="module")
def single_losses(tmp_path_factory):
    return run_metrics(tmp_path_factory.mktemp("single"), 1, ["parallel.dp=single"])


@pytest.mark.parametrize("nproc", [2, 3])
def test_torch_ddp_matches_single(single_losses, tmp_path, nproc):
    got = run_metrics(tmp_path, nproc, ["parallel.dp=torch_ddp"])
    assert_parity(single_losses, got)


def test_grad_accum_matches_single(single_losses, tmp_path):
    got = run_metrics(tmp_path, 2, ["parallel.dp=torch_ddp", "trainer.grad_accum=3"])
    assert_parity(single_losses, got)
