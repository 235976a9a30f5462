"""The package's import structure, read from its source: no cycles, one owner per name.

* No import cycle inside ``muonclip_jax``, counting imports inside functions too (a lazy
  import hides a cycle from Python, not from a reader).
* A module imports a name only from the module that defines it (no re-export chains), and
  never an underscored name from a sibling, neither by name nor as an attribute of an
  imported module (``from . import _m`` then ``_m._helper``). Package ``__init__`` files
  re-export the public API and are exempt.
* The private subsystems (``_util``, ``_orthogonalize``, ``_clip``, ``_muon``, ``_train``,
  ``nn._impl``, ``nn._capture``) are entered only through their ``__init__``: a module
  outside one imports from the subpackage (``from .._clip import GQALayout``), never from a
  module inside it (``from .._clip.layouts import GQALayout``); inside one, a module imports
  from the defining module, never through its own ``__init__``.
* The subsystems depend on each other in one direction only: ``_util`` on none,
  ``_orthogonalize`` and ``_clip`` on ``_util``, ``_muon`` on those three, ``_train`` on
  ``_util``, ``_clip`` and ``_muon``.
* No module is over 450 lines.
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
SUBSYSTEMS = ("_util", "_orthogonalize", "_clip", "_muon", "_train")
PRIVATE_PACKAGES = tuple(f"{PACKAGE}.{s}" for s in SUBSYSTEMS + ("nn._impl", "nn._capture"))
ALLOWED = {  # subsystem -> the subsystems it may import
    "_util": set(),
    "_orthogonalize": {"_util"},
    "_clip": {"_util"},
    "_muon": {"_util", "_orthogonalize", "_clip"},
    "_train": {"_util", "_clip", "_muon"},
}
MAX_LINES = 450


def _is_package(name: str) -> bool:
  return name in MODULES and MODULES[name].name == "__init__.py"


def _reexported(package: str) -> set[str]:
  """Names a package's ``__init__`` binds by ``from ... import`` (its re-exports)."""
  tree = ast.parse(MODULES[package].read_text())
  return {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}


def _private_package(name: str) -> str | None:
  """The private subsystem package that module ``name`` belongs to (itself for its ``__init__``)."""
  for pkg in PRIVATE_PACKAGES:
    if name == pkg or name.startswith(pkg + "."):
      return pkg
  return None


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
        # a package's __init__ may rebind a submodule's name to what it re-exports
        # (``_clip.qk_clip``, the function): then the import gets the name, as Python does
        if sub in MODULES and not (_is_package(target) and alias.name in _reexported(target)):
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
  assert {"muonclip_jax._muon", "muonclip_jax._muon.scale_by_muon", "muonclip_jax._clip.layouts",
          "muonclip_jax.nn._attention", "muonclip_jax.nn._impl.dense", "muonclip_jax.nn"} <= set(MODULES)
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
      elif target in PRIVATE_PACKAGES:  # through a subsystem's __init__: only from outside it
        if _private_package(n) == target:
          problems.append(f"{where} (inside its own subsystem: import it from the defining module)")
        elif imported not in _reexported(target):
          problems.append(f"{where} (not re-exported there)")
      elif imported not in defined[target]:
        problems.append(f"{where} (not defined there: import it from its owner)")
    for target, attribute, line in _private_attributes(n, p):
      if target != n:
        problems.append(f"{p.relative_to(ROOT.parent)}:{line}: {target}.{attribute} (an underscored name of a sibling)")
  assert not problems, "\n".join(problems)


def test_the_reader_catches_a_private_name_read_through_a_module(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("from . import presets as nsm\nfrom muonclip_jax._util import paths\n"
                 "x = nsm._PRESETS\ny = paths.join\nz = nsm.__name__\n")
  found = list(_private_attributes("muonclip_jax._orthogonalize._bad", bad))
  assert found == [("muonclip_jax._orthogonalize.presets", "_PRESETS", 3)], found


def test_subsystems_are_entered_through_their_init():
  problems = []
  for n, p in MODULES.items():
    for target, imported, line, _ in _imports(n, p):
      pkg = _private_package(target)
      if pkg is None or pkg == _private_package(n) or target == pkg:
        continue
      what = f"import {target}" if imported is None else f"from {target} import {imported}"
      problems.append(f"{p.relative_to(ROOT.parent)}:{line}: {what} (import it from {pkg})")
  assert not problems, "\n".join(problems)


def test_the_reader_catches_a_private_cross_import(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("from .._clip.layouts import GQALayout\nfrom .._clip import MLALayout\n")
  found = [(t, i) for t, i, _, _ in _imports("muonclip_jax._muon._bad", bad)
           if _private_package(t) and t != _private_package(t)]
  assert found == [("muonclip_jax._clip.layouts", "GQALayout")], found


def test_subsystems_depend_in_one_direction():
  edges: dict[str, set[str]] = {s: set() for s in SUBSYSTEMS}
  for n, p in MODULES.items():
    src = n.split(".")[1] if n.count(".") >= 1 else None
    if src not in edges:
      continue
    for target, _, _, _ in _imports(n, p):
      dst = target.split(".")[1] if target.count(".") >= 1 else None
      if dst in edges and dst != src:
        edges[src].add(dst)
  wrong = {s: sorted(d - ALLOWED[s]) for s, d in edges.items() if d - ALLOWED[s]}
  assert not wrong, f"subsystem imports outside the layering: {wrong}"
  # and the graph is acyclic (ALLOWED is, so this guards ALLOWED itself)
  order, seen = [], set()

  def visit(s: str, path: tuple[str, ...]) -> None:
    assert s not in path, f"subsystem cycle: {' -> '.join(path + (s,))}"
    if s in seen:
      return
    for d in sorted(ALLOWED[s] | edges[s]):
      visit(d, path + (s,))
    seen.add(s)
    order.append(s)

  for s in SUBSYSTEMS:
    visit(s, ())


def test_no_module_is_too_long():
  long = {str(p.relative_to(ROOT.parent)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines: {long}"
