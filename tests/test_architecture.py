"""The package's import structure, read from its source: no cycles, one owner per name.

* No import cycle inside ``muonclip_jax``, counting imports inside functions too (a lazy
  import hides a cycle from Python, not from a reader).
* A module imports a name only from the module that defines it (no re-export chains), and
  never an underscored name from a sibling, neither by name nor as an attribute of an
  imported module (``from . import _m`` then ``_m._helper``). Package ``__init__`` files
  re-export the public API and are exempt.
"""

from __future__ import annotations

import ast
import pathlib

import muonclip_jax

ROOT = pathlib.Path(muonclip_jax.__file__).parent
PACKAGE = "muonclip_jax"


def _modules() -> dict[str, pathlib.Path]:
  mods = {}
  for p in sorted(ROOT.rglob("*.py")):
    parts = (PACKAGE,) + p.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    mods[".".join(parts)] = p
  return mods


MODULES = _modules()


def _defined(tree: ast.Module) -> set[str]:
  """Names bound at a module's top level by def, class or assignment (not by import)."""
  names = set()
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.Assign):
      names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      names.add(node.target.id)
    elif isinstance(node, ast.If):  # e.g. `if TYPE_CHECKING:` or version switches
      names |= _defined(ast.Module(body=node.body + node.orelse, type_ignores=[]))
  return names


def _imports(name: str, path: pathlib.Path):
  """``(target module, imported name or None, line, local name)`` for every package-internal
  import; the imported name is None where a whole module is imported."""
  tree = ast.parse(path.read_text())
  package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
      else:
        target = node.module or ""
      if target != PACKAGE and not target.startswith(PACKAGE + "."):
        continue
      for alias in node.names:
        sub = f"{target}.{alias.name}"
        if sub in MODULES:
          yield sub, None, node.lineno, alias.asname or alias.name
        else:
          yield target, alias.name, node.lineno, alias.asname or alias.name
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith(PACKAGE):
          yield alias.name, None, node.lineno, alias.asname or alias.name


def _private_attributes(name: str, path: pathlib.Path):
  """``(module, attribute, line)`` for every underscored ``alias._name`` read through a module
  imported whole (``from . import _m`` / ``import muonclip_jax._m as m``)."""
  aliases = {local: target for target, imported, _, local in _imports(name, path) if imported is None}
  for node in ast.walk(ast.parse(path.read_text())):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
        and node.attr.startswith("_") and not node.attr.startswith("__")):
      yield aliases[node.value.id], node.attr, node.lineno


def test_the_reader_sees_the_package():
  assert {"muonclip_jax._muon", "muonclip_jax.nn._attention", "muonclip_jax.nn"} <= set(MODULES)
  edges = [e for n, p in MODULES.items() for e in _imports(n, p)]
  assert len(edges) > 100


def test_no_import_cycle():
  graph = {n: sorted({t for t, _, _, _ in _imports(n, p) if t != n}) for n, p in MODULES.items()}
  # A package's __init__ imports its children by design; a child importing its package's
  # __init__ (a name re-exported there) would close a cycle, and is caught below.
  state: dict[str, int] = {}
  stack: list[str] = []
  cycles = []

  def visit(n: str) -> None:
    state[n] = 1
    stack.append(n)
    for t in graph.get(n, ()):
      if state.get(t) == 1:
        cycles.append(stack[stack.index(t):] + [t])
      elif t not in state:
        visit(t)
    stack.pop()
    state[n] = 2

  for n in graph:
    if n not in state:
      visit(n)
  assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_names_are_imported_from_their_owner():
  defined = {n: _defined(ast.parse(p.read_text())) for n, p in MODULES.items()}
  problems = []
  for n, p in MODULES.items():
    if p.name == "__init__.py":
      continue
    for target, imported, line, _ in _imports(n, p):
      if imported is None:
        continue
      where = f"{p.relative_to(ROOT.parent)}:{line}: from {target} import {imported}"
      if target not in MODULES:
        problems.append(f"{where} (no such module)")
      elif imported.startswith("_"):
        problems.append(f"{where} (an underscored name of a sibling)")
      elif imported not in defined[target]:
        problems.append(f"{where} (not defined there: import it from its owner)")
    for target, attribute, line in _private_attributes(n, p):
      if target != n:
        problems.append(f"{p.relative_to(ROOT.parent)}:{line}: {target}.{attribute} (an underscored name of a sibling)")
  assert not problems, "\n".join(problems)


def test_the_reader_catches_a_private_name_read_through_a_module(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("from . import _newton_schulz as nsm\nfrom muonclip_jax import _paths\n"
                 "x = nsm._poly\ny = _paths.join\nz = nsm.__name__\n")
  found = list(_private_attributes("muonclip_jax._bad", bad))
  assert found == [("muonclip_jax._newton_schulz", "_poly", 3)], found
