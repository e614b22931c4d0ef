"""The plan's first choice as the commands to paste: the training run, and the dry run that
tries it here first (mode=dryrun, planner/dryrun.py).

Each carries what the plan priced: the config file, every key the plan was given that
shapes the run (the model, the data, the batch: `Config.given`), the precision it priced
(always written out: `auto` resolved to the plan.gpu's), and the layout's keys, which
take the place of any parallel.* or recompute key given (the plan searched those). A
plan.* key goes to the dry run only (it needs the world: plan.nodes, plan.gpus_per_node).
"""

import functools
import shlex

from planner.shapes import Layout

# keys a Layout sets (Layout.keys): a given value of one of them is the search's to choose
SEARCHED = {"parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp",
            "parallel.sequence_parallel", "parallel.zero_stage", "parallel.dp_replicate",
            "parallel.offload", "parallel.ep", "parallel.pp_schedule", "parallel.microbatches",
            "parallel.pp_virtual_stages", "trainer.grad_accum", "trainer.activation_checkpointing",
            "trainer.activation_checkpointing_mode", "trainer.activation_checkpointing_every"}
NOT_FOR_THE_RUN = {"mode", "trainer.precision"}  # set by each command itself


def text(value) -> str:
    """A value as a command-line override writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(text(v) for v in value) + "]"
    return str(value)


def overrides(cfg, layout: Layout) -> list:
    """key=value of the run: the config file, the given keys, the precision, the layout."""
    given = sorted(k for k in cfg.given if k not in SEARCHED | NOT_FOR_THE_RUN
                   and not k.startswith("plan."))
    out = [f"config={cfg.config}"] if cfg.config else []
    out += [f"{k}={text(functools.reduce(getattr, k.split('.'), cfg))}" for k in given]
    out.append(f"trainer.precision={cfg.trainer.precision}")
    return out + [f"{k}={text(v)}" for k, v in layout.keys().items()]


def run_command(cfg, layout: Layout) -> str:
    """torchrun on plan.nodes x plan.gpus_per_node (several nodes: the same line on each,
    HEAD the first node's address, as docs/clusters.md launches)."""
    p = cfg.plan
    launch = ["torchrun", "--standalone"] if p.nodes == 1 else \
        ["torchrun", f"--nnodes={p.nodes}", "--rdzv-backend=c10d", "--rdzv-endpoint=HEAD:29500"]
    return shlex.join(launch + [f"--nproc_per_node={p.gpus_per_node}", "main.py",
                                *overrides(cfg, layout)])


def dryrun_command(cfg, layout: Layout) -> str:
    """mode=dryrun of the same layout on this machine, for the same world and the plan.*
    keys given (what its predictions beside the measured figures read), but plan.out."""
    plan = [f"{k}={text(functools.reduce(getattr, k.split('.'), cfg))}" for k in sorted(cfg.given)
            if k.startswith("plan.") and k not in {"plan.out", "plan.nodes", "plan.gpus_per_node"}]
    return shlex.join(["python", "main.py", "mode=dryrun", *overrides(cfg, layout),
                       f"plan.nodes={cfg.plan.nodes}", f"plan.gpus_per_node={cfg.plan.gpus_per_node}",
                       *plan])
