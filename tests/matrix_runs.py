"""Run one combination-matrix case (tests/option_matrix.py) through main.py, as a user
would, and hold it against the run it must reproduce.

- Without dropout: one process (`parallel.dp=single`, no other dimension, no accumulation)
  with the same model and precision: the case's layout, accumulation, recompute,
  compilation and snapshot writing must not change the numbers. Compared per step: the
  loss and the pre-clip gradient norm; the validation loss at the end; the final weights
  (the snapshot of the last step).
- With dropout the masks depend on the layout by design (each TP, CP and data-parallel
  rank draws its own where its activations differ), so one process is no reference. The
  case is held against its TWIN: the same layout and dropout with recompute, compilation
  and background snapshots set back (or, where the case has none of them, one added):
  these must replay the same masks.

Tolerances: fp32 rtol 1e-5 (compiled: 1e-4, as tests/test_compile.py: aot_eager may
reorder sums); bf16 and fp16 2e-2 against one process in the same precision (as
tests/test_precision.py). Final weights: max |difference| 1e-3 in fp32 (AdamW moves an
element with a ~1e-8 gradient by about lr either way; a wrong slice or a lost update
moves whole steps), 1e-2 in bf16/fp16.
"""

import os
import uuid

from harness import max_rel_diff, read_metrics, run_job, snapshot_model
import option_matrix as om

NEUTRAL = ("recompute", "compile", "snapshots")  # factors that must not change the numbers


def run_case(root, nproc, overrides, timeout=300):
    """A job that must succeed: (metrics records, final weights) or AssertionError."""
    workdir = os.path.join(str(root), f"job-{uuid.uuid4().hex[:8]}")
    result = run_job(workdir, nproc, overrides, timeout=timeout, tiny=False, compile_in_server=True)
    assert result.returncode == 0, (f"exit {result.returncode}: {' '.join(overrides[len(om.BASE):])}\n"
                                    f"{result.stdout[-2500:]}\n{result.stderr[-4000:]}")
    run_dir = os.path.join(workdir, "runs", "default")
    return read_metrics(run_dir), snapshot_model(os.path.join(run_dir, "snapshot"))


def reference_overrides(case):
    """One process, same model and precision: the run a dropout-free case must reproduce."""
    kept = [o for f in om.NAMES for o in case[f].overrides
            if o.startswith("model.") or o.startswith("trainer.precision=")]
    return om.BASE + ["parallel.dp=single"] + kept


def twin(case, rules):
    """The run a dropout case must reproduce: recompute, compilation and background
    snapshots set back to their defaults; or, where the case has none, full recompute
    (or background snapshots) added. None if the rules refuse every such twin."""
    back = dict(case, **{f: om.FACTORS[f][0] for f in NEUTRAL})
    candidates = [back] if back != case else []
    candidates += [dict(case, recompute=om._value("recompute", "full")),
                   dict(case, snapshots=om._value("snapshots", "async"))]
    return next((c for c in candidates if c != case and not rules.refusal(c)), None)


def tolerances(case):
    """(rtol of losses and gradient norms, max |difference| of final weights)."""
    if case["precision"].name != "fp32":
        return 2e-2, 1e-2
    return (1e-4 if case["compile"].name == "compiled" else 1e-5), 1e-3


def differences(got, ref):
    """Max differences of a run against its reference: loss, grad norm (relative, per
    step), val loss (relative) and final weights (absolute)."""
    (records, weights), (ref_records, ref_weights) = got, ref
    steps = [r["step"] for r in records]
    assert steps == [r["step"] for r in ref_records], f"steps {steps} vs {[r['step'] for r in ref_records]}"
    column = lambda rs, key: [r[key] for r in rs]
    vals = [[r["val_loss"] for r in rs if "val_loss" in r] for rs in (records, ref_records)]
    assert len(vals[0]) == len(vals[1]) == 1, f"one validation loss each: {vals}"
    assert sorted(weights) == sorted(ref_weights), "the snapshots hold other tensors"
    return {"loss": max_rel_diff(column(ref_records, "loss"), column(records, "loss")),
            "grad_norm": max_rel_diff(column(ref_records, "grad_norm"), column(records, "grad_norm")),
            "val_loss": max_rel_diff(vals[1], vals[0]),
            "weights": max((weights[n].float() - ref_weights[n].float()).abs().max().item()
                           for n in ref_weights)}


def failures(case, diffs):
    """The differences beyond the case's tolerances, as text ("" when none)."""
    rtol, atol = tolerances(case)
    bad = [f"{k} {d:.3g} > {rtol}" for k, d in diffs.items() if k != "weights" and not d <= rtol]
    if not diffs["weights"] <= atol:
        bad.append(f"weights {diffs['weights']:.3g} > {atol}")
    return "; ".join(bad)


class Matrix:
    """Runs cases under `root`, each reference run once (references by their overrides)."""

    def __init__(self, root, rules=None):
        self.root, self.rules, self.refs = root, rules or om.Rules(), {}

    def reference_of(self, case):
        if case["dropout"] == om.FACTORS["dropout"][0]:
            key, nproc = tuple(reference_overrides(case)), 1
        else:
            other = twin(case, self.rules)
            assert other is not None, f"no twin the rules accept for {om.case_name(case)}"
            key, nproc = tuple(om.overrides(other)), om.world(other)
        if key not in self.refs:
            self.refs[key] = run_case(self.root, nproc, list(key))
        return self.refs[key]

    def check(self, case):
        """(differences, failures text) of a case against its reference."""
        got = run_case(self.root, om.world(case), om.overrides(case))
        diffs = differences(got, self.reference_of(case))
        return diffs, failures(case, diffs)
