"""trainer.compile (issue 23): each transformer block compiled, under every own strategy.

- tests/compile_worker.py on 2 ranks (one torchrun job for all layouts): compiled
  against eager under the same layout, 4 steps and two evaluations: losses and
  pre-clip gradient norms within rtol 1e-4, the same collectives every step,
  compilations per code object bounded by the signatures it sees, and only the
  graph breaks the collectives are marked for (backend aot_eager: dynamo's capture
  and AOT autograd without inductor's slow code generation on this CPU);
- through main.py: compile time and counts in metrics.jsonl (a pipeline, whose
  evaluation batch has another shape than its micro-batches); a compiled run
  resumed eager under another layout and the reverse, against an uninterrupted run;
- refusals, in process: one line each, before anything runs;
- in process: after warm-up no block runs its eager forward (every block compiled).
(fsdp stage 3's gather order compiled: tests/test_fsdp_units.py, `compiled` cases.)
"""


import pytest

from harness import assert_parity, run_metrics, save_then_resume, worker_result

# the suite compiles one layout of each dimension, the rest are the long tier's (tests/README.md):
# the combination matrix compiles every dimension's values with the others (test_option_matrix.py)
SUITE_LAYOUTS = ["single", "ddp_bucket-tinycap", "fsdp3", "tp2", "tp2-sp-recompute-dropout",
                 "pp2-1f1b-m2", "cp2", "fsdp3-recompute"]
COMPILE_SESSION = ("compile_worker.py", 2, 400, ",".join(SUITE_LAYOUTS))
pytestmark = pytest.mark.worker_sessions(COMPILE_SESSION)  # prefetch.py

RTOL = 1e-4  # compilation may reorder floating-point sums (inductor does; aot_eager rarely)
COMPILED = ["trainer.compile=true", "trainer.compile_backend=aot_eager"]


def worker(layout="single"):
    return worker_result(*(COMPILE_SESSION if layout in SUITE_LAYOUTS else LONG_SESSION))


# distinct (shapes, grad mode) a compiled code object meets: training and evaluation
# (no grad); under TP the column / row layer's code runs for attention and for the MLP,
# whose weights differ in shape, so each of those twice
SIGNATURES = {"tp2": 4, "tp2-sp": 4, "tp2-sp-recompute-dropout": 4, "tp2-bf16": 4}
LAYOUTS = ["single", "single-whole-model", "ddp_naive", "ddp_bucket-tinycap", "fsdp1", "fsdp2",
           "fsdp3", "tp2", "tp2-sp", "pp2-gpipe-m4", "pp2-1f1b-m2", "pp2-interleaved-v2-m2", "cp2",
           "fsdp3-recompute", "tp2-sp-recompute-dropout", "pp2-1f1b-m2-recompute",
           "ddp_bucket-bf16", "tp2-bf16"]
LONG_SESSION = ("compile_worker.py", 2, 400, ",".join(n for n in LAYOUTS if n not in SUITE_LAYOUTS))


@pytest.mark.parametrize("layout", [
    pytest.param(name, marks=() if name in SUITE_LAYOUTS else
                 [pytest.mark.long, pytest.mark.worker_sessions(LONG_SESSION)]) for name in LAYOUTS])
def test_compiled_matches_eager_under_the_same_layout(layout):
    r = worker(layout)[layout]
    print(f"{layout}: loss {r['loss_rel_diff']:.3g}, grad norm {r['norm_rel_diff']:.3g}, eval "
          f"{r['eval_rel_diff']:.3g}; {r['compile_frames']} code objects compiled, "
          f"{r['compile_recompiles']} recompiles, at most {r['compile_max_per_frame']} each; "
          f"{r['disabled_breaks']} breaks at collectives")
    assert r["loss_rel_diff"] <= RTOL and r["norm_rel_diff"] <= RTOL, r
    assert r["eval_rel_diff"] <= RTOL, r
    assert r["comm_equal"], f"compilation changed the collectives of a step: {r}"
    assert r["compile_frames"] >= 1, f"nothing was compiled: {r}"
    assert r["frames_failed"] == 0 and not r["unexpected_breaks"], \
        f"part of a block fell back to eager: {r}"
    assert r["compile_max_per_frame"] <= SIGNATURES.get(layout, 2), f"recompiles: {r}"
    if layout.startswith(("tp2", "cp2")):  # their collectives sit inside the blocks
        assert r["disabled_breaks"] > 0, r


def test_ddp_bucket_hooks_fire_per_bucket_while_compiled_backward_runs():
    """A compiled block's backward is one autograd node, but its parameters' gradient
    hooks still fire one by one: with a tiny cap every bucket but the last must start
    its all-reduce before backward ends, and every gradient land in its bucket."""
    r = worker("ddp_bucket-tinycap")["ddp_bucket-tinycap"]
    assert r["early_launches"] > 0 and r["grads_copied"] == 0, r


def test_compile_time_and_recompiles_are_in_metrics(tmp_path):
    """A 1F1B pipeline, 24 steps, evaluated every 10: its micro-batches (6 sequences)
    and its evaluation batch (12, no grad) are two signatures, so no code object may
    compile more than twice, and the compilation shows on step 1 (inside step_ms) and
    on the first evaluation."""
    records = run_metrics(tmp_path, 2, COMPILED + [
        "parallel.dp=single", "parallel.pp=2", "parallel.microbatches=2", "trainer.max_steps=24",
        "trainer.eval_every=10", "trainer.log_every=5"])
    by_step = {r["step"]: r for r in records}
    assert sorted(by_step) == [1, 5, 10, 15, 20, 24]  # step 1 written: it compiled
    first, last = by_step[1], records[-1]
    print(f"step 1: {first['step_ms']:.0f} ms, of which compiling {first['compile_ms']:.0f} ms; "
          f"first evaluation compiling {by_step[10]['val_compile_ms']:.0f} ms; "
          f"{last['compile_frames']} code objects, {last['compile_recompiles']} recompiles")
    assert 0 < first["compile_ms"] <= first["step_ms"]
    assert by_step[10]["val_compile_ms"] > 0 and by_step[20]["val_compile_ms"] == 0
    assert all(r["compile_ms"] == 0 for r in records[1:])
    assert last["compile_frames"] >= 1 and last["compile_max_per_frame"] <= 2, last
    assert last["compile_recompiles"] <= last["compile_frames"], last


def test_resume_between_compiled_and_eager_matches_uninterrupted_run(tmp_path):
    """fsdp ZeRO-3 compiled on 2 ranks, resumed eager by one process; one process eager,
    resumed compiled under tp=2: both against one uninterrupted eager run."""
    whole = run_metrics(tmp_path, 1, ["parallel.dp=single"])
    to_eager = save_then_resume(tmp_path, (2, ["parallel.dp=fsdp", "parallel.zero_stage=3", *COMPILED]),
                                (1, ["parallel.dp=single"]))
    to_compiled = save_then_resume(tmp_path, (1, ["parallel.dp=single"]),
                                   (2, ["parallel.dp=single", "parallel.tp=2", *COMPILED]))
    assert_parity(whole[3:], to_eager, rtol=RTOL)
    assert_parity(whole[3:], to_compiled, rtol=RTOL)
    assert to_compiled[0]["compile_ms"] > 0 and "compile_ms" not in to_eager[0]


@pytest.mark.parametrize("world,overrides,says", [
    (2, ["parallel.dp=ddp_bucket", "trainer.compile_scope=model"], "compile_scope=model"),
    (1, ["parallel.dp=single", "trainer.compile_scope=model", "trainer.activation_checkpointing=true"],
     "compile_scope=model"),
    (2, ["parallel.dp=torch_ddp"], "PyTorch's reference"),
    (2, ["parallel.dp=torch_fsdp"], "PyTorch's reference"),
    (2, ["parallel.dp=single", "parallel.tp=2", "parallel.tp_impl=torch"], "PyTorch's reference"),
    (1, ["parallel.dp=single", "trainer.compile_backend=cudagraphs"], "compile_backend"),
    (2, ["parallel.dp=single", "parallel.pp=2", "parallel.pp_schedule=zb1p"], "zero-bubble split"),
])
def test_what_cannot_run_compiled_is_refused_with_one_line(world, overrides, says):
    from config import load_config
    from errors import UserError
    with pytest.raises(UserError) as e:
        load_config(["trainer.compile=true"] + overrides, world)
    print(e.value)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_compile_is_off_by_default():
    from config import load_config
    cfg = load_config(["parallel.dp=single"], 1)
    assert cfg.trainer.compile is False and cfg.trainer.compile_backend == "inductor"


def test_no_block_runs_its_eager_forward_after_warm_up():
    """Every block must be compiled, not one: all blocks share one compiled code object,
    so compiling only the first (`[...][:1]`) leaves the counts of compilations and the
    parity of the compiled runs unchanged. In process, `single` with trainer.compile,
    3 blocks (backend eager: dynamo's capture, which decides what runs compiled;
    aot_eager would add seconds of AOT autograd): each block's forward wrapped before
    compilation by a counter
    that only counts when it runs as Python (`torch.compiler.is_compiling()` is true
    while dynamo traces it, and compiled code never runs it). Eager, it counts every
    block once per forward; after a warm-up step and evaluation, a training step and an
    evaluation must count 0 for every block."""
    import types

    import torch
    from dp_worker import OneRank
    from model import GPT, GPTConfig
    from parallel import model_plan as plan
    from parallel.config import ParallelConfig
    from parallel.parallelize import parallelize
    from training.config import TrainerConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=65, block_size=16))
    eager = {}

    def counted_forward(self, *args, **kw):
        if not torch.compiler.is_compiling():
            eager[self] = eager.get(self, 0) + 1
        return type(self).forward(self, *args, **kw)

    blocks = [block for _, block in plan.blocks(gpt)]
    for block in blocks:  # one function for all blocks, as the compiled forward is one code
        block.forward = types.MethodType(counted_forward, block)
    strategy = parallelize(gpt, OneRank(), ParallelConfig(dp="single"))
    tcfg = TrainerConfig(compile=True, compile_backend="eager")
    data = torch.randint(0, 65, (4, 17))
    x, y = data[:, :-1], data[:, 1:]
    strategy.eval_loss(x, y)
    assert [eager.get(b, 0) for b in blocks] == [1, 1, 1]  # the counter sees an eager forward
    strategy.configure_compute(tcfg)
    strategy.configure_optimizer(tcfg)

    def step():
        strategy.forward_backward([(x, y)])
        strategy.optimizer_step(1e-3)
        strategy.eval_loss(x, y)
    step()  # warm-up: compiles training and evaluation
    eager.clear()
    step()
    counts = [eager.get(b, 0) for b in blocks]
    print(f"eager forwards per block after warm-up: {counts}")
    assert counts == [0, 0, 0], f"blocks ran their eager forward after warm-up: {counts}"


def test_eager_functions_are_disabled_once_compilation_starts_and_dynamo_is_not_imported_before():
    """`@eager_under_compile` (parallel/compile.py): torch.compiler.disable applied when
    compile_model starts, not at import, where it would import dynamo (about 1.5 s of CPU)
    in every process. A fresh interpreter importing config, the model and every dimension
    has no torch._dynamo; after compile_model, every marked function is the disabled one."""
    import subprocess
    import sys
    from harness import REPO, job_env
    code = ("import sys; import config, model, parallel.parallelize, parallel.tensor_parallel.layers, "
            "parallel.context_parallel.apply; "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=job_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr[-2000:]

    import importlib
    import torch
    from model import GPT, GPTConfig
    from parallel.compile import _EAGER, compile_model
    from parallel.tensor_parallel import layers  # noqa: F401  (registers its marks)
    # the cp implementations are loaded by name when parallelize applies cp, before compiling
    from parallel.context_parallel import allgather_attention, ring_attention  # noqa: F401
    assert len(_EAGER) >= 8, _EAGER
    compile_model(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=8, block_size=8)), "eager")
    for module, qualname in _EAGER:
        owner = importlib.import_module(module)
        for part in qualname.split("."):
            owner = getattr(owner, part)
        assert getattr(owner, "_torchdynamo_disable", False), f"{module}.{qualname} not disabled"
    torch._dynamo.reset()
