"""Compare two runs' metrics.jsonl exactly: step, loss, grad_norm and val_loss.

    python scripts/compare_metrics.py OLD_RUN_DIR NEW_RUN_DIR

Each argument is a run directory (trainer.run_dir) or a metrics.jsonl file. Every record
is compared field by field as the JSON holds it (Python's float repr round-trips, so
equal text means equal bits). Prints the first difference and exits 1, or prints how
many records matched and exits 0. Fields other than these four (timings, memory,
traffic) are expected to differ and are not compared.
"""

import json
import sys
from pathlib import Path

FIELDS = ("step", "loss", "grad_norm", "val_loss")


def records(path):
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def first_difference(old, new):
    """A one-line description of the first difference, or "" when none."""
    if len(old) != len(new):
        steps = lambda rs: [r.get("step") for r in rs]  # noqa: E731
        return f"{len(old)} records against {len(new)}: steps {steps(old)} against {steps(new)}"
    for i, (a, b) in enumerate(zip(old, new)):
        for field in FIELDS:
            if a.get(field) != b.get(field):
                return (f"record {i} (step {a.get('step')}): {field} {a.get(field)!r} "
                        f"against {b.get(field)!r}")
    return ""


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    old, new = (records(p) for p in argv)
    if not old or not new:
        print("differ: a metrics.jsonl without records")
        return 1
    difference = first_difference(old, new)
    if difference:
        print(f"differ: {difference}")
        return 1
    evals = sum("val_loss" in r for r in old)
    print(f"identical: {len(old)} records (steps {old[0]['step']}..{old[-1]['step']}, "
          f"{evals} with val_loss): {', '.join(FIELDS)} bitwise equal")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
