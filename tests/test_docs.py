"""The documentation, checked against the code it describes (seconds; the quick commands
run for real).

- docs/configuration*.md are generated from the config schema (scripts/config_reference.py):
  every key has a line of meaning in its dataclass, and the committed page is the
  generator's output, so it cannot go stale; so is docs/layout-rules.md, from the rules'
  table (scripts/layout_rules.py).
- Every `key=value` in a command or code span of the docs names a real key, with a value
  of its type (and a real mode); every relative link and #anchor resolves; the quick
  commands (`mode=plan`) run; each page keeps its size; CI runs the README's
  test command exactly.
"""

import glob
import os
import re
import shlex

import pytest
from omegaconf import OmegaConf

import config
from harness import REPO
from scripts import config_reference, layout_rules

PAGES = ["README.md", "tests/README.md", "bench/README.md", "configs/README.md",
         "scripts/README.md", "parallel/README.md"] + sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
LIMITS = {"README.md": 14_000, "tests/README.md": 10_000, "bench/README.md": 10_000}
DOCS_LIMIT = 16_000  # each docs/*.md page

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# section.key=value (or mode= / config=), not part of a longer word, a path or an option
ASSIGNMENT = re.compile(r"(?<![\w./$-])((?:[a-z_][a-z0-9_]*\.)+[a-z_][a-z0-9_]*|mode|config)"
                        r"=(\[[^\]\s]*\]|'[^']*'|\"[^\"]*\"|[^\s`'\",)]*)")
PLACEHOLDER = re.compile(r"<|\.\.\.|\$|\{|^[A-Z][A-Z_]*$|^[A-Z]\d*$")


def read(page):
    with open(os.path.join(REPO, page)) as f:
        return f.read()


def code_of(text):
    """(line number, code) of every fenced block's lines (a trailing backslash joins the
    next line) and every inline code span outside them."""
    found = []
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start()) + 1
        lines = block.group(0).splitlines()[1:-1]
        joined, start = "", None
        for n, line in enumerate(lines, first + 1):
            start = start or n
            joined += line.rstrip("\\") + " "
            if not line.endswith("\\"):
                found.append((start, joined.strip()))
                joined, start = "", None
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for n, line in enumerate(prose.splitlines(), 1):
        found += [(n, span) for span in SPAN.findall(line)]
    return found


def key_errors(page):
    keys = {k.name for k in config.describe_keys()}
    schema = OmegaConf.structured(config.Config)
    errors = []
    for n, code in code_of(read(page)):
        for key, value in ASSIGNMENT.findall(code):
            where = f"{page}:{n}: {key}={value}"
            if key not in keys:
                errors.append(f"{where}: no such key")
                continue
            plain = value.strip("'\"")
            if not plain or PLACEHOLDER.search(plain):
                continue
            if key == "mode" and plain not in config.MODES:
                errors.append(f"{where}: no such mode (one of {', '.join(config.MODES)})")
            try:
                OmegaConf.merge(schema, config._parse_overrides(schema, [f"{key}={plain}"]))
            except Exception as e:
                errors.append(f"{where}: {str(e).splitlines()[0]}")
    return errors


def slug(heading):
    """GitHub's anchor of a heading: its text lowercased, punctuation dropped, spaces to -."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page):
    seen, out = {}, set()
    for line in FENCE.sub("", read(page)).splitlines():
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            out.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return out


def link_errors(page):
    errors = []
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), read(page))
    for n, line in enumerate(prose.splitlines(), 1):
        for target in LINK.findall(SPAN.sub("", line)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(REPO, resolved)):
                errors.append(f"{page}:{n}: ({target}): {resolved} does not exist")
            elif anchor and (not resolved.endswith(".md") or anchor not in anchors(resolved)):
                errors.append(f"{page}:{n}: ({target}): no heading #{anchor} in {resolved}")
    return errors


@pytest.mark.parametrize("page", PAGES)
def test_every_key_in_the_docs_commands_is_a_real_key(page):
    errors = key_errors(page)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_and_anchor_resolves(page):
    errors = link_errors(page)
    assert not errors, "\n".join(errors)


def test_pages_keep_their_size():
    over = [f"{page}: {len(read(page).encode())} bytes > {limit}" for page, limit in
            list(LIMITS.items()) + [(p, DOCS_LIMIT) for p in PAGES if p.startswith("docs/")]
            if len(read(page).encode()) > limit]
    assert len([p for p in PAGES if p.startswith("docs/")]) >= 6 and not over, over


def test_ci_runs_the_readme_test_command_and_the_readme_opens_with_both_commands():
    """The first installs what training needs (requirements.txt), the second what the tests
    need besides (requirements-dev.txt, which includes the first)."""
    readme = read("README.md")
    first = FENCE.search(readme).group(0).splitlines()[1:-1]
    assert first == ["pip install -r requirements.txt && torchrun --standalone --nproc_per_node=2 main.py",
                     "pip install -r requirements-dev.txt && python -m pytest -q"]
    ci = [ln for ln in read(".ci/run").splitlines() if ln and not ln.startswith(("#", "set ", "cd "))]
    assert ci == [first[1]]


def quick_commands():
    """Every `python main.py mode=plan ...` of the docs (`--help`: tests/test_cli.py)."""
    found = {}
    for page in PAGES:
        for n, code in code_of(read(page)):
            for cmd in re.split(r"\s*(?:&&|;|\|)\s*", re.sub(r"\s+#.*$", "", code)):
                words = cmd.split()
                if words[:2] == ["python", "main.py"] and "mode=plan" in words \
                        and not PLACEHOLDER.search(cmd.replace("main.py", "")):
                    found.setdefault(cmd, f"{page}:{n}")
    return sorted(found.items())


def test_the_docs_quick_commands_run(tmp_path, monkeypatch, capsys):
    """Each through main.main in this process (no process group: mode=plan needs none),
    from the repository root as the docs say, plan.out redirected here."""
    import main
    commands = quick_commands()
    assert commands, "no mode=plan command found in the docs"
    monkeypatch.chdir(REPO)
    for cmd, where in commands:
        args = [re.sub(r"^plan\.out=.*", f"plan.out={tmp_path / 'plan.json'}", a)
                for a in shlex.split(cmd)[2:]]
        main.main(args, 0, 1, 0)  # raises on failure (a UserError names the bad input)
        # a search ends with the command to run; plan.search=false prints its one layout
        done = "layout: " if "plan.search=false" in args else "run the first:"
        assert done in capsys.readouterr().out, f"{where}: {cmd}"


def test_every_config_key_has_a_meaning_in_its_dataclass():
    keys = config.describe_keys()
    missing = [k.name for k in keys if not k.meaning]
    assert len(keys) > 60 and not missing, f"keys without a comment on their field: {missing}"
    assert all(meaning for _, meaning in config.describe_sections())


def test_configuration_reference_is_the_generated_one():
    for path, text in config_reference.pages().items():
        assert read(path) == text, f"{path} is stale: python -m scripts.config_reference"


def test_layout_rules_page_is_the_generated_one():
    """docs/layout-rules.md and its summary in docs/parallelism.md show every rule of
    parallel/rules.py's tables as the code holds it."""
    from parallel import rules
    stale = "is stale: python -m scripts.layout_rules"
    assert read(layout_rules.PAGE) == layout_rules.markdown(), f"{layout_rules.PAGE} {stale}"
    assert layout_rules.section(read(layout_rules.SUMMARY_IN)) == layout_rules.summary(), \
        f"{layout_rules.SUMMARY_IN} {stale}"
    shown = sum(len(rows) for *_, rows in layout_rules.read_tables())
    assert shown == len(rules.KEYS + rules.GRID + rules.LAYOUT), "a rule outside the tables' rows"


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


def test_the_readmes_error_example_is_what_the_config_check_says():
    """README quotes the one-line error of a batch that does not divide over 3 ranks: it
    must be the message load_config gives, word for word."""
    from errors import UserError
    quoted = re.search(r"`error on rank 1: (trainer\.batch_size=10 .*?)`", read("README.md"), re.S)
    assert quoted, "README no longer quotes the batch-size error"
    with pytest.raises(UserError) as e:
        config.load_config(["trainer.batch_size=10"], 3)
    assert " ".join(quoted.group(1).split()) == str(e.value)
