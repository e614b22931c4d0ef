"""The documentation, checked against the code it describes (in process, seconds).

- docs/configuration.md is generated from the config schema (scripts/config_reference.py):
  every key has a line of meaning in its dataclass, and the committed page is the
  generator's output, so it cannot go stale.
"""

import os

from omegaconf import OmegaConf

import config
from harness import REPO
from scripts import config_reference


def test_every_config_key_has_a_meaning_in_its_dataclass():
    keys = config.describe_keys()
    missing = [k.name for k in keys if not k.meaning]
    assert len(keys) > 60 and not missing, f"keys without a comment on their field: {missing}"
    assert all(meaning for _, meaning in config.describe_sections())


def test_configuration_reference_is_the_generated_one():
    with open(os.path.join(REPO, "docs", "configuration.md")) as f:
        committed = f.read()
    assert committed == config_reference.markdown(), \
        "docs/configuration.md is stale: python -m scripts.config_reference > docs/configuration.md"


def test_default_yaml_sets_every_key_to_the_schemas_default():
    """`--help` and docs/configuration.md show the schema's defaults: they must be the ones
    gpt2_train_cfg.yaml gives a run."""
    yaml = OmegaConf.to_container(OmegaConf.load(config.DEFAULT_YAML))
    wrong = []
    for key in config.describe_keys():
        if key.name == "config":  # the command line's config=FILE, not a YAML key
            continue
        value = yaml
        for part in key.name.split("."):
            value = value.get(part, KeyError) if isinstance(value, dict) else KeyError
        if value is KeyError or config._yaml_value(value) != key.default:
            wrong.append(f"{key.name}: yaml {value!r}, schema {key.default}")
    assert not wrong, wrong
