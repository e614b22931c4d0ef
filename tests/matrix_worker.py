"""The combination matrix's cases (tests/data/option_matrix.json) inside the layout sessions
(tests/layout_worker.py calls compute(): 2, 4 and 8 ranks; a 1-rank case runs on rank 0
of the 2-rank session).

Each case is what main.py builds from the case's `key=value` overrides: the config
(config.load_config: every rule), the GPT on the meta device, the initial weights from
(seed, name) (parallel/initial.py) and `parallelize(model, grid, cfg, init)`; then
training/step.py's compute_step for STEPS steps on fixed global batches, this rank's
share of each, an evaluation, and the gathered canonical state. What it must reproduce
and at what tolerance: tests/matrix_runs.py (one process with the same model and
precision; with dropout, the case's twin). The data, metrics and snapshot writing of a
run are main.py's alone: tests/test_option_matrix.py runs the background-snapshot cases
through main.py.

The worker only measures (rank 0 prints RESULT), so a wrong case cannot hang a rank; a
case that raises is reported with its error and the next one runs.
"""

import math
import os
import sys
import traceback
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import option_matrix as om  # noqa: E402  (this directory is the script's)
from dp_worker import OneRank  # noqa: E402
import matrix_runs  # noqa: E402

STEPS = 3
VOCAB = 50  # the embedded corpus's characters; model.vocab_pad_to=64 pads it
_runs = {}  # overrides -> the run's figures, each reference and twin trained once


def global_batch(step, batch, block):
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(VOCAB, (batch, block + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def run(overrides, world):
    """(per-step [loss, grad norm], val loss, canonical state on rank 0) of a run of
    `overrides` on the first `world` ranks (1: a single-process run on each rank, alone)."""
    from config import load_config
    from fault_tolerance.one_group import OneGroup
    from model import GPT, GPTConfig, shapes_only
    from parallel.grid import ProcessGrid
    from parallel.initial import InitialWeights
    from parallel.parallelize import parallelize
    from training.step import compute_step
    import moe.experts
    moe.experts._GROUPED_OK.clear()  # as in a new process: the first MoE forward probes
    cfg = load_config(overrides, world)
    t = cfg.trainer
    shape = {k: v for k, v in asdict(cfg.model).items() if k != "init_from"}
    with shapes_only():
        model = GPT(GPTConfig(**shape, vocab_size=VOCAB, block_size=cfg.data.block_size))
    init = InitialWeights(model, t.seed)
    grid = OneRank() if world == 1 else ProcessGrid(cfg.sizes, torch.device("cpu"),
                                                    cfg.parallel.timeout_s, cfg.parallel.ep)
    if t.compile:
        import torch._dynamo as dynamo
        dynamo.reset()  # each case compiles anew, within dynamo's recompile limit
    strategy = parallelize(model, grid, cfg, init)
    per_rank = t.batch_size // grid.data_size
    mine = slice(grid.data_rank * per_rank, (grid.data_rank + 1) * per_rank)
    steps = []
    for step in range(STEPS):
        x, y = global_batch(step, t.batch_size, cfg.data.block_size)
        micro = list(zip(x[mine].chunk(t.grad_accum), y[mine].chunk(t.grad_accum)))
        loss, norm, _ = compute_step(strategy, micro, step, t, OneGroup(), nullcontext())
        steps.append([float(loss), float(norm)])
    x, y = global_batch(STEPS, t.batch_size, cfg.data.block_size)
    # a compiled case evaluates eagerly: the evaluation's own graphs (no grad, eval mode)
    # would double the case's compile time, and what they add is tests/test_compile.py's
    with torch.compiler.set_stance("force_eager") if t.compile else nullcontext():
        val = float(strategy.eval_loss(x[mine], y[mine]))
    state = strategy.state_dict()
    return steps, val, (state if grid.is_main else None)


def reference_of(case, rules):
    """(overrides, ranks) of the run a case must reproduce (tests/matrix_runs.py)."""
    if case["dropout"] == om.FACTORS["dropout"][0]:
        return matrix_runs.reference_overrides(case), 1
    other = matrix_runs.twin(case, rules)
    return (om.overrides(other), om.world(other)) if other is not None else (None, 0)


def figures(overrides, world):
    """A run's figures, once per overrides (a one-process run: rank 0's alone, None on the
    others)."""
    key = (tuple(overrides), world)
    if key not in _runs:
        if world == 1 and dist.get_world_size() > 1:  # rank 0 alone (it compares): no collective
            _runs[key] = run(overrides, 1) if dist.get_rank() == 0 else None
        else:
            _runs[key] = run(overrides, world)
    return _runs[key]


def check(case, rules):
    """The case's differences against its reference (rank 0's), or its error."""
    world = om.world(case)
    ref_overrides, ref_world = reference_of(case, rules)
    if ref_overrides is None:
        return {"error": "no twin the rules accept"}
    try:
        got = figures(om.overrides(case), world)
        ref = figures(ref_overrides, ref_world)
    except Exception:  # noqa: BLE001  (reported, and the test fails with it)
        return {"error": traceback.format_exc()[-3000:]}
    if not dist.get_rank() == 0:
        return {}
    (steps, val, state), (ref_steps, ref_val, ref_state) = got, ref
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-12)
    diffs = {"loss": max(rel(a[0], b[0]) for a, b in zip(steps, ref_steps)),
             "grad_norm": max(rel(a[1], b[1]) for a, b in zip(steps, ref_steps)),
             "val_loss": rel(val, ref_val)}
    if sorted(state) != sorted(ref_state):
        return {**diffs, "error": f"other tensors: {sorted(set(state) ^ set(ref_state))}"}
    diffs["weights"] = max((state[n].float() - ref_state[n].float()).abs().max().item()
                           for n in ref_state)
    return diffs


def compute():
    """{case name: differences} of every committed case of this session's world size (and,
    in the 2-rank session, the 1-rank ones)."""
    world = dist.get_world_size()
    rules = om.Rules()
    only = os.environ.get("MATRIX_ONLY", "")  # debugging aid: cases whose name holds it
    out = {}
    for case in om.from_json(om.committed()):
        if only not in om.case_name(case):
            continue
        if om.world(case) == world or (world == 2 and om.world(case) == 1):
            out[om.case_name(case)] = check(case, rules)
    return out


if __name__ == "__main__":  # alone, for debugging: torchrun --nproc_per_node=W tests/matrix_worker.py
    from dp_worker import serve
    serve(compute)
