"""The layering rules of parallel/README.md and issue 17, read from the source (no import,
no process): what a reviewer would otherwise check by grep.

- Only parallel/model_plan.py names GPT's modules (`transformer.h`, `wte`) in the code
  of parallel/ and bench/ (comments and docstrings may mention them).
- The root config.py names no strategy: layout rules live in parallel/rules.py.
- Configuration is a leaf (issue 43): config.py, every config dataclass's module and
  planner/ import, transitively, no module that trains (`TRAINS`), and the planner never
  imports the trainer.
- parallel/'s root shared files import no subfolder (only parallelize.py and layout.py
  wire the dimensions; rules.py reads the pipeline's schedules).
"""

import ast
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PARALLEL = os.path.join(REPO, "parallel")
GPT_NAMES = re.compile(r"transformer\.h\b|\bwte\b")
WIRING = {"__init__.py", "parallelize.py", "layout.py", "facts.py",  # may import subfolders
          "rules.py"}  # the layout rules and their facts read the schedules (SCHEDULES)


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


# ---------------------------------------------------------------- configuration is a leaf
# A module "trains" when it builds or runs a training step: the loop, the recipe that
# parallelizes the model, the strategies and the dimensions' layers, the replica groups,
# and PyTorch's distributed training wrappers and optimizers. A package's `config` module
# never trains (it is a config dataclass's, checked below). Prefixes: a package and all
# it holds.
TRAINS = ("trainer", "training",                                     # the loop and its step
          "parallel.parallelize", "parallel.strategy", "parallel.data_parallel",
          "parallel.reference", "parallel.tensor_parallel", "parallel.context_parallel",
          "parallel.pipeline_parallel.pipeline", "parallel.compile", "parallel.checkpointing",
          "parallel.precision",                                      # parallelize() and strategies
          "fault_tolerance.replica_group",                           # the replica groups
          "torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed.pipelining",
          "torch.distributed.tensor", "torch.optim", "torchft")      # PyTorch's, torchft
CONFIGS = ("config", "parallel.config", "planner.config", "fault_tolerance.config",
           "training.config", "model", "char_dataset", "data.prepare")  # each section's dataclass
LOOP = "trainer"  # the training loop itself


def trains(module):
    """Whether importing `module` runs training code of its own (a package of ours is
    judged by what its __init__.py imports, not by its name)."""
    path = module_file(module)
    if module.rsplit(".", 1)[-1] == "config" or (path and path.endswith("__init__.py")):
        return False
    return any(module == t or module.startswith(t + ".") for t in TRAINS)


def module_file(module):
    """The checkout's file of a dotted module name, or None (not ours)."""
    base = os.path.join(REPO, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def imports_of(module, lazy=False):
    """The modules `module` imports when it is imported (lazy: also inside functions),
    parent packages included."""
    path = module_file(module)
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found, stack = set(), list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and not lazy:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if module_file(f"{base}.{a.name}"))
        stack.extend(ast.iter_child_nodes(node))
    with_parents = set()
    for name in found:
        parts = name.split(".")
        with_parents.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return with_parents


def import_chains(start, lazy=False, stop=()):
    """{module: the chain of imports from `start` that reaches it}: what importing `start`
    imports (ours followed, others' as named), not following `stop`."""
    chains, todo = {start: [start]}, [start]
    while todo:
        module = todo.pop()
        if module in stop or not module_file(module):
            continue
        for name in sorted(imports_of(module, lazy)):
            if name not in chains:
                chains[name] = chains[module] + [name]
                todo.append(name)
    return chains


def planner_modules():
    return sorted("planner." + f[:-3] for f in os.listdir(os.path.join(REPO, "planner"))
                  if f.endswith(".py") and f != "__init__.py")


@pytest.mark.parametrize("start", CONFIGS + ("planner",))
def test_configuration_imports_nothing_that_trains(start):
    starts = planner_modules() if start == "planner" else [start]
    if not module_file(starts[0]):
        pytest.skip(f"no {starts[0]} in this checkout")
    found = {" -> ".join(chain) for s in starts
             for module, chain in import_chains(s).items() if trains(module)}
    assert not found, "imports of a module that trains:\n" + "\n".join(sorted(found))


def test_config_does_not_import_the_trainer():
    chains = import_chains("config")
    assert LOOP not in chains, " -> ".join(chains.get(LOOP, []))


def test_the_planner_never_imports_the_trainer():
    """Not even inside a function: the dry run reaches the step through training's own
    narrow function, not through the loop."""
    found = [" -> ".join(chain) for s in planner_modules()
             for module, chain in import_chains(s, lazy=True).items() if module == LOOP]
    assert not found, "\n".join(found)
