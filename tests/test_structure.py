"""The layering rules of parallel/README.md and issue 17, read from the source (no import,
no process): what a reviewer would otherwise check by grep.

- Only parallel/model_plan.py names GPT's modules (`transformer.h`, `wte`) in the code
  of parallel/ and bench/ (comments and docstrings may mention them).
- The root config.py names no strategy: layout rules live with their strategies.
- parallel/'s root shared files import no subfolder (only parallelize.py and layout.py
  wire the dimensions; rules.py reads the pipeline's schedules).
"""

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PARALLEL = os.path.join(REPO, "parallel")
GPT_NAMES = re.compile(r"transformer\.h\b|\bwte\b")
WIRING = {"__init__.py", "parallelize.py", "layout.py",  # may import the subfolders
          "rules.py"}  # the layout rules read the pipeline's schedules (SCHEDULES)


def python_files(*folders):
    for folder in folders:
        for root, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            yield from (os.path.join(root, f) for f in sorted(files) if f.endswith(".py"))


def code_without_docstrings(path):
    """The module's code as ast.unparse writes it: no comments, no docstrings."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def test_only_the_model_plan_names_gpt_modules():
    plan = os.path.join(PARALLEL, "model_plan.py")
    found = [f"{os.path.relpath(path, REPO)}: {line.strip()}"
             for path in python_files("parallel", "bench") if path != plan
             for line in code_without_docstrings(path).splitlines() if GPT_NAMES.search(line)]
    assert not found, "GPT's module names outside parallel/model_plan.py:\n" + "\n".join(found)


def strategy_names():
    """Every Strategy's registry key (`name = "..."` in data_parallel/ and reference/)."""
    names = set()
    for path in python_files("parallel/data_parallel", "parallel/reference"):
        with open(path) as f:
            for node in ast.walk(ast.parse(f.read())):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                        and isinstance(node.value.value, str) \
                        and any(isinstance(t, ast.Name) and t.id == "name" for t in node.targets):
                    names.add(node.value.value)
    return names


def test_root_config_names_no_strategy():
    names = strategy_names()
    assert {"single", "ddp_bucket", "fsdp", "torch_ddp"} <= names, names
    words = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names))) + r")\b")
    with open(os.path.join(REPO, "config.py")) as f:
        tree = ast.parse(f.read())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and ast.get_docstring(node, clean=False) is not None}
    found = sorted({node.value for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docstrings and words.search(node.value)})
    assert not found, f"config.py names strategies: {found}"


def test_root_shared_files_import_no_subfolder():
    subfolders = {d for d in os.listdir(PARALLEL)
                  if os.path.isfile(os.path.join(PARALLEL, d, "__init__.py"))}
    found = []
    for name in sorted(os.listdir(PARALLEL)):
        if not name.endswith(".py") or name in WIRING:
            continue
        with open(os.path.join(PARALLEL, name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for module in modules:
                parts = module.split(".")
                if len(parts) > 1 and parts[0] == "parallel" and parts[1] in subfolders:
                    found.append(f"parallel/{name}:{node.lineno} imports {module}")
    assert not found, "root shared files importing a dimension:\n" + "\n".join(sorted(set(found)))


def eager_marked():
    """(module, function) of every function marked `@eager_under_compile` in parallel/."""
    marked = []
    for path in python_files("parallel"):
        module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
        with open(path) as f:
            for node in ast.walk(ast.parse(f.read())):
                if isinstance(node, ast.FunctionDef) and any(
                        isinstance(d, ast.Name) and d.id == "eager_under_compile"
                        for d in node.decorator_list):
                    marked.append((module, node.name))
    return marked


def test_functions_run_eagerly_under_compile_are_never_imported_by_name():
    """parallel/compile.py replaces each `@eager_under_compile` function by its
    torch.compiler.disable form where it is defined, when compilation starts; a name
    imported before that (`from ops import copy_to_tp`) would keep the plain one, and
    dynamo would trace the collective into the graph. Callers go through the module."""
    marked = eager_marked()
    assert ("parallel.tensor_parallel.ops", "copy_to_tp") in marked, marked
    found = []
    for path in python_files("parallel", "bench", "tests"):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = {a.name for a in node.names}
                found += [f"{os.path.relpath(path, REPO)}:{node.lineno} imports {name} from {module}"
                          for module, name in marked if node.module == module and name in names]
    assert not found, "\n".join(found)
