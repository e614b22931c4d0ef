"""Config: typed schema, overrides, and one clear error for impossible values."""

import pytest

from config import load_config
from errors import UserError


def test_defaults_and_overrides():
    cfg = load_config(["trainer.max_steps=7", "model.n_layer=3", "parallel.dp=single"], 1)
    assert cfg.trainer.max_steps == 7 and cfg.model.n_layer == 3
    assert cfg.wandb.mode == "offline"  # never asks for a key by default


@pytest.mark.parametrize("device,gpu_major,mode,expected", [
    ("auto", None, "train", "fp32"),     # no CUDA: a CPU run stays fp32
    ("cpu", 9, "train", "fp32"),         # a GPU present but not chosen
    ("auto", 9, "train", "bf16"),        # an H100 (compute capability 9.0)
    ("cuda", 8, "train", "bf16"),        # an A100
    ("auto", 7, "train", "fp32"),        # a V100: bf16 only emulated, slower than fp32
    ("auto", 9, "dryrun", "bf16"),
    ("cpu", None, "plan", "bf16"),       # mode=plan asks plan.gpu (H100-80GB here), not this machine
    ("cpu", None, "dryrun", "bf16"),     # and so does the dry run of the plan's layout
])
def test_precision_auto_is_bf16_where_the_device_has_it(monkeypatch, device, gpu_major, mode, expected):
    """trainer.precision=auto is resolved in load_config, the same way on every rank, so the
    rules, config.yaml, snapshots and healing read the precision that runs. The GPU is a
    stand-in: torch.cuda answers as a machine with that GPU would."""
    import types
    import torch
    if gpu_major is not None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda index: types.SimpleNamespace(major=gpu_major))
    cfg = load_config([f"mode={mode}", "trainer.precision=auto", f"trainer.device={device}",
                       "plan.gpu=H100-80GB"], 1)
    assert cfg.trainer.precision == expected


def test_precision_auto_plans_for_the_planned_gpu():
    v100 = load_config(["mode=plan", "trainer.precision=auto", "plan.gpu=V100-32GB"], 1)
    assert v100.trainer.precision == "fp32"  # no bf16 in its table


@pytest.mark.parametrize("overrides,world,message", [
    (["trainer.bogus=1"], 1, "bogus"),
    (["trainer.max_steps=many"], 1, "max_steps"),
    (["trainer.max_steps"], 1, "not key=value"),
    # nanoGPT's and argparse's spellings: the key they mean (issue 54)
    (["--max_steps=10"], 1, r"^unknown key '--max_steps': did you mean trainer.max_steps=10\?$"),
    (["--max-steps=10"], 1, r"did you mean trainer.max_steps=10\?$"),
    (["--seed=3"], 1, r"did you mean trainer.seed=3 or sample.seed=3\?$"),
    (["--max_steps"], 1, r"not key=value \(did you mean trainer.max_steps=VALUE\?\)"),
    (["parallel.pp_layers=3"], 1, r"^parallel.pp_layers=3: parallel.pp_layers is a list\[int\], "
                                  r"written in brackets: parallel.pp_layers=\[2,2\]"),
    (["model.n_layer=-1"], 1, "^model.n_layer must be >= 1, got -1$"),
    (["model.n_head=0"], 1, "^model.n_head must be >= 1, got 0$"),
    (["data.tokens_path=tok", "data.val_fraction=0.2"], 1,
     "^data.val_fraction=0.2 is not read with data.tokens_path: .* prepare them again"),
    (["parallel.dp=warp_drive"], 1, "warp_drive"),
    (["parallel.dp=single"], 2, "no data-parallel dimension"),
    (["parallel.dp=single", "parallel.tp=2"], 4, "no data-parallel dimension"),
    (["parallel.tp=2"], 3, "not divisible by parallel.tp \\* parallel.cp \\* parallel.pp"),
    (["parallel.cp=2", "data.block_size=18"], 2, "block_size=18 is not divisible by 2 x parallel.cp"),
    (["parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true", "data.block_size=12"], 8,
     "block_size / parallel.cp = 6 is not divisible by parallel.tp=4"),
    (["parallel.cp=2", "parallel.tp_impl=torch", "parallel.tp=2"], 4, "alone: it runs without parallel.cp=2"),
    (["parallel.cp=2", "parallel.dp=single"], 2, "single averages no gradients, but with parallel.cp=2"),
    (["parallel.cp_impl=ulysses"], 1, "parallel.cp_impl must be one of"),
    (["parallel.tp=3"], 3, "n_head=4 is not divisible by parallel.tp=3"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "data.block_size=15"], 2,
     "block_size=15 is not divisible by parallel.tp=2"),
    (["parallel.sequence_parallel=true"], 2, "needs parallel.tp > 1"),
    (["parallel.tp=2", "parallel.dp=torch_fsdp"], 4, "torch_fsdp with parallel.tp > 1"),
    (["parallel.pp=2", "parallel.pp_schedule=zigzag"], 2, "pp_schedule must be"),
    (["parallel.microbatches=2"], 1, "for pipeline parallelism"),
    (["parallel.pp=2", "parallel.pp_virtual_stages=2", "model.n_layer=4"], 2,
     "needs parallel.pp_schedule=interleaved"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.microbatches=3"], 2,
     "must be a multiple of it"),
    (["parallel.pp=4", "model.n_layer=3"], 4, "more stages than layers"),
    (["parallel.pp=2", "parallel.pp_layers=[4]"], 2, "pp_layers"),
    (["parallel.pp=2", "parallel.pp_layers=[0,4]"], 2, "pp_layers"),
    (["parallel.pp=2", "parallel.dp=torch_ddp"], 4, "does not run under pipeline"),
    (["parallel.pp_impl=torch"], 1, "set parallel.pp > 1"),
    (["parallel.pp_impl=torch", "parallel.pp=2"], 4, "no data-parallel dimension"),
    (["parallel.tp_impl=torch"], 1, "set parallel.tp > 1"),
    (["parallel.tp_impl=torch", "parallel.tp=2", "parallel.sequence_parallel=true"], 2,
     "without sequence parallelism"),
    (["parallel.tp_impl=torch", "parallel.tp=2", "parallel.pp=2"], 4,
     "does not run under pipeline"),
    (["parallel.tp_impl=dtensor"], 1, "tp_impl and parallel.pp_impl must be one of"),
    # the references' old keys: one line naming the new one
    (["parallel.dp=torch_tp"], 1, "parallel.dp=torch_tp is now parallel.tp_impl=torch"),
    (["parallel.dp=torch_pp", "mode=sample"], 1, "parallel.dp=torch_pp is now parallel.pp_impl=torch"),
    (["parallel.pp=2", "parallel.dp=fsdp", "parallel.zero_stage=3"], 4, "zero_stage=3 with"),
    (["parallel.pp=2", "parallel.microbatches=5"], 2, "parallel.microbatches 5"),
    (["trainer.batch_size=10"], 3, "divisible"),
    (["trainer.batch_size=8", "trainer.grad_accum=3"], 1, "divisible"),
    (["model.n_head=3"], 1, "n_embd"),
    (["model.vocab_pad_to=0"], 1, "model.vocab_pad_to must be >= 1"),
    (["parallel.tp_impl=torch", "parallel.tp=2", "model.vocab_pad_to=64"], 2,
     "does not mask a padded vocabulary"),
    (["wandb.mode=loud"], 1, "wandb.mode"),
    (["data.tokenizer=bytes"], 1, "tokenizer"),
    (["config=/nonexistent.yaml"], 1, "config file not found"),
    (["config=/"], 1, "cannot read config file"),
    (["trainer.eval_batches=0"], 1, "eval_batches"),
    (["trainer.beta2=1.5"], 1, "beta"),
    (["trainer.seed=-1"], 1, "seed"),
    (["trainer.run_dir="], 1, "run_dir"),
    (["sample.top_k=-3"], 1, "top_k"),
    (["parallel.timeout_s=inf"], 1, "timeout_s"),
    (["parallel.zero_stage=4"], 1, "zero_stage"),
    (["trainer.keep_snapshots=0"], 1, "keep_snapshots"),
    (["trainer.resume_step=0"], 1, "resume_step"),
    (["trainer.precision=fp8"], 1, "trainer.precision must be auto, fp32, bf16 or fp16"),
    (["trainer.precision=fp16", "trainer.fp16_growth_interval=0"], 1, "fp16_growth_interval"),
    (["trainer.activation_checkpointing_mode=op"], 1, "activation_checkpointing_mode must be full or"),
    (["trainer.activation_checkpointing_every=0"], 1, "activation_checkpointing_every >= 1"),
    # the ring's thread beside autograd's NCCL communicators (refused on CUDA only: gloo runs it)
    (["parallel.allreduce=ring", "parallel.tp=2", "trainer.device=cuda"], 4,
     "parallel.allreduce=ring and parallel.tp=2 is refused on CUDA"),
    (["parallel.allreduce=ring", "parallel.pp=2", "trainer.device=cuda"], 4,
     "parallel.allreduce=ring and parallel.pp=2 is refused on CUDA"),
    # cp's ring attention sends from autograd too; the gradient group spans dp x cp, so the
    # ring runs (and is refused) even with parallel.dp degree 1
    (["parallel.allreduce=ring", "parallel.cp=2", "trainer.device=cuda"], 4,
     "parallel.allreduce=ring and parallel.cp=2 is refused on CUDA"),
    (["parallel.allreduce=ring", "parallel.cp=2", "trainer.device=cuda"], 2,
     "parallel.allreduce=ring and parallel.cp=2 is refused on CUDA"),
    (["parallel.reduce_dtype=fp16"], 2, "parallel.reduce_dtype must be fp32 or bf16"),
    (["parallel.dp=torch_ddp", "parallel.reduce_dtype=bf16"], 2, "PyTorch's reference and reduces in fp32"),
    (["parallel.tp_impl=torch", "parallel.tp=2", "trainer.precision=bf16"], 2, "runs in fp32"),
    (["parallel.pp_impl=torch", "parallel.pp=2", "trainer.activation_checkpointing=true"], 2,
     "without activation checkpointing"),
    (["mode=export"], 1, "needs export.path"),
    (["mode=serve"], 1, "mode must be train, sample, export, prepare, plan, dryrun, plot or lighthouse"),
    # fault-tolerant replica groups (fault_tolerance/config.py)
    (["ft.replicas=2", "ft.replica_id=2"], 1, "ft.replica_id must be in 0..1 \\(ft.replicas=2\\), got 2"),
    (["ft.replica_id=-1"], 1, "ft.replica_id must be in 0..0"),
    (["ft.replicas=0"], 1, "ft.replicas must be >= 1, got 0"),
    (["ft.replicas=2", "ft.min_replicas=3"], 1, "ft.min_replicas must be in 1..ft.replicas=2, got 3"),
    (["mode=lighthouse", "ft.min_replicas=0"], 1, "ft.min_replicas must be >= 1, got 0"),
    (["ft.lighthouse=nohost"], 1, "ft.lighthouse must be HOST:PORT"),
    (["ft.timeout_s=0"], 1, "ft.timeout_s must be > 0"),
    (["ft.enabled=true", "ft.replicas=5", "trainer.batch_size=12"], 2,
     "divisible by ft.replicas \\* data-parallel ranks \\* trainer.grad_accum = 5 \\* 2 \\* 1 = 10"),
    (["mode=prepare", "data.path=a.txt"], 1, "mode=prepare needs data.path .* and data.tokens_path"),
    (["mode=prepare", "data.tokens_path=tok"], 1, "mode=prepare needs data.path"),
    (["data.sampler=shuffle"], 1, "data.sampler must be one of"),
    (["data.sampler=randperm", "data.tokens_path=tok"], 1, "does not read data.tokens_path"),
    (["prepare.workers=-1"], 1, "prepare.workers"),
    (["prepare.chunk_mb=0"], 1, "prepare.chunk_mb"),
    # hybrid sharding and offload: the keys named, every strategy that cannot
    (["parallel.dp=fsdp", "parallel.dp_replicate=3"], 4,
     "parallel.dp_replicate=3 does not divide the data-parallel degree 4"),
    (["parallel.dp=fsdp", "parallel.dp_replicate=2", "parallel.tp=2"], 2,
     "parallel.dp_replicate=2 does not divide the data-parallel degree 1"),
    (["parallel.dp=fsdp", "parallel.dp_replicate=0"], 2, "parallel.dp_replicate must be >= 1"),
    (["parallel.dp=ddp_bucket", "parallel.dp_replicate=2"], 4,
     "parallel.dp_replicate=2 with parallel.dp=ddp_bucket: .* nothing to shard"),
    (["parallel.dp=torch_ddp", "parallel.dp_replicate=2"], 4,
     "parallel.dp_replicate=2 with parallel.dp=torch_ddp: .* nothing to shard"),
    (["parallel.dp=single", "parallel.dp_replicate=2"], 2,
     "parallel.dp_replicate=2 with parallel.dp=single: one process has no replicas"),
    (["parallel.dp=ddp_naive", "parallel.offload=true"], 2,
     "parallel.offload=true with parallel.dp=ddp_naive: .* only parallel.dp=fsdp"),
    (["parallel.dp=single", "parallel.offload=true"], 1,
     "parallel.offload=true with parallel.dp=single"),
])
def test_bad_config_is_one_clear_error(overrides, world, message):
    with pytest.raises(UserError, match=message):
        load_config(overrides, world)


def test_every_rule_reads_facts_that_exist():
    """A rule's condition names its facts by its parameters and its message by {fields}:
    each must be a fact (parallel/rules.py Facts) or a grid dimension, or the rule would
    fail only on the layout that reaches it."""
    import string
    from parallel.grid import DIMS
    from parallel.rules import GRID, KEYS, LAYOUT, Facts
    known = set(dir(Facts)) | set(DIMS)
    wrong = []
    for rule in KEYS + GRID + LAYOUT:
        code = rule.refused.__code__
        fields = {f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(rule.message)
                  if f}
        wrong += [f"{rule.topic}: {name}" for name in set(code.co_varnames[:code.co_argcount]) | fields
                  if name not in known]
    assert not wrong, wrong


def test_the_registry_names_each_strategy_its_class_and_known_capabilities():
    from parallel.registry import CAPABILITIES, STRATEGIES, load
    for name, (where, can) in STRATEGIES.items():
        assert load(where).name == name and can <= set(CAPABILITIES), (name, where, can)
