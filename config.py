"""The run's configuration: gpt2_train_cfg.yaml + `key=value` overrides, typed and checked.

Each YAML section maps onto one dataclass that lives beside the code it
configures (ModelConfig in model.py, DataConfig in char_dataset.py, ...).
omegaconf rejects unknown keys and wrong types; `validate` rejects impossible
values and layouts. Both run on every rank *before* any process group
exists, so a bad config makes every rank exit with the same one-line error
and no rank is left waiting in a collective.
"""

import os
from dataclasses import dataclass, field

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from char_dataset import SAMPLERS, DataConfig
from errors import UserError
from model import ModelConfig
from parallel.config import ParallelConfig
from parallel.layout import check_keys, check_layout
from data.prepare import PrepareConfig
from planner.config import PlanConfig
from trainer import TrainerConfig

DEFAULT_YAML = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_train_cfg.yaml")


@dataclass
class WandbConfig:
    mode: str = "offline"   # offline | online | disabled
    project: str = "mingpt-parallel"
    name: str = ""          # "" = the run directory's name


@dataclass
class SampleConfig:
    prompt: str = "\n"
    length: int = 300
    temperature: float = 0.8
    top_k: int = 20
    seed: int = 0


@dataclass
class ExportConfig:
    path: str = ""          # mode=export: the Hugging Face GPT-2 folder to write (any fsspec URL)


@dataclass
class Config:
    mode: str = "train"     # train | sample | export | prepare | plan
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


def load_config(overrides, world_size: int, yaml_path: str = DEFAULT_YAML) -> Config:
    """Schema <- YAML <- command-line dot-list, then validate. Raises UserError."""
    # `config=path` picks another YAML file (handy for tests and experiments)
    rest = [o for o in overrides if not o.startswith("config=")]
    for o in overrides:
        if o.startswith("config="):
            yaml_path = o.split("=", 1)[1]
    for o in rest:
        if "=" not in o:
            raise UserError(f"command-line argument {o!r} is not key=value "
                            "(e.g. trainer.max_steps=100)")
    try:
        schema = OmegaConf.structured(Config)
        cfg = OmegaConf.merge(schema, OmegaConf.load(yaml_path), _parse_overrides(schema, rest))
        cfg = OmegaConf.to_object(cfg)
    except FileNotFoundError:
        raise UserError(f"config file not found: {yaml_path}") from None
    except OmegaConfBaseException as e:
        raise UserError(f"bad config: {_first_line(e)}") from None
    except Exception as e:  # a YAML syntax error, a directory instead of a file, ...
        raise UserError(f"cannot read config file {yaml_path}: {_first_line(e)}") from None
    validate(cfg, world_size)
    return cfg


def _parse_overrides(schema, overrides):
    """Like OmegaConf.from_dotlist, except that string keys take the text as written:
    `sample.prompt=KING:` is the prompt "KING:", not a YAML mapping."""
    parsed = OmegaConf.create()
    for item in overrides:
        key, value = item.split("=", 1)
        if isinstance(OmegaConf.select(schema, key, default=None), str):
            OmegaConf.update(parsed, key, value, force_add=True)
        else:
            parsed.merge_with(OmegaConf.from_dotlist([item]))
    return parsed


def _first_line(e):
    # omegaconf appends "full_key: ..., object_type=..." lines; the first says it all
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    key = getattr(e, "full_key", None)
    return f"{lines[0]}" + (f" (key: {key})" if key and key not in lines[0] else "")


def validate(cfg: Config, world_size: int):
    m, d, t, p = cfg.model, cfg.data, cfg.trainer, cfg.parallel
    checks = [
        (cfg.mode in ("train", "sample", "export", "prepare", "plan"),
         f"mode must be train, sample, export, prepare or plan, got {cfg.mode!r}"),
        (cfg.mode != "export" or bool(cfg.export.path),
         "mode=export needs export.path=DIR: the Hugging Face GPT-2 folder to write"),
        (t.precision in ("fp32", "bf16", "fp16"),
         f"trainer.precision must be fp32, bf16 or fp16, got {t.precision!r}"),
        (t.fp16_init_scale > 0 and t.fp16_growth_interval >= 1,
         "trainer.fp16_init_scale must be > 0 and trainer.fp16_growth_interval >= 1"),
        (m.n_layer >= 1 and m.n_head >= 1 and m.n_embd >= 1, "model sizes must be positive"),
        (m.n_embd % m.n_head == 0,
         f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}"),
        (0.0 <= m.dropout < 1.0, f"model.dropout must be in [0, 1), got {m.dropout}"),
        (d.block_size >= 1, f"data.block_size must be >= 1, got {d.block_size}"),
        (d.tokenizer in ("char", "gpt2"), f"data.tokenizer must be char or gpt2, got {d.tokenizer!r}"),
        (0.0 < d.val_fraction < 1.0, f"data.val_fraction must be in (0, 1), got {d.val_fraction}"),
        (d.sampler in SAMPLERS, f"data.sampler must be one of {sorted(SAMPLERS)}, got {d.sampler!r}"),
        (d.sampler != "randperm" or not d.tokens_path,
         "data.sampler=randperm (the old order: a permutation of every window in memory) is only "
         "for finishing runs on text snapshotted before the feistel sampler; it does not read "
         "data.tokens_path"),
        (cfg.mode != "prepare" or (d.path and d.tokens_path),
         "mode=prepare needs data.path (the text: a file, directory or glob) and "
         "data.tokens_path (where the token shards go)"),
        (cfg.prepare.workers >= 0, f"prepare.workers must be >= 0, got {cfg.prepare.workers}"),
        (cfg.prepare.chunk_mb > 0, f"prepare.chunk_mb must be > 0, got {cfg.prepare.chunk_mb}"),
        (t.max_steps >= 1, f"trainer.max_steps must be >= 1, got {t.max_steps}"),
        (t.profile_from >= 0 and t.profile_steps >= 1,
         f"trainer.profile_from must be >= 0 (0 = off) and trainer.profile_steps >= 1, got "
         f"{t.profile_from} and {t.profile_steps}"),
        (t.batch_size >= 1 and t.grad_accum >= 1, "trainer.batch_size and grad_accum must be >= 1"),
        (t.lr > 0 and 0 <= t.min_lr <= t.lr, "need 0 < trainer.lr and 0 <= trainer.min_lr <= lr"),
        (min(t.log_every, t.eval_every, t.save_every, t.warmup_steps) >= 0,
         "trainer.log_every/eval_every/save_every/warmup_steps must be >= 0"),
        (t.eval_batches >= 1 or t.eval_every == 0,
         f"trainer.eval_batches must be >= 1 when evaluating, got {t.eval_batches}"),
        (0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "trainer.beta1 and beta2 must be in [0, 1)"),
        (t.weight_decay >= 0 and t.grad_clip >= 0, "trainer.weight_decay and grad_clip must be >= 0"),
        (0 <= t.seed < 2**31, f"trainer.seed must be in [0, 2**31), got {t.seed}"),
        (bool(t.run_dir), "trainer.run_dir must not be empty"),
        (t.keep_snapshots >= 1, f"trainer.keep_snapshots must be >= 1, got {t.keep_snapshots}"),
        (t.resume_step == -1 or t.resume_step >= 1,
         f"trainer.resume_step must be -1 (the newest snapshot) or a kept step >= 1, "
         f"got {t.resume_step}"),
        (cfg.sample.length >= 0 and cfg.sample.top_k >= 0 and cfg.sample.temperature > 0,
         "sample.length and sample.top_k must be >= 0 and sample.temperature > 0"),
        (t.device in ("auto", "cpu", "cuda"), f"trainer.device must be auto, cpu or cuda, got {t.device!r}"),
        (cfg.wandb.mode in ("offline", "online", "disabled"),
         f"wandb.mode must be offline, online or disabled, got {cfg.wandb.mode!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    check_keys(p)
    if cfg.mode in ("sample", "export", "prepare", "plan"):  # the layout of this job does not matter
        return
    check_layout(cfg, world_size)  # parallel/layout.py: the grid, and each dimension's rules


def resolved_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))
