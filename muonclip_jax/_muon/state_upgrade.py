"""``upgrade_opt_state``: an optimizer state saved by an earlier release, in today's structure.

Muon's state gained ``mu_scale`` (``ScaleByMuonState``: the momentum kept as ``mu * mu_scale``
so that finite gradients never overflow it), first one scalar per leaf, then one scale per
matrix of a stacked leaf (layers, experts). A checkpoint saved before either no longer has
the structure of ``optimizer.init(params)``, so restoring it onto that target fails. This
reads a state of any of those forms by path, whatever containers it was restored into
(Orbax without a target gives dicts and lists), and returns today's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._util import path_str

_SCALE = "mu_scale"


def _is_scale(path: str) -> bool:
  return _SCALE in path.split("/")


def upgrade_opt_state(old_state: Any, optimizer: Any, params: Any) -> Any:
  """``old_state`` in the structure ``optimizer.init(params)`` gives today.

  Every leaf of today's state is read from ``old_state`` at the same path (``inner_states/
  muon/inner_state/0/mu/...``; NamedTuple fields, dict keys and list indices alike, so the
  raw tree of an Orbax restore without a target reads as the state it was saved from), except
  Muon's ``mu_scale`` (``ScaleByMuonState``): missing (a state saved before it), it is 1, so
  the momentum is ``mu`` as saved; one scalar for a leaf that now has one scale per matrix,
  it is that scalar for each. Nothing else is invented: a leaf of today's state that
  ``old_state`` lacks, a leaf of ``old_state`` today's does not have, another shape or
  another dtype is a ValueError naming the path. Leaves taken from ``old_state`` are
  returned as they are (same arrays, same placement).

  Args:
    old_state: the saved state (a state object, or the raw tree of a restore without target).
    optimizer: the optimizer the training goes on with.
    params: its params (or their ``jax.ShapeDtypeStruct``s).

  Returns:
    A state with the structure, shapes and dtypes of ``optimizer.init(params)``
    (``check_opt_state(state, optimizer=optimizer, params=params)`` accepts it).

  Example:
    >>> import jax.numpy as jnp, muonclip_jax as mc
    >>> opt = mc.muon_adamw(1e-2)
    >>> params = {"mlp": {"kernel": jnp.ones((4, 8))}, "norm": {"scale": jnp.ones((4,))}}
    >>> state = opt.init(params)
    >>> muon = state.inner_states["muon"].inner_state[0]
    >>> saved = {"inner_states": {"adam": state.inner_states["adam"],  # as saved before mu_scale
    ...                           "muon": {"inner_state": [{"mu": muon.mu}]}}}
    >>> new = mc.upgrade_opt_state(saved, opt, params)
    >>> new.inner_states["muon"].inner_state[0].mu_scale["mlp"]["kernel"]
    Array(1., dtype=float32)
  """
  want, treedef = jax.tree_util.tree_flatten_with_path(jax.eval_shape(optimizer.init, params))
  have = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(old_state)[0]}
  used, out = set(), []
  for p, ref in want:
    where = path_str(p)
    if where not in have:
      if not _is_scale(where):
        raise ValueError(f"upgrade_opt_state: the saved state has no leaf at {where!r} (of shape {ref.shape}, "
                         f"{ref.dtype}), which optimizer.init(params) holds: a state of another optimizer "
                         "configuration or model")
      out.append(jnp.ones(ref.shape, ref.dtype))
      continue
    x = have[where]
    used.add(where)
    shape, dtype = jnp.shape(x), jnp.result_type(x)
    if _is_scale(where) and shape == () and ref.shape != () and dtype == ref.dtype:
      out.append(jnp.broadcast_to(x, ref.shape))  # one scale per leaf -> the same for each of its matrices
      continue
    if shape != ref.shape or dtype != ref.dtype:
      raise ValueError(f"upgrade_opt_state: the saved leaf at {where!r} is {dtype}{list(shape)}, "
                       f"optimizer.init(params) gives {ref.dtype}{list(ref.shape)}: a state of another "
                       "optimizer configuration or model")
    out.append(x)
  extra = sorted(set(have) - used)
  if extra:
    raise ValueError(f"upgrade_opt_state: the saved state has leaves optimizer.init(params) does not hold: "
                     f"{extra[:5]}: a state of another optimizer configuration or model")
  return jax.tree_util.tree_unflatten(treedef, out)
