"""trainer.optimizer=muon (optimizers/muon.py).

- in process: our Strategy's steps equal torch.optim.Muon on the blocks' matrices plus
  torch.optim.AdamW on the rest, bitwise, per step, over a run; a stacked expert weight
  steps as each expert's matrix would alone; AdamW stays torch's own optimizer;
- the parity matrix (tests/layout_worker.py's and experts_worker.py's muon cases, in the
  2- and 4-rank layout sessions): every layout Muon runs under equals one process to fp32
  tolerance (Newton-Schulz in fp32: layout_worker.MUON says why);
- through main.py: a snapshot carries the momentum in canonical form (resumed under
  another layout and world size, the losses of an uninterrupted run); a snapshot of
  another optimizer is refused in one line.
"""

import math

import pytest
import torch

import experts_worker
import layout_worker
from dp_worker import OneRank
from harness import (LAYOUT_SESSIONS, assert_layout_matches, assert_parity, experts_worker_result,
                     layout_worker_result, run_job, run_metrics, save_then_resume)
from test_bad_input import assert_clean_failure
from model import GPT, GPTConfig
from optimizers.muon import MuonAdamW
from parallel import model_plan as plan
from parallel.config import ParallelConfig
from parallel.parallelize import parallelize
from training.config import TrainerConfig
from training.step import lr_at

pytestmark = pytest.mark.worker_sessions(*LAYOUT_SESSIONS[:2])  # prefetch.py: 2 and 4 ranks

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=20, block_size=8)


def batches(steps):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(20, (4, 8), generator=g), torch.randint(20, (4, 8), generator=g))
            for _ in range(steps)]


def ours(t, data):
    strategy = parallelize(GPT(CONFIG, seed=1), OneRank(), ParallelConfig(dp="single"))
    strategy.configure_optimizer(t)
    out = []
    for step, (x, y) in enumerate(data):
        loss = strategy.forward_backward([(x, y)])
        norm = strategy.clip_grad_norm_(t.grad_clip or math.inf)
        strategy.optimizer_step(lr_at(step, t))
        out.append((loss, norm))
    return out, strategy.state_dict(), strategy.optimizer


def torch_reference(t, data):
    """What PyTorch's example does: torch.optim.Muon over the hidden matrices, AdamW over
    the rest (decaying matrices only), the same schedule."""
    model = GPT(CONFIG, seed=1)
    named = dict(model.named_parameters())
    hidden = set(plan.hidden_matrices(model))
    muon = torch.optim.Muon([named[n] for n in hidden], lr=t.muon_lr, momentum=t.muon_momentum,
                            nesterov=t.muon_nesterov, weight_decay=t.muon_weight_decay,
                            ns_coefficients=tuple(t.muon_ns_coefficients),
                            ns_steps=t.muon_ns_steps, adjust_lr_fn=t.muon_adjust_lr)
    groups = [{**g, "params": [named[n] for n in g["params"] if n not in hidden]}
              for g in model.optim_groups(t.weight_decay)]
    adamw = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))
    out = []
    for step, (x, y) in enumerate(data):
        _, loss = model(x, y)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        # the norm summed as parallel/clipping.py sums it: torch's clip_grad_norm_ takes the
        # norm of the norms, whose last bit can differ, and bf16 Newton-Schulz turns a
        # last-bit difference of the clipped gradient into a bf16 step of the update
        norm = torch.stack(torch._foreach_norm(grads)).square().sum().sqrt()
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), t.grad_clip or math.inf, norm)
        lr = lr_at(step, t)
        for g in adamw.param_groups:
            g["lr"] = lr
        for g in muon.param_groups:
            g["lr"] = lr * (t.muon_lr / t.lr)  # ours: the schedule's lr times muon_lr / lr
        adamw.step()
        muon.step()
        model.zero_grad(set_to_none=True)
        out.append((loss.item(), norm.item()))
    return out, {n: p.detach().clone() for n, p in named.items()}


@pytest.mark.parametrize("keys", [
    {},  # the defaults: nesterov, Keller Jordan's lr ratio, clipping
    {"grad_clip": 0.0},  # no clipping: torch's own clip_grad_norm_ would do as well
    {"muon_nesterov": False, "muon_adjust_lr": "match_rms_adamw", "muon_momentum": 0.9,
     "grad_clip": 0.05, "muon_weight_decay": 0.0},
])
def test_one_process_equals_torch_muon_with_adamw(keys):
    t = TrainerConfig(optimizer="muon", warmup_steps=2, max_steps=6, lr=3e-3, **keys)
    data = batches(6)
    (got, weights, optimizer), (want, want_weights) = ours(t, data), torch_reference(t, data)
    assert isinstance(optimizer, MuonAdamW) and optimizer.muon is not None
    worst = max(abs(a - b) / abs(b) for step in zip(got, want) for a, b in zip(*step))
    moved = max((want_weights[n] - GPT(CONFIG, seed=1).state_dict()[n]).abs().max().item()
                for n in weights)
    off = max((weights[n] - want_weights[n]).abs().max().item() for n in weights)
    print(f"{keys}: worst relative loss/norm difference {worst:.2e}, weights {off:.2e} "
          f"(moved {moved:.2e})")
    assert moved > 1e-3  # the run trained
    assert worst <= 1e-5 and off == 0.0  # the same kernels on the same numbers


def test_a_stacked_expert_weight_steps_as_each_expert_matrix_alone():
    """[E, in, out]: expert e's slice, transposed to the (out, in) a Linear holds, under
    torch.optim.Muon (whose lr ratio reads which side is longer) gives the same slice."""
    t = TrainerConfig(optimizer="muon", muon_adjust_lr="original", lr=1e-3)
    g = torch.Generator().manual_seed(3)
    stacked = torch.nn.Parameter(torch.randn(3, 8, 24, generator=g))
    grads = [torch.randn(3, 8, 24, generator=g) for _ in range(3)]
    from optimizers.muon import build
    opt = build([{"params": [stacked], "weight_decay": 0.1}], t, {stacked: True})
    slices = [torch.nn.Parameter(stacked.detach()[e].T.clone()) for e in range(3)]
    ref = torch.optim.Muon(slices, lr=t.muon_lr, adjust_lr_fn="original")
    for grad in grads:
        stacked.grad = grad.clone()
        for e, p in enumerate(slices):
            p.grad = grad[e].T.clone()
        opt.step()
        ref.step()
    off = max((stacked.detach()[e].T - p.detach()).abs().max().item() for e, p in enumerate(slices))
    ratio = math.sqrt(24 / 8)  # (out, in) = (24, 8): the tall reading moves it more
    print(f"expert slices: max difference {off:.2e} (lr ratio {ratio:.3f})")
    assert off <= 1e-6


def test_adamw_stays_torchs_own_optimizer():
    strategy = parallelize(GPT(CONFIG, seed=1), OneRank(), ParallelConfig(dp="single"))
    strategy.configure_optimizer(TrainerConfig())
    assert type(strategy.optimizer) is torch.optim.AdamW


LAYOUTS = [(w, c.name) for w in (2, 4) for c in layout_worker.CASES[w] if c.trainer.get("optimizer") == "muon"]
EXPERTS = [(w, c.name) for w in (2, 4) for c in experts_worker.CASES[w] if "muon" in c.name]


@pytest.mark.parametrize("world,name", LAYOUTS, ids=[n for _, n in LAYOUTS])
def test_muon_under_a_layout_equals_one_process(world, name):
    r = layout_worker_result(world)["cases"][name]
    print(f"{name}: loss {r['loss_rel_diff']:.2g}, grad norm {r['norm_rel_diff']:.2g}, val loss "
          f"{r['eval_rel_diff']:.2g}, parameters {r['param_max_abs_diff']:.2g}")
    assert r["optimizer"] == "MuonAdamW", r["optimizer"]
    assert_layout_matches(r)
    assert r["param_max_abs_diff"] < 1e-5, r  # Muon's steps are no sign of the gradient: tight


PLANNED = [(w, n) for w, n in LAYOUTS if not n.startswith("cp2-torch")]  # torch_ddp: not counted


@pytest.mark.parametrize("world,name", PLANNED, ids=[n for _, n in PLANNED])
def test_muon_adds_no_traffic_where_every_replica_orthogonalizes(world, name):
    """Every replica holds each whole matrix and its averaged gradient: the bytes a Muon
    step counts are exactly the planner's for the same layout under AdamW (its textbook)."""
    from dataclasses import replace
    from planner.figures import metrics_names, rank_figures
    from test_planner import modelled
    case = next(c for c in layout_worker.CASES[world] if c.name == name)
    w, layout = modelled(replace(case, trainer={}))
    planned = {k: v for k, v in metrics_names(rank_figures(w, layout)["fullest"]).items()
               if k.startswith("comm_") and k.endswith("_bytes") and v}
    for step, got in enumerate(layout_worker_result(world)["cases"][name]["comm"]):
        logged = {k: v for k, v in got.items() if k.endswith("_bytes") and v}
        assert logged == planned, f"step {step}: counted {logged}, planned {planned}"


@pytest.mark.parametrize("world,name", EXPERTS, ids=[n for _, n in EXPERTS])
def test_muon_on_experts_under_expert_parallelism_equals_one_process(world, name):
    """Each ep rank holds whole experts: their slices orthogonalized where they live."""
    r = experts_worker_result(world)[name]
    print({k: v for k, v in r.items() if k.endswith("diff")})
    assert r["optimizer"] == "MuonAdamW" and r["ep"] > 1, r
    assert all(r[f"{f}_rel_diff"] <= 1e-5 for f in ("loss", "norm", "aux", "z", "load", "eval")), r
    assert r["param_max_abs_diff"] < 1e-5, r


# constant lr, no clipping (as test_cp's resume): what a resumed run computes is the
# uninterrupted run's own arithmetic
RUN = ["trainer.optimizer=muon", "trainer.muon_ns_dtype=fp32", "trainer.warmup_steps=0",
       "trainer.lr=0.003", "trainer.min_lr=0.003", "trainer.grad_clip=0"]
RESUME_LAYOUTS = {"single": (1, ["parallel.dp=single"]),
                  "dp2": (2, ["parallel.dp=ddp_bucket"]),
                  "pp2": (2, ["parallel.dp=single", "parallel.pp=2", "parallel.microbatches=2"])}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_metrics(tmp_path_factory.mktemp("muon"), 1, ["parallel.dp=single", *RUN])


@pytest.mark.parametrize("saved_under,resumed_under", [("dp2", "single"), ("single", "pp2")])
def test_muon_resumes_across_layouts_exactly(tmp_path, uninterrupted, saved_under, resumed_under):
    resumed = save_then_resume(tmp_path, RESUME_LAYOUTS[saved_under],
                               RESUME_LAYOUTS[resumed_under], RUN)
    print(f"{saved_under} -> {resumed_under}: {assert_parity(uninterrupted[3:], resumed)}")


def test_resuming_with_another_optimizer_is_refused_in_one_line(tmp_path):
    saved = run_job(tmp_path, 1, ["parallel.dp=single", "trainer.max_steps=2"])
    assert saved.returncode == 0, saved.stderr[-2000:]
    result = run_job(tmp_path, 2, ["parallel.dp=ddp_bucket", "trainer.max_steps=4", *RUN])
    assert_clean_failure(result, "was trained with trainer.optimizer=adamw, this run asks for muon")


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_whose_gradients_are_not_finite_leaves_weights_and_momentum_untouched(fused):
    """parallel/finite.py: foreach AdamW's flag is read before step(); fused AdamW takes it
    inside its kernel, and Muon (no such kernel) reads it in MuonAdamW.step."""
    from optimizers.muon import build
    from parallel.finite import step_unless
    t = TrainerConfig(optimizer="muon")
    matrix, bias = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8))
    opt = build([{"params": [matrix, bias], "weight_decay": 0.1}], t, {matrix: False},
                **({"fused": True} if fused else {}))
    assert bool(opt.defaults.get("fused")) == fused

    def step(found):
        matrix.grad, bias.grad = torch.randn(8, 4), torch.randn(8)
        step_unless(opt, torch.tensor(found))
    step(False)  # states exist
    before = [t.clone() for t in (matrix, bias, *opt.state[matrix].values(),
                                  *opt.state[bias].values())]
    step(True)
    after = [matrix, bias, *opt.state[matrix].values(), *opt.state[bias].values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    step(False)
    assert not torch.equal(before[0], matrix) and float(opt.state[matrix]["step"]) == 2


@pytest.mark.parametrize("overrides,world,needle", [
    (["trainer.optimizer=sgd"], 1, "trainer.optimizer must be one of adamw, muon, got 'sgd'"),
    (["trainer.optimizer=muon", "trainer.muon_momentum=1"], 1, "muon_momentum must be in [0, 1)"),
    (["trainer.optimizer=muon", "trainer.muon_ns_coefficients=[1,2]"], 1, "three numbers"),
    (["trainer.optimizer=muon", "trainer.muon_adjust_lr=keller"], 1,
     "muon_adjust_lr must be original or match_rms_adamw"),
    (["trainer.optimizer=muon", "trainer.muon_ns_dtype=fp16"], 1, "must be bf16 or fp32"),
    (["trainer.optimizer=muon", "parallel.dp=fsdp"], 2, "with parallel.dp=fsdp is not supported yet"),
    (["trainer.optimizer=muon", "parallel.tp=2"], 2, "with parallel.tp=2 is not supported yet"),
])
def test_bad_muon_settings_are_refused_in_one_line(overrides, world, needle):
    import config
    from errors import UserError
    with pytest.raises(UserError) as e:
        config.load_config(overrides, world)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
