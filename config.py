"""The run's configuration: gpt2_train_cfg.yaml + `key=value` overrides, typed and checked.

Each YAML section maps onto one dataclass that lives beside the code it
configures (ModelConfig in model.py, DataConfig in char_dataset.py, ...).
omegaconf rejects unknown keys and wrong types; `validate` rejects impossible
values and layouts. Both run on every rank *before* any process group
exists, so a bad config makes every rank exit with the same one-line error
and no rank is left waiting in a collective.
"""

import ast
import dataclasses
import functools
import inspect
import io
import json
import os
import textwrap
import tokenize
import typing
from dataclasses import dataclass, field

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from char_dataset import SAMPLERS, DataConfig
from errors import UserError, missing_package
from fault_tolerance import config as ft_config
from fault_tolerance.config import FTConfig
from launch.devices import precision_for
from telemetry import tensorboard
from model import ModelConfig
from optimizers import registry as optimizers
from parallel.config import ParallelConfig
from parallel.layout import check_keys, check_layout
from data.prepare import PrepareConfig
from planner.config import PlanConfig
from training.config import TrainerConfig

DEFAULT_YAML = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_train_cfg.yaml")


# mode=...: what main.py does with the config
MODES = {
    "train": "train, resuming from the run's snapshot when there is one (the default)",
    "sample": "print text generated from the newest snapshot (sample:)",
    "export": "write the newest snapshot as a Hugging Face GPT-2 folder to export.path",
    "prepare": "tokenize data.path into token shards at data.tokens_path (prepare:)",
    "plan": "predict memory, traffic and step time of every layout on the cluster of plan:",
    "dryrun": "one step of a few ranks of the layout on plan.nodes x plan.gpus_per_node, in this process",
    "plot": "draw the run directory's metrics as PNGs and one HTML page in trainer.run_dir/plots",
    "lighthouse": "run the fault-tolerant replica groups' lighthouse at ft.lighthouse (ft:)",
}


@dataclass
class WandbConfig:
    mode: str = "offline"   # offline (no account needed; wandb sync uploads later) | online | disabled
    project: str = "mingpt-parallel"  # the wandb project
    name: str = ""          # the wandb run name; "" = the run directory's name


@dataclass
class MetricsConfig:
    tensorboard: bool = False  # also write metrics.jsonl's scalars as TensorBoard event files in run_dir/tensorboard (needs tensorboard)


@dataclass
class SampleConfig:
    prompt: str = "\n"      # text the sample starts from
    length: int = 300       # tokens to generate; 0 = no sample after training
    temperature: float = 0.8  # softmax temperature (lower: more predictable text)
    top_k: int = 20         # sample among the k most likely tokens; 0 = all
    seed: int = 0           # the sampling generator's seed


@dataclass
class ExportConfig:
    path: str = ""          # mode=export: the Hugging Face GPT-2 folder to write (any fsspec URL)


@dataclass
class Config:
    config: str = ""        # the YAML file read instead of gpt2_train_cfg.yaml (command line only)
    mode: str = "train"     # train | sample | export | prepare | plan | dryrun | plot | lighthouse (see the modes above)
    model: ModelConfig = field(default_factory=ModelConfig)  # the GPT's shape (model.py)
    data: DataConfig = field(default_factory=DataConfig)  # text, tokens, tokenizer (char_dataset.py)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # the training loop (trainer.py)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # the layout (parallel/config.py)
    wandb: WandbConfig = field(default_factory=WandbConfig)  # curves in wandb
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  # curves in TensorBoard (telemetry/tensorboard.py)
    sample: SampleConfig = field(default_factory=SampleConfig)  # mode=sample and the sample after training
    export: ExportConfig = field(default_factory=ExportConfig)  # mode=export
    prepare: PrepareConfig = field(default_factory=PrepareConfig)  # mode=prepare (data/prepare.py)
    plan: PlanConfig = field(default_factory=PlanConfig)  # mode=plan: the target cluster (planner/config.py)
    ft: FTConfig = field(default_factory=FTConfig)  # fault-tolerant replica groups, mode=lighthouse (fault_tolerance/)
    sizes: typing.ClassVar[dict] = None  # not a key: the grid's {dim: degree}, set by validate
    given: typing.ClassVar[frozenset] = frozenset()  # not a key: those on the command line


def load_config(overrides, world_size: int, yaml_path: str = DEFAULT_YAML) -> Config:
    """Schema <- YAML <- command-line dot-list, then validate. Raises UserError."""
    # `config=path` picks another YAML file (handy for tests and experiments)
    rest = [o for o in overrides if not o.startswith("config=")]
    given = ""
    for o in overrides:
        if o.startswith("config="):
            yaml_path = given = o.split("=", 1)[1]
    for o in rest:
        if "=" not in o:
            hint = _key_hint(o, "VALUE")
            raise UserError(f"command-line argument {o!r} is not key=value "
                            + (f"(did you mean {hint}?)" if hint else "(e.g. trainer.max_steps=100)"))
    try:
        schema = _schema()
        cfg = OmegaConf.merge(schema, OmegaConf.load(yaml_path), _parse_overrides(schema, rest))
        cfg = OmegaConf.to_object(cfg)
        cfg.config = given  # as the user named it: hints quote it back
        cfg.given = frozenset(o.split("=", 1)[0] for o in rest)
    except FileNotFoundError:
        raise UserError(f"config file not found: {yaml_path}") from None
    except OmegaConfBaseException as e:
        raise UserError(_override_error(rest) or f"bad config: {_first_line(e)}") from None
    except Exception as e:  # a YAML syntax error, a directory instead of a file, ...
        raise UserError(f"cannot read config file {yaml_path}: {_first_line(e)}") from None
    if cfg.trainer.precision == "auto":  # resolved once, here: what runs is what is recorded
        cfg.trainer.precision = auto_precision(cfg)
    validate(cfg, world_size)
    return cfg


def auto_precision(cfg):
    """bf16 where the device has it: this machine's (launch/devices.py), or for mode=plan
    and mode=dryrun (which tries the plan's layout) the planned GPU's (plan.gpu, whose
    table may lack bf16: a V100)."""
    if cfg.mode in ("plan", "dryrun"):
        from planner.machines import machine
        return "bf16" if "bf16" in machine(cfg.plan).peak else "fp32"
    return precision_for(cfg.trainer.device)


@functools.lru_cache(maxsize=1)
def _schema():
    """The typed schema, built once per process (OmegaConf.merge copies it, never changes
    it): building it is most of a config load, which every job of a job server repeats."""
    return OmegaConf.structured(Config)


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


def _key_hint(word, value):
    """`section.key=value` for a word that names a key by its last part only, or with
    dashes (nanoGPT's `--max_steps`, argparse's `--max-steps`): the keys it may mean, or
    "" when it names none."""
    bare = word.lstrip("-").replace("-", "_")
    names = [k.name for k in describe_keys()]
    found = [bare] if bare in names and bare != word else \
        [n for n in names if n.rsplit(".", 1)[-1] == bare.rsplit(".", 1)[-1]]
    return " or ".join(f"{n}={value}" for n in found)


def _override_error(overrides):
    """Our one line for the first override omegaconf refused, where we can say more than it
    does: a key that is not one (with the keys it may mean), a list written without
    brackets. None: omegaconf's own message says it."""
    keys = {k.name: k for k in describe_keys()}
    for item in overrides:
        key, value = item.split("=", 1)
        if key not in keys:
            hint = _key_hint(key, value)
            if hint:
                return f"unknown key {key!r}: did you mean {hint}?"
            continue
        if keys[key].type.startswith("list[") and not value.strip().startswith("["):
            return (f"{key}={value}: {key} is a {keys[key].type}, written in brackets: "
                    f"{key}=[2,2] ({keys[key].meaning})")
    return None


def _first_line(e):
    # omegaconf appends "full_key: ..., object_type=..." lines; the first says it all
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    key = getattr(e, "full_key", None)
    return f"{lines[0]}" + (f" (key: {key})" if key and key not in lines[0] else "")


def validate(cfg: Config, world_size: int):
    m, d, t, p = cfg.model, cfg.data, cfg.trainer, cfg.parallel
    checks = [
        (cfg.mode in MODES,
         f"mode must be {', '.join(list(MODES)[:-1])} or {list(MODES)[-1]}, got {cfg.mode!r}"),
        (cfg.mode != "export" or bool(cfg.export.path),
         "mode=export needs export.path=DIR: the Hugging Face GPT-2 folder to write"),
        (t.precision in ("fp32", "bf16", "fp16"),
         f"trainer.precision must be auto, fp32, bf16 or fp16, got {t.precision!r}"),
        (t.fp16_init_scale > 0 and t.fp16_growth_interval >= 1,
         "trainer.fp16_init_scale must be > 0 and trainer.fp16_growth_interval >= 1"),
        (t.activation_checkpointing_mode in ("full", "selective") and t.activation_checkpointing_every >= 1,
         "trainer.activation_checkpointing_mode must be full or selective, activation_checkpointing_every "
         f">= 1; got {t.activation_checkpointing_mode!r}, {t.activation_checkpointing_every}"),
        (t.max_skipped_steps >= 1,
         f"trainer.max_skipped_steps must be >= 1, got {t.max_skipped_steps}"),
        *[(getattr(m, k) >= 1, f"model.{k} must be >= 1, got {getattr(m, k)}")
          for k in ("n_layer", "n_head", "n_embd")],
        (m.vocab_pad_to >= 1, f"model.vocab_pad_to must be >= 1 (1: no padding), got {m.vocab_pad_to}"),
        (m.n_head < 1 or m.n_embd % m.n_head == 0,
         f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}"),
        (0.0 <= m.dropout < 1.0, f"model.dropout must be in [0, 1), got {m.dropout}"),
        (m.moe_experts >= 0 and m.moe_every >= 1 and m.moe_hidden >= 0,
         "model.moe_experts and model.moe_hidden must be >= 0, model.moe_every >= 1"),
        (not m.moe_experts or 1 <= m.moe_top_k <= m.moe_experts,
         f"model.moe_top_k={m.moe_top_k} must be between 1 and model.moe_experts={m.moe_experts}"),
        (m.moe_aux_loss_coef >= 0 and m.moe_z_loss_coef >= 0 and m.moe_bias_rate >= 0,
         "model.moe_aux_loss_coef, moe_z_loss_coef and moe_bias_rate must be >= 0"),
        (not m.moe_experts or not m.init_from,
         "model.init_from loads a dense GPT-2: it cannot start a mixture-of-experts model "
         "(model.moe_experts > 0)"),
        (d.block_size >= 1, f"data.block_size must be >= 1, got {d.block_size}"),
        (d.tokenizer in ("char", "gpt2"), f"data.tokenizer must be char or gpt2, got {d.tokenizer!r}"),
        (0.0 < d.val_fraction < 1.0, f"data.val_fraction must be in (0, 1), got {d.val_fraction}"),
        (not (cfg.mode == "train" and d.tokens_path and "data.val_fraction" in cfg.given),
         f"data.val_fraction={d.val_fraction} is not read with data.tokens_path: prepared tokens "
         "keep the split mode=prepare gave them (their index.json); to split otherwise, "
         "prepare them again into another data.tokens_path with it"),
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
    if optimizers.refusal(t):
        raise UserError(optimizers.refusal(t))
    check_keys(p)  # parallel/rules.py KEYS
    ft_config.check(cfg)  # fault_tolerance/config.py
    tensorboard.check(cfg)  # the optional package, before anything starts
    check_filesystems(cfg)
    if cfg.mode in ("sample", "export", "prepare", "plan", "dryrun", "plot", "lighthouse"):  # no layout
        return  # of this job to check (dryrun checks its world: planner/dryrun.py)
    cfg.sizes = check_layout(cfg, world_size)  # parallel/layout.py: the grid, every rule


# the package fsspec needs for a URL scheme (its own message says it less plainly); the
# optional ones of this project are in requirements-dev.txt
FILESYSTEM_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs",
                       "http": "aiohttp", "https": "aiohttp", "az": "adlfs", "abfs": "adlfs",
                       "abfss": "adlfs", "hf": "huggingface_hub"}


def check_filesystems(cfg: Config):
    """A path or URL whose fsspec filesystem cannot be imported here (s3:// without s3fs):
    one line naming the package to install, before anything starts, not an ImportError
    when the path is first opened."""
    import fsspec
    paths = [("data.path", cfg.data.path), ("data.tokens_path", cfg.data.tokens_path),
             ("trainer.run_dir", cfg.trainer.run_dir), ("trainer.snapshot_path", cfg.trainer.snapshot_path),
             ("model.init_from", cfg.model.init_from), ("export.path", cfg.export.path)]
    for key, path in paths:
        protocol = fsspec.core.split_protocol(path)[0] if path else None
        if protocol in (None, "file", "local"):
            continue
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as e:
            package = FILESYSTEM_PACKAGES.get(protocol)
            if package:
                raise missing_package(f"{key}={path}", package) from None
            raise UserError(f"{key}={path} needs fsspec's {protocol} filesystem, which cannot "
                            f"be imported here: {e}") from None
        except ValueError:  # no fsspec filesystem of that name: the path's own error says it
            continue


def resolved_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


# ---------------------------------------------------------------- the keys, described
# Every key's meaning is the comment on its field's line in its dataclass (continued on
# comment-only lines right below it): one place, read by `main.py --help` and by
# scripts/config_reference.py, which writes docs/configuration*.md.

@dataclass
class Key:
    name: str       # dotted: trainer.max_steps
    type: str       # int | float | bool | str | list[int]
    default: str    # as YAML writes it
    meaning: str    # one line


def describe_keys(cls=Config, prefix=""):
    """Every key of the schema, in the order of the dataclasses' fields."""
    meanings, hints = field_comments(cls), typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            keys += describe_keys(kind, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        keys.append(Key(prefix + f.name, _type_name(kind), _yaml_value(default),
                        meanings.get(f.name, "")))
    return keys


def describe_sections(cls=Config):
    """[(section, one line on it)]: the nested dataclasses of the schema."""
    meanings, hints = field_comments(cls), typing.get_type_hints(cls)
    return [(f.name, meanings.get(f.name, "")) for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(hints[f.name])]


def field_comments(cls) -> dict:
    """{field name: its comment}: the comment on the field's line, continued by the
    comment-only lines right below it."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {}  # line -> (text, whether the line holds nothing else)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(),
                                      tok.line.lstrip().startswith("#"))
    body = ast.parse(source).body[0].body
    found = {}
    for node, following in zip(body, body[1:] + [None]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        parts = [comments[n][0] for n in range(node.lineno, node.end_lineno + 1)
                 if n in comments and not comments[n][1]]
        line, stop = node.end_lineno + 1, following.lineno if following else float("inf")
        while line < stop and line in comments and comments[line][1]:
            parts.append(comments[line][0])
            line += 1
        found[node.target.id] = " ".join(p for p in parts if p)
    return found


def _type_name(kind) -> str:
    if typing.get_origin(kind) in (list, typing.List):
        return f"list[{_type_name(typing.get_args(kind)[0])}]"
    return getattr(kind, "__name__", str(kind))


def _yaml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, list)):
        return json.dumps(value)
    return repr(value)


def _typed(default: str) -> str:
    """A default as typed on the command line: mode=train, not mode="train"."""
    plain = default[1:-1] if default.startswith('"') else None
    return plain if plain and plain.replace("-", "").replace("_", "").replace("/", "").isalnum() \
        else default


def help_text() -> str:
    """What `python main.py --help` prints."""
    width = max(len(f"{k.name}={_typed(k.default)}") for k in describe_keys()) + 2
    lines = [
        "usage: python main.py [config=FILE] [key=value ...]             (one process)",
        "       torchrun --standalone --nproc_per_node=N main.py [key=value ...]",
        "",
        "The configuration is gpt2_train_cfg.yaml (or config=FILE, same schema), then each",
        "key=value on the command line (omegaconf dot-list). Unknown keys, wrong types and",
        "impossible layouts stop every rank with one line, `error on rank R: ...`, exit",
        "status 2. Under torchrun the ranks' lines are followed by torchrun's own report,",
        "about 50 lines: a traceback of its frames ending in ChildFailedError, then a summary",
        "whose \"Root Cause\" shows our line as the failed rank's traceback; torchrun exits 1.",
        "Ctrl-C: the step in progress ends, its snapshot is written, and one line says the",
        "step the same command resumes from (exit status 130; torchrun adds its warnings",
        "and a SignalException traceback, exit 1); a second Ctrl-C stops at once.",
        "Each, as printed: docs/stopping.md.",
        "",
        "modes (mode=...):",
        *[f"  {name:<9} {meaning}" for name, meaning in MODES.items()],
        "",
        "keys (key=default  meaning):",
    ]
    sections = dict(describe_sections())
    current = None
    for k in describe_keys():
        section = k.name.split(".")[0] if "." in k.name else None
        if section != current and section is not None:
            lines.append(f"  {section}: {sections[section]}")
            current = section
        lines.append(f"    {f'{k.name}={_typed(k.default)}':<{width}}{k.meaning}")
    lines += [
        "",
        "docs: README.md; every key with its type: docs/configuration.md; strategies and",
        "layouts: docs/parallelism.md; resume and snapshots: docs/checkpointing.md",
    ]
    return "\n".join(lines) + "\n"
