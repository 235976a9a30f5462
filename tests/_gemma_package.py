"""The installed ``gemma`` package's ``_layers`` and ``_modules`` (its attention, blocks and norms).

``make test`` installs gemma without its dependencies (Makefile). Of them, gemma's attention
imports only kauldron, whose typing module imports tensorflow; where kauldron cannot be
imported, ``tests/_kauldron_standin`` provides the two names it uses.
"""

import os
import sys


def import_gemma():
  """``(gemma.gm.nn._layers, gemma.gm.nn._modules)``."""
  try:
    import kauldron.typing  # noqa: F401
  except ImportError:
    for name in [m for m in sys.modules if m == "kauldron" or m.startswith("kauldron.")]:
      del sys.modules[name]
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_kauldron_standin"))
  from gemma.gm.nn import _layers, _modules
  return _layers, _modules
