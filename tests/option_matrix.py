"""The combination matrix: cases built from the options, not picked by hand.

Every option that changes what a training step computes is a FACTOR with its values (each
value: the `key=value` overrides it adds, and the ranks it needs). `generate` picks cases
(whole assignments, one value of every factor) with a seeded greedy covering-array search
(AETG's: each new case is the valid completion, among random ones and one of defaults,
that covers the most pairs not yet covered, then improved one factor at a time), until
every pair of values of two factors meets in at least one case that the layout rules
accept, or is REFUSED: no valid case holds it, and its smallest case (the pair, the other
factors at their defaults) must stop with one line. `strength=3` over a few factors
(`TRIPLE_FACTORS`) gives the long tier's triples.

Validity is the product's own: config.validate (every layout rule), plus WORLD_CAP ranks
(the suite's job servers: 1, 2 and 4 ranks). The list the suite runs is written by
`python scripts/option_matrix.py` into tests/data/option_matrix.json and
docs/option-matrix.md (tests/test_option_matrix.py checks it is current and covers
every pair); tests/test_option_matrix.py runs each case through main.py against one
process (how: its docstring).
"""

import copy
import itertools
import json
import os
import random
from dataclasses import dataclass

SEED = 52
WORLD_CAP = 8  # ranks: the layout sessions' largest (pairs of tp or pp with cp need dp x cp x 2)

# every case: 4 blocks (the interleaved and zbv schedules need 4 pipeline chunks, every-2
# recompute needs an odd block), a global batch that every dp x accum x micro-batches
# divides, 3 steps (AdamW's state made, then updated twice), a snapshot at 2 (async:
# written while step 3 runs) and at 3 (the final weights), one validation batch at 3
BASE = ["model.n_layer=4", "model.n_head=2", "model.n_embd=32", "data.block_size=16",
        "trainer.batch_size=16", "trainer.max_steps=3", "trainer.warmup_steps=2",
        "trainer.log_every=1", "trainer.eval_every=3", "trainer.eval_batches=1",
        "trainer.save_every=2", "sample.length=0", "wandb.mode=disabled",
        "parallel.timeout_s=60", "trainer.device=cpu"]
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_hidden=64",
       "model.moe_aux_loss_coef=0.01", "model.moe_z_loss_coef=0.001"]


@dataclass(frozen=True)
class Value:
    name: str
    overrides: tuple = ()
    ranks: int = 1  # what this value multiplies the world size by

    def __repr__(self):
        return self.name


def v(name, *overrides, ranks=1):
    return Value(name, tuple(overrides), ranks)


def pp(schedule, *more):
    return ("parallel.pp=2", f"parallel.pp_schedule={schedule}", "parallel.microbatches=2", *more)


# the first value of each factor is its default: what a case holds unless it covers another
FACTORS = {
    "strategy": [
        v("single", "parallel.dp=single"),
        v("ddp_naive", "parallel.dp=ddp_naive", ranks=2),
        v("ddp_bucket", "parallel.dp=ddp_bucket", ranks=2),
        v("fsdp1", "parallel.dp=fsdp", "parallel.zero_stage=1", ranks=2),
        v("fsdp2", "parallel.dp=fsdp", "parallel.zero_stage=2", ranks=2),
        v("fsdp3", "parallel.dp=fsdp", "parallel.zero_stage=3", ranks=2),
        v("hsdp", "parallel.dp=fsdp", "parallel.zero_stage=2", "parallel.dp_replicate=2", ranks=2),
        v("offload", "parallel.dp=fsdp", "parallel.zero_stage=2", "parallel.offload=true", ranks=2),
        v("torch_ddp", "parallel.dp=torch_ddp", ranks=2),
        v("torch_fsdp", "parallel.dp=torch_fsdp", ranks=2),
    ],
    "tp": [
        v("tp1"),
        v("tp2", "parallel.tp=2", ranks=2),
        v("tp2-sp", "parallel.tp=2", "parallel.sequence_parallel=true", ranks=2),
        v("tp2-torch", "parallel.tp=2", "parallel.tp_impl=torch", ranks=2),
    ],
    "pp": [
        v("pp1"),
        v("gpipe", *pp("gpipe"), ranks=2),
        v("1f1b", *pp("1f1b"), ranks=2),
        v("interleaved", *pp("interleaved", "parallel.pp_virtual_stages=2"), ranks=2),
        v("zb1p", *pp("zb1p"), ranks=2),
        v("zbv", *pp("zbv"), ranks=2),
        v("1f1b-torch", *pp("1f1b", "parallel.pp_impl=torch"), ranks=2),
    ],
    "cp": [
        v("cp1"),
        v("cp2", "parallel.cp=2", ranks=2),
        v("cp2-allgather", "parallel.cp=2", "parallel.cp_impl=allgather", ranks=2),
    ],
    "experts": [
        v("dense"),
        v("moe", *MOE),
        v("moe-ep2", *MOE, "parallel.ep=2"),
        v("moe-ep2-allgather", *MOE, "parallel.ep=2", "parallel.ep_impl=allgather"),
        v("moe-ep2-biases", *MOE, "parallel.ep=2", "model.moe_bias_rate=0.01"),
    ],
    "recompute": [
        v("none"),
        v("full", "trainer.activation_checkpointing=true"),
        v("selective", "trainer.activation_checkpointing=true",
          "trainer.activation_checkpointing_mode=selective"),
        v("full-every2", "trainer.activation_checkpointing=true",
          "trainer.activation_checkpointing_every=2"),
        v("selective-every2", "trainer.activation_checkpointing=true",
          "trainer.activation_checkpointing_mode=selective", "trainer.activation_checkpointing_every=2"),
    ],
    "precision": [v("fp32"), v("bf16", "trainer.precision=bf16"), v("fp16", "trainer.precision=fp16")],
    "accum": [v("accum1"), v("accum2", "trainer.grad_accum=2")],
    # dynamo's capture (its guards, graph breaks, what runs eagerly between pieces), without
    # AOT autograd and inductor: their code generation costs the suite most and changes
    # no combination's wiring (tests/test_compile.py compiles with aot_eager)
    "compile": [v("eager"), v("compiled", "trainer.compile=true", "trainer.compile_backend=eager")],
    "vocab": [v("vocab"), v("vocab-pad64", "model.vocab_pad_to=64")],
    "dropout": [v("dropout0"), v("dropout0.1", "model.dropout=0.1")],
    "snapshots": [v("sync"), v("async", "trainer.snapshot_async=true")],
}
NAMES = list(FACTORS)
# what the layout sessions run (tests/matrix_worker.py: no snapshot is written there); the
# background snapshots meet every other value in cases of their own, through main.py
IN_PROCESS = [f for f in NAMES if f != "snapshots"]
THROUGH_MAIN = ("snapshots", "async")
# the long tier: all triples of the factors that interact most
TRIPLE_FACTORS = ["strategy", "pp", "experts", "recompute", "precision"]
LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "option_matrix.json")


def committed():
    """The committed list (python -m scripts.option_matrix writes it)."""
    with open(LIST) as f:
        return json.load(f)


def world(case):
    """Ranks a case needs: the product of its values' (case: {factor: Value}). A
    data-parallel strategy averages over 2 ranks: dp = 2, or with cp = 2 dp = 1, since the
    gradients are averaged over dp x cp (grid.grad_group) either way. HSDP keeps dp = 2:
    its replica groups split dp."""
    n = 1
    for factor, value in case.items():
        shares_cp = factor == "strategy" and value.name != "hsdp" and case["cp"].ranks > 1
        n *= 1 if shares_cp else value.ranks
    return n


def overrides(case):
    return BASE + [o for f in NAMES for o in case[f].overrides]


def case_name(case):
    """The values that are not defaults, joined: 'fsdp2-tp2-zbv-bf16'."""
    shown = [case[f].name for f in NAMES if case[f] != FACTORS[f][0]]
    return "-".join(shown) or "defaults"


SECONDS = {1: 1.0, 2: 1.2, 4: 2.5, 8: 10.0}  # a job of so many ranks on 2 idle cores, about
# (past WORLD_CAP: never chosen, refused first; 4 and 8 ranks share 2 cores: more than their
# rank count says)
COMPILE_SECONDS = 3.0  # more a rank and a graph-breaking option, for dynamo capturing the
# blocks' pieces (2 cores): each of these options cuts a block's graph at its collectives or
# eager calls, and every piece compiles for training and again for a recompute
GRAPH_BREAKERS = ("tp", "pp", "cp", "experts", "recompute")


def cost(case):
    """About what a case costs the suite, in seconds (a dropout case: and its twin's run,
    tests/matrix_runs.py). Measured: a compiled 4-rank case with MoE, tp and selective
    recompute took 10x an eager one, a compiled pipeline alone 1.3x."""
    job = SECONDS.get(world(case), 99.0)
    breakers = sum(case[f] != FACTORS[f][0] for f in GRAPH_BREAKERS)
    compiling = COMPILE_SECONDS * world(case) * (1 + breakers) if case["compile"].name == "compiled" else 0
    twin = job if case["dropout"] != FACTORS["dropout"][0] else 0
    return job + compiling + twin


class Rules:
    """Whether the product accepts a case: config.validate on a copy of one loaded config
    (load_config's omegaconf merge costs ~100 ms; this, well under 1 ms), and WORLD_CAP."""

    def __init__(self, cap=WORLD_CAP):
        from config import load_config
        self.cap, self.base, self.seen = cap, load_config(BASE, 1), {}

    def refusal(self, case):
        """"" if the case runs, else why not (the product's one line, or the cap)."""
        key = tuple(case[f].name for f in NAMES)
        if key not in self.seen:
            self.seen[key] = self._refusal(case)
        return self.seen[key]

    def _refusal(self, case):
        from config import validate
        from errors import UserError
        if world(case) > self.cap:
            return f"needs {world(case)} ranks, more than the cap of {self.cap}"
        cfg = copy.deepcopy(self.base)
        for item in overrides(case)[len(BASE):]:
            key, text = item.split("=", 1)
            section, name = key.split(".")
            obj = getattr(cfg, section)
            setattr(obj, name, _typed(getattr(obj, name), text))
        try:
            validate(cfg, world(case))
        except UserError as e:
            return str(e)
        return ""


def _typed(current, text):
    if isinstance(current, bool):
        return text == "true"
    return type(current)(text)


def tuples_of(case, groups):
    """The t-tuples ((factor, value name), ...) a case covers, over factor groups."""
    return {tuple((f, case[f].name) for f in group) for group in groups}


def generate(rules=None, strength=2, factors=None, seed=SEED, tries=40, holding=None):
    """(cases, refused): cases as [{factor: Value}], every `strength`-tuple of values of
    `factors` (default: all) covered by a case or in `refused` {tuple: the refusal of its
    smallest case}. holding: only the tuples that hold this (factor, value); the factors
    outside `factors` stay at their defaults otherwise."""
    rules = rules or Rules()
    rng = random.Random(seed)
    groups = list(itertools.combinations(factors or NAMES, strength))
    uncovered = {tuple(zip(g, names)) for g in groups
                 for names in itertools.product(*[[x.name for x in FACTORS[f]] for f in g])}
    if holding:
        uncovered = {t for t in uncovered if holding in t}
    cases, refused = [], {}
    while uncovered:
        target = sorted(uncovered)[rng.randrange(len(uncovered))]
        case = _best_case(target, uncovered, groups, rules, rng, tries)
        if case is None:  # before calling a pair refused, many more completions of it
            case = _best_case(target, uncovered, groups, rules, rng, 20 * tries)
        if case is None:
            smallest = _defaults_with(target)
            refused[target] = rules.refusal(smallest)
            uncovered.discard(target)
            continue
        cases.append(case)
        uncovered -= tuples_of(case, groups)
    return cases, refused


def _value(factor, name):
    return next(x for x in FACTORS[factor] if x.name == name)


def _defaults_with(fixed):
    case = {f: FACTORS[f][0] for f in NAMES}
    case.update({f: _value(f, name) for f, name in fixed})
    return case


def _best_case(target, uncovered, groups, rules, rng, tries):
    """The valid case holding `target` that covers the most uncovered tuples for its cost,
    or None when no completion tried is valid."""
    fixed = dict(target)
    free = [f for f in NAMES if f not in fixed and f in {f for g in groups for f in g}]
    score = lambda c: len(tuples_of(c, groups) & uncovered) / cost(c)  # new tuples a second
    starts = [_defaults_with(target)]
    for _ in range(tries):
        case = _defaults_with(target)
        for f in free:
            case[f] = rng.choice(FACTORS[f])
        starts.append(case)
    valid = [c for c in starts if not rules.refusal(c)]
    if not valid:
        return None
    best = max(valid, key=score)
    improved = True
    while improved:  # one factor at a time, while it covers more for its cost
        improved = False
        for f in rng.sample(free, len(free)):
            for value in FACTORS[f]:
                trial = dict(best, **{f: value})
                if score(trial) > score(best) and not rules.refusal(trial):
                    best, improved = trial, True
    return best


def generate_both(rules=None):
    """The suite's two lists and their refusals: every pair of IN_PROCESS values (run in
    the layout sessions), and every pair that holds THROUGH_MAIN (run through main.py)."""
    rules = rules or Rules()
    cases, refused = generate(rules, factors=IN_PROCESS)
    through_main, more = generate(rules, holding=THROUGH_MAIN)
    return cases, through_main, {**refused, **more}


def to_json(cases, through_main, refused):
    """The committed form: cases by their values' names, refusals by their pairs."""
    named = lambda cs: [{f: c[f].name for f in NAMES} for c in cs]
    return {"seed": SEED, "world_cap": WORLD_CAP, "factors": {f: [x.name for x in FACTORS[f]] for f in NAMES},
            "cases": named(cases), "through_main": named(through_main),
            "refused": [{"values": [list(t) for t in pair], "message": message}
                        for pair, message in sorted(refused.items())]}


def from_json(data, key="cases"):
    """Committed cases back as [{factor: Value}] (KeyError: a value no longer exists)."""
    return [{f: _value(f, names[f]) for f in NAMES} for names in data[key]]
