"""The vocabulary-parallel cross-entropy at the logit scales trained models reach.

Freshly initialised models have logits near 0, where a loss that forgets to subtract
the global max before exp() still looks right (within 5e-7); at a logit scale of 100
exp() overflows to inf. tests/tp_loss_worker.py on 2 ranks, 65 ids (a padded
vocabulary), scales 1 and 100: losses and the gradient of their mean against
torch.nn.functional.cross_entropy, and no gradient into the padding rows.
"""


import pytest

from harness import worker_result

TP_LOSS_SESSION = ("tp_loss_worker.py", 2, 180)
pytestmark = pytest.mark.worker_sessions(TP_LOSS_SESSION)  # prefetch.py


@pytest.fixture(scope="module")
def result():
    return worker_result(*TP_LOSS_SESSION)


@pytest.mark.parametrize("scale", ["1.0", "100.0"])
def test_vocab_parallel_loss_and_gradient_equal_torch_at_large_logits(result, scale):
    for rank, r in enumerate(result):
        r = r[scale]
        print(f"rank {rank} scale {scale}: loss {r['loss_rel_diff']:.2g}, "
              f"grad {r['grad_max_abs_diff']:.2g} of {r['grad_scale']:.2g}")
        assert r["finite"], r
        assert r["loss_rel_diff"] <= 1e-5, r
        assert r["grad_max_abs_diff"] <= 1e-6 * max(r["grad_scale"], 1.0), r
        assert r["padding_grad_zero"], r
