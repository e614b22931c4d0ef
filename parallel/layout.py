"""Which layouts can run: the grid's sizes from the world size, and the rules of
parallel/rules.py, checked on every rank before any process group exists (so a bad
layout stops every rank with the same one line, and none waits in a collective).
"""

from types import SimpleNamespace

from errors import UserError
from parallel.grid import DIMS
from parallel.rules import GRID, KEYS, LAYOUT, MODEL_DIMS, Facts, refusal  # noqa: F401 (bench)


def _check(rules, facts):
    message = refusal(rules, facts)
    if message:
        raise UserError(message)


def grid_sizes(p, world_size) -> dict:
    """{dimension: degree} of the grid: the model-parallel degrees from the config, and
    the data-parallel degree from what is left of the world (computed here only), cut
    into parallel.dp_replicate replica groups of dp ranks each."""
    facts = Facts(SimpleNamespace(parallel=p), world=world_size)
    _check(GRID, facts)
    data, replicas = facts.data, p.dp_replicate
    return {d: data // replicas if d == "dp" else replicas if d == "dp_replicate" else getattr(p, d)
            for d in DIMS}


def check_keys(p):
    """The parallel section's values on their own (every mode)."""
    _check(KEYS, Facts(SimpleNamespace(parallel=p)))


def check_layout(cfg, world_size) -> dict:
    """Every rule for training on `world_size` ranks; returns the grid's sizes."""
    sizes = grid_sizes(cfg.parallel, world_size)
    _check(LAYOUT, Facts(cfg, sizes, world_size))
    return sizes
