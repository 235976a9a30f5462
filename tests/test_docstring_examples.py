"""Every public function and class has an ``Example:`` block in its docstring, and it runs.

The public names are those exported by ``muonclip_jax`` and ``muonclip_jax.nn``, and the
``__all__`` of the public submodules ``muonclip_jax.sharding`` and ``muonclip_jax.training``.
Constants (non-callables) have no docstring of their own and are exempt. The examples run
under ``doctest`` (ELLIPSIS, NORMALIZE_WHITESPACE) with empty globals, so each is
self-contained: it imports what it uses, as a reader would copy it.
"""

from __future__ import annotations

import doctest
import types

import pytest

import muonclip_jax as mc
import muonclip_jax.nn as mcnn
from muonclip_jax import sharding, training
from _gemma_package import import_gemma


def _public() -> dict[str, object]:
  found: dict[str, object] = {}
  for module in (mc, mcnn):
    for name in dir(module):
      obj = getattr(module, name)
      if name.startswith("_") or isinstance(obj, types.ModuleType) or not callable(obj):
        continue
      found.setdefault(f"{module.__name__}.{name}", obj)
  for module in (sharding, training):
    for name in module.__all__:
      if not callable(getattr(module, name)):
        continue
      found.setdefault(f"{module.__name__}.{name}", getattr(module, name))
  seen, unique = set(), {}
  for name, obj in found.items():
    if id(obj) not in seen:
      seen.add(id(obj))
      unique[name] = obj
  return unique


PUBLIC = _public()


def test_the_public_names_are_found():
  assert {"muonclip_jax.muonclip", "muonclip_jax.qk_clip", "muonclip_jax.nn.attention",
          "muonclip_jax.sharding.param_shardings", "muonclip_jax.training.make_train_step"} <= set(PUBLIC)


# What a reader of an example has installed: the gemma package, whose kauldron dependency the
# tests stand in for where it is absent (tests/_gemma_package.py).
_SETUP = {"muonclip_jax.nn.capture_gemma": import_gemma}


def _tunix():
  """Tunix is installed in both suites (Makefile): it must import."""
  import tunix  # noqa: F401


_SETUP.update(dict.fromkeys(
    ["muonclip_jax.nn.capture_tunix", "muonclip_jax.nn.tunix_layout", "muonclip_jax.nn.capture_tunix_trainer"], _tunix))


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_example_runs(name):
  obj = PUBLIC[name]
  _SETUP.get(name, lambda: None)()
  doc = obj.__doc__ or ""
  assert "Example:" in doc and ">>>" in doc.split("Example:", 1)[1], f"{name}: no `Example:` block with `>>>` lines"
  finder = doctest.DocTestFinder(recurse=False)
  tests = [t for t in finder.find(obj, name, globs={}) if t.examples]
  assert tests, f"{name}: doctest found no examples"
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  out: list[str] = []
  for t in tests:
    runner.run(t, out=out.append)
  result = runner.summarize(verbose=False)
  assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} example lines failed\n" + "".join(out)
