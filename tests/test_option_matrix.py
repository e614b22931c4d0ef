"""The combination matrix (issue 52): cases generated from the options, so that every pair
of option values meets in one case (tests/option_matrix.py; the list and its page:
python -m scripts.option_matrix).

- every committed case in the layout session of its ranks (tests/matrix_worker.py: what
  main.py builds from the case's overrides, and its step), against one process with the
  same model and precision (a dropout case: against its twin): per step loss and pre-clip
  gradient norm, validation loss, final weights (tests/matrix_runs.py: tolerances);
- the background-snapshot cases through main.py, the same comparisons;
- the committed lists cover every pair of the options' values as they are now, each case
  is one the layout rules accept, and each refused pair's smallest case stops with one
  line (config.load_config, as every rank does before any collective);
- docs/option-matrix.md and its pairs CSV are the generator's output for the lists.
"""

import pytest

import matrix_runs
import option_matrix as om
from harness import LAYOUT_SESSIONS, layout_worker_result
from scripts import option_matrix as script

pytestmark = pytest.mark.worker_sessions(*LAYOUT_SESSIONS)  # prefetch.py

DATA = om.committed()
CASES = om.from_json(DATA)
THROUGH_MAIN = om.from_json(DATA, "through_main")


def session_of(case):
    """The layout session that runs a case (1-rank cases: the 2-rank one's rank 0)."""
    return max(2, om.world(case))


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-{om.case_name(c)}" for n, c in enumerate(CASES, 1)])
def test_case_reproduces_its_reference(case):
    diffs = layout_worker_result(session_of(case))["matrix"][om.case_name(case)]
    assert "error" not in diffs, f"{om.case_name(case)}:\n{diffs['error']}"
    print(om.case_name(case), {k: f"{d:.3g}" for k, d in diffs.items()})
    bad = matrix_runs.failures(case, diffs)
    assert not bad, f"{om.case_name(case)}: {bad}"


@pytest.fixture(scope="module")
def through_main(tmp_path_factory):
    return matrix_runs.Matrix(tmp_path_factory.mktemp("matrix"))


@pytest.mark.parametrize("case", THROUGH_MAIN,
                         ids=[f"m{n}-{om.case_name(c)}" for n, c in enumerate(THROUGH_MAIN, 1)])
def test_background_snapshot_case_through_main_reproduces_its_reference(through_main, case):
    diffs, bad = through_main.check(case)
    print(om.case_name(case), {k: f"{d:.3g}" for k, d in diffs.items()})
    assert not bad, f"{om.case_name(case)}: {bad}"


def test_the_committed_cases_cover_every_pair_and_run_under_the_rules():
    rules = om.Rules()
    refusals = {om.case_name(c): rules.refusal(c) for c in CASES + THROUGH_MAIN}
    assert not any(refusals.values()), {k: v for k, v in refusals.items() if v}
    where = script.covering(DATA)
    missing = [p for p in script.every_pair() if p not in where]
    assert not missing, f"{len(missing)} pairs no case covers, e.g. {missing[:5]}: " \
                        "python -m scripts.option_matrix"


@pytest.mark.parametrize("row", DATA["refused"], ids=lambda r: "+".join(v for _, v in r["values"]))
def test_a_refused_pair_stops_with_one_line(row):
    from config import load_config
    from errors import UserError
    smallest = om._defaults_with([tuple(v) for v in row["values"]])
    with pytest.raises(UserError) as refused:
        load_config(om.overrides(smallest), om.world(smallest))
    message = str(refused.value)
    assert message == row["message"] and "\n" not in message


def test_the_page_and_the_pairs_are_the_generated_ones():
    def read(path):
        with open(f"{script.REPO}/{path}") as f:
            return f.read()
    stale = "is stale: python -m scripts.option_matrix"
    assert read(script.PAGE) == script.markdown(DATA), f"{script.PAGE} {stale}"
    assert read(script.PAIRS) == script.pairs_csv(DATA), f"{script.PAIRS} {stale}"
