"""The package's layering, read from its source: no import cycles, no function-level imports of its
own modules, and every import pointing down the layers (``docs/layout.md``).

Layers, bottom up: the base modules (validate, sharding, logs, plots), models, data, diffusion,
train, evals, io, perf, cli; no command imports another command. A layer imports only the layers its row allows below; evals never import
train, and train never imports evals (the trainer is handed its evaluators).
"""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "decay_jax")
OWN = ("decay_jax", "research")
BASE = {"validate", "sharding", "logs", "plots", "paths", "__init__"}
# layer -> the layers (besides the base modules and itself) it may import
ALLOWED = {
    "base": set(),
    "models": set(),
    "data": {"models"},
    "diffusion": {"models"},
    "train": {"models", "data", "diffusion"},
    "evals": {"models", "data", "diffusion"},
    "io": {"models", "train"},
    "perf": {"models", "data", "diffusion", "train"},
    "cli": {"models", "data", "diffusion", "train", "evals", "io", "perf"},
}


def _modules():
  """``{dotted name: path}`` of every module of the package (packages as their ``__init__``)."""
  out = {}
  for root, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(root, f), REPO)[:-3].replace(os.sep, ".")
        out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(root, f)
  return out


MODULES = _modules()


def _resolve(name: str):
  """The package module an import of ``name`` loads (a submodule, or the nearest package)."""
  while name and name not in MODULES:
    name = name.rpartition(".")[0]
  return name or None


def _imports(path: str):
  """``[(target module, lineno, at module level)]`` of the package's own imports in ``path``."""
  tree = ast.parse(open(path).read(), path)
  top = {id(n) for n in tree.body}
  out = []
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [f"{node.module}.{a.name}" for a in node.names] or [node.module]
    for n in names:
      if n.split(".")[0] in OWN:
        out.append((n, node.lineno, id(node) in top))
  return out


ALIASES = {"main", "convert", "evaluate", "sample"}  # decay_jax.main etc.: command aliases, layer cli


def _layer(module: str) -> str:
  parts = module.split(".")
  if len(parts) == 2 and parts[1] in ALIASES:
    return "cli"
  if len(parts) == 1 or parts[1] in BASE:
    return "base"
  return parts[1]


GRAPH = {m: {} for m in MODULES}
FUNCTION_LEVEL = []
for _m, _path in MODULES.items():
  for _name, _line, _top in _imports(_path):
    if _name.startswith("research"):
      GRAPH[_m][_name] = _line
      continue
    target = _resolve(_name)
    if not _top:
      FUNCTION_LEVEL.append(f"{os.path.relpath(_path, REPO)}:{_line} imports {_name} in a function")
    if target and target != _m:
      GRAPH[_m][target] = _line


def test_layers_are_known():
  assert {_layer(m) for m in MODULES} <= set(ALLOWED), sorted({_layer(m) for m in MODULES})
  assert len(MODULES) > 40  # the walk found the package
  assert sum(map(len, GRAPH.values())) > 100  # and its imports


def test_no_function_level_imports_of_own_modules():
  assert not FUNCTION_LEVEL, "\n".join(FUNCTION_LEVEL)


def test_the_package_never_imports_research():
  bad = [f"{m} imports {t}" for m, ts in GRAPH.items() for t in ts if t.startswith("research")]
  assert not bad, bad


def test_no_import_cycles():
  """Depth-first search over module-level imports; reports the first cycle as a path."""
  state, stack = {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for t in GRAPH[m]:
      if t not in GRAPH:
        continue
      if state.get(t) == "open":
        return stack[stack.index(t):] + [t]
      if t not in state and (cycle := visit(t)):
        return cycle
    stack.pop()
    state[m] = "done"
    return None

  for m in sorted(GRAPH):
    if m not in state and (cycle := visit(m)):
      pytest.fail("import cycle: " + " -> ".join(cycle))


def test_imports_point_down_the_layers():
  bad = []
  for m, targets in GRAPH.items():
    lm = _layer(m)
    for t, line in targets.items():
      lt = _layer(t) if not t.startswith("research") else "research"
      if lt not in ("base", lm) and lt not in ALLOWED[lm]:
        bad.append(f"{MODULES[m][len(REPO) + 1:]}:{line}: {lm} imports {lt} ({t})")
  assert not bad, "\n".join(bad)


def test_the_package_root_imports_nothing():
  """``import decay_jax`` is free: no submodule, no environment change (see test_packaging)."""
  assert GRAPH["decay_jax"] == {}


def test_no_command_imports_another_command():
  """``cli`` modules share code through the layers below, never through each other (``cli.errors``,
  the one-line error wrapper every command uses, is the exception)."""
  bad = [f"{m} imports {t}" for m, ts in GRAPH.items() if _layer(m) == "cli"
         for t in ts if _layer(t) == "cli" and t != "decay_jax.cli.errors"
         and not (m.count(".") == 1 and m.split(".")[1] in ALIASES)]
  assert not bad, bad


@pytest.mark.parametrize("alias, flag", [("main", "--workdir"), ("evaluate", "--checkpoint"),
                                         ("sample", "--num")])
def test_old_command_names_list_their_flags(alias, flag):
  """``python -m decay_jax.ALIAS --help`` shows the flags of the command it stands for."""
  import subprocess
  import sys
  out = subprocess.run([sys.executable, "-m", f"decay_jax.{alias}", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  # absl's --help exits with status 1 after printing the flags
  assert f"{flag}:" in out.stdout, (out.returncode, out.stdout[:2000], out.stderr[-2000:])


def test_files_do_one_job_in_at_most_600_lines():
  long = {os.path.relpath(p, REPO): n for p in MODULES.values()
          if (n := sum(1 for _ in open(p))) > 600}
  assert not long, long


def test_code_asks_the_task_object_not_its_name():
  """Tasks are registered by name in ``train/tasks/__init__.py`` and models by task name in
  ``models/factory.py``'s table; nothing else branches on ``config.task``'s value."""
  import re
  branch = re.compile(r"\btask\s*(==|!=)|\btask\s+(not\s+)?in\s*[(\[{]")
  bad = [f"{os.path.relpath(p, REPO)}:{i}: {line.strip()}" for p in MODULES.values()
         for i, line in enumerate(open(p), 1) if branch.search(line.split("#")[0])]
  assert not bad, "\n".join(bad)


# The residual spec's protocol: only models/stack.py (and the spec itself) calls these.
PROTOCOL = {"read", "branch_input", "branch", "add", "shortcut", "scale_branch", "scaled_init",
            "inject", "coefficients", "hyper_weights", "at_depth", "drop_path_rates",
            "expand", "reduce"}
SPEC_NAMES = {"res", "residual", "spec", "block_residual"}


def _is_spec(node) -> bool:
  """Whether an expression reads as a residual spec: ``res``, ``self.residual``,
  ``m.block_residual``, ``Residual(...)``."""
  if isinstance(node, ast.Name):
    return node.id in SPEC_NAMES
  if isinstance(node, ast.Attribute):
    return node.attr in SPEC_NAMES
  if isinstance(node, ast.Call):
    f = node.func
    return (isinstance(f, ast.Name) and f.id == "Residual") or (
        isinstance(f, ast.Attribute) and f.attr == "Residual")
  return False


def test_only_the_stack_calls_the_residual_protocol():
  """Blocks and models go through ``models/stack.py`` (``sublayer``, ``create``, ``inputs`` ...);
  a residual form then changes the spec, not every block (docs/layout.md)."""
  allowed = {"decay_jax.models.stack", "decay_jax.models.residual"}
  bad = []
  for name, path in MODULES.items():
    if name in allowed:
      continue
    for node in ast.walk(ast.parse(open(path).read(), path)):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr in PROTOCOL and _is_spec(node.func.value)):
        bad.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: .{node.func.attr}(")
  assert not bad, "\n".join(bad)


def test_the_protocol_check_sees_a_block_calling_the_spec():
  """The check above is not vacuous: it finds the calls blocks used to make."""
  src = "x = res.add(x, a, h)\ny = self.residual.expand(t)\nz = Residual(drop_path=0.1).drop_path_rates(4)\n"
  found = [n.func.attr for n in ast.walk(ast.parse(src))
           if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
           and n.func.attr in PROTOCOL and _is_spec(n.func.value)]
  assert found == ["add", "expand", "drop_path_rates"]


# ----- the task is the only registration -------------------------------------------------------
TASKS_DIR = os.path.join(PACKAGE, "train", "tasks")
# Checkpoint formats of upstream code ('mae', 'sit', 'repa', 'mae-upstream'), not task names.
CONVERTERS = ("decay_jax/io/", "decay_jax/cli/convert")


def _task_names():
  """The ``name = '...'`` of the task classes in ``train/tasks/`` (read from the source)."""
  names = set()
  for f in os.listdir(TASKS_DIR):
    if f.endswith(".py"):
      for node in ast.walk(ast.parse(open(os.path.join(TASKS_DIR, f)).read())):
        if isinstance(node, ast.ClassDef):
          for stmt in node.body:
            if (isinstance(stmt, ast.Assign) and [getattr(t, "id", "") for t in stmt.targets]
                == ["name"] and isinstance(stmt.value, ast.Constant) and stmt.value.value):
              names.add(stmt.value.value)
  return names


def _task_tables(tree, names):
  """``[(lineno, what)]``: dicts keyed by two or more task names, tuples/lists/sets of two or more,
  and comparisons of something named ``task`` with a task name."""
  def strings(node):
    return {e.value for e in getattr(node, "elts", ())
            if isinstance(e, ast.Constant) and isinstance(e.value, str)}
  out = []
  for n in ast.walk(tree):
    if isinstance(n, ast.Dict):
      keys = {k.value for k in n.keys if isinstance(k, ast.Constant)}
      if len(names & keys) >= 2:
        out.append((n.lineno, "a table keyed by task names"))
    elif isinstance(n, (ast.Tuple, ast.List, ast.Set)) and len(names & strings(n)) >= 2:
      out.append((n.lineno, "a list of task names"))
    elif isinstance(n, ast.Compare):
      parts = [n.left] + n.comparators
      consts = {c.value for c in parts if isinstance(c, ast.Constant)}.union(*map(strings, parts))
      if names & consts and "task" in ast.unparse(n):
        out.append((n.lineno, f"a comparison with a task name: {ast.unparse(n)}"))
  return out


def test_no_task_name_tables_or_comparisons_outside_the_tasks():
  """A task is registered once, by its class in ``train/tasks/``; everything else asks the task
  object (its builder, defaults, evaluators, samplers), so a new task is one file."""
  names = _task_names()
  assert names == {"mae", "sit", "finetune", "uvit"}
  bad = []
  for path in MODULES.values():
    rel = os.path.relpath(path, REPO)
    if rel.startswith(os.path.relpath(TASKS_DIR, REPO)) or rel.startswith(CONVERTERS):
      continue
    bad += [f"{rel}:{line}: {what}" for line, what in
            _task_tables(ast.parse(open(path).read(), path), names)]
  assert not bad, "\n".join(bad)


def test_the_task_table_check_sees_the_old_tables():
  """Not vacuous: the tables and comparisons the registration replaced are found."""
  src = ('BUILDERS = {"mae": _mae, "sit": _sit}\nflags.DEFINE_enum("task", "mae", ["mae", "sit"])\n'
         'if task_name == "uvit":\n  pass\nok = protocol == "mae"\n')
  found = _task_tables(ast.parse(src), _task_names())
  assert sorted(line for line, _ in found) == [1, 2, 3]


# ----- model classes are asked about in models/ (and by the converters in io/) ---------------------
# What is left to move (issue 60): the evaluation workbench picks by class which evaluators a
# converted SiT or U-ViT can run (its probe views); REPA picks its target encoder's preprocessing
# by class (DINOv2 or MAE, with data-layer normalisation models/ cannot import); the SiT probe's
# interceptor recognises the routed block it reads.
ISINSTANCE_LEFT = {"decay_jax/evals/workbench.py": 3, "decay_jax/train/repa.py": 2,
                   "decay_jax/evals/sit_probe.py": 1}


def _model_class_checks(tree):
  """Line numbers of ``isinstance(x, C)`` where ``C`` (or one of a tuple) is a class of
  ``decay_jax.models``: ``mae_lib.MaskedAutoencoder`` through a module alias, or imported."""
  modules, classes = set(), set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module == "decay_jax.models":
      modules |= {a.asname or a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("decay_jax.models."):
      classes |= {a.asname or a.name for a in node.names if a.name[:1].isupper()}

  def is_model_class(e):
    return ((isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name)
             and e.value.id in modules) or (isinstance(e, ast.Name) and e.id in classes))
  out = []
  for node in ast.walk(tree):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance" and len(node.args) == 2):
      kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
      if any(is_model_class(k) for k in kinds):
        out.append(node.lineno)
  return out


def test_model_classes_are_asked_about_only_in_models_and_the_converters():
  """A model answers what others asked of its class (``block_slot``, the task's ``model_class``,
  ``inception.check_loaded``), so a new model or task does not touch evaluators and commands."""
  found = {}
  for path in MODULES.values():
    rel = os.path.relpath(path, REPO)
    if rel.startswith(("decay_jax/models/",) + CONVERTERS):
      continue
    lines = _model_class_checks(ast.parse(open(path).read(), path))
    if lines:
      found[rel] = len(lines)
  assert found == ISINSTANCE_LEFT


def test_the_model_class_check_sees_the_old_dispatch():
  src = ("from decay_jax.models import mae as mae_lib\nfrom decay_jax.models.sit import SiT\n"
         "if isinstance(model, mae_lib.MaskedAutoencoder): pass\n"
         "if isinstance(model, (SiT, int)): pass\nif isinstance(model, cls): pass\n")
  assert _model_class_checks(ast.parse(src)) == [3, 4]
