"""Change no number (issue 43): scripts/bitwise_vs_commit.py's small matrix against the base
commit, and its comparisons shown able to see one bit.

The small matrix (bitwise_vs_commit.SMALL: one process with dropout and the fp16 loss
scaler skipping, halving and growing; fsdp ZeRO-3 on 2 ranks with accumulation) runs
main.py under the base commit (written out of the git history) and under this working
tree, through the session's fork server: per-step loss, pre-clip gradient norm, validation
loss, learning rate and loss scaler, and the final snapshot's tensors, must be the base's to
the bit; so must each layout's run resumed by this checkout from the base's step-3
snapshot. A checkout without the base commit in its history (a shallow clone) skips it,
saying so. Shown red in a scratch copy: GPT's init std 0.02 -> 0.021 (both layouts, step 1),
clipping's epsilon 1e-6 -> 1e-7 (relative 1e-7: parity's rtol 1e-5 cannot see it), the fp16
loss scaler's state not restored on resume (the resume column alone).
"""

import importlib.util
import math
import os

import pytest
import torch

from harness import REPO, job_env, kill_tree, python

_spec = importlib.util.spec_from_file_location(
    "bitwise_vs_commit", os.path.join(REPO, "scripts", "bitwise_vs_commit.py"))
bitwise = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bitwise)

pytestmark = pytest.mark.long  # the long tier (tests/README.md): the refactoring tool runs two commits' jobs


def test_small_matrix_is_bitwise_the_base_commits(tmp_path):
    try:
        commit = bitwise.resolve(bitwise.BASE)
    except bitwise.BaseMissing as e:
        pytest.skip(f"no base to compare with: {e}")
    runner = bitwise.Runner(python=python(), env=job_env(), kill_tree=kill_tree, timeout=240)
    rows = bitwise.check([bitwise.BY_NAME[n] for n in bitwise.SMALL], work=str(tmp_path),
                         runner=runner)
    assert len(rows) == len(bitwise.SMALL) and any(r.layout.resume for r in rows)
    assert all(r.identical() for r in rows), f"{bitwise.table(rows, commit)}\n{bitwise.details(rows)}"


def _records():
    return [{"step": 1, "loss": 3.9, "grad_norm": float("inf")},
            {"step": 2, "loss": 3.8, "grad_norm": 1.5, "val_loss": 3.7}]


def test_metrics_comparison_sees_one_bit_and_a_missing_evaluation():
    base = _records()
    assert bitwise.metrics_difference(base, _records()) == ""
    one_ulp = _records()
    one_ulp[1]["grad_norm"] = math.nextafter(1.5, 2.0)
    assert "step 2 grad_norm" in bitwise.metrics_difference(base, one_ulp)
    negative_zero = [{"step": 1, "loss": -0.0}]
    assert bitwise.metrics_difference([{"step": 1, "loss": 0.0}], negative_zero)
    nan = [{"step": 1, "loss": float("nan")}]
    assert bitwise.metrics_difference(nan, [{"step": 1, "loss": float("nan")}]) == ""
    no_eval = _records()
    del no_eval[1]["val_loss"]
    assert "step 2 val_loss" in bitwise.metrics_difference(base, no_eval)
    assert "steps" in bitwise.metrics_difference(base, base[:1])
    extra_eval = _records()
    extra_eval[0]["val_loss"] = 3.8
    assert "step 1 val_loss" in bitwise.metrics_difference(base, extra_eval)
    scaler = [{"step": 1, "loss": 3.9, "loss_scale": 65536.0, "skipped_steps": 1}]
    assert "skipped_steps" in bitwise.metrics_difference(scaler, [dict(scaler[0], skipped_steps=2)])
    assert "loss_scale" in bitwise.metrics_difference(scaler, [{"step": 1, "loss": 3.9, "skipped_steps": 1}])
    assert bitwise.metrics_difference(scaler[:1], [dict(scaler[0], new_field=1.0)]) == ""


def _snapshot():
    return {"meta": {"step": 6, "samples_seen": 72, "precision": {"precision": "fp16", "loss_scaler": {
                "scale": 131072.0, "good_steps": 1, "skipped_steps": 3}}},
            "tensors": {"model/w": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7,
                        "optim/w/step": torch.tensor(3.0), "model/b": torch.zeros(3, dtype=torch.bfloat16)}}


@pytest.mark.parametrize("change", ["one bit", "negative zero", "dtype", "key", "scaler"])
def test_snapshot_comparison_sees_one_bit_a_dtype_a_key_and_the_scaler(change):
    base, new = _snapshot(), _snapshot()
    assert bitwise.snapshot_difference(base, new) == ""
    t = new["tensors"]
    if change == "one bit":
        t["model/w"].view(torch.int32)[1, 2] ^= 1
    elif change == "negative zero":
        t["model/b"][1] = -0.0
    elif change == "dtype":
        t["optim/w/step"] = t["optim/w/step"].double()
    elif change == "key":
        t["model/w2"] = t.pop("model/w")
    else:
        new["meta"]["precision"]["loss_scaler"]["scale"] = 65536.0
    assert bitwise.snapshot_difference(base, new)
