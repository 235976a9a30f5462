"""A stand-in for the two kauldron names gemma's attention imports, for tests/test_gemma_package.py.

gemma (3.3.0, 4.0.1) imports ``kauldron.kd`` and kauldron's shape annotations; kauldron's
typing module imports tensorflow (about 2 GB with its dependencies), too much for CI. What
gemma's attention uses of it: ``kd.nn.Identity`` (a module returning its input, through which
gemma passes the attention probabilities) and the annotations ``Array``, ``Bool``, ``Int``
(``Int['B L']``), which check nothing at run time. This package provides exactly those, and is
put on ``sys.path`` only where the real kauldron cannot be imported.
"""

import types

import flax.linen as nn


class Identity(nn.Module):
  """kauldron's ``kd.nn.Identity``: returns its input."""

  @nn.compact
  def __call__(self, inputs, *args, **kwargs):
    return inputs


kd = types.SimpleNamespace(nn=types.SimpleNamespace(Identity=Identity))
