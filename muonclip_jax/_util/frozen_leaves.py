"""Leaves no optimizer of the library changes: non-float parameters and empty ones.

A step counter, an integer table or a boolean mask kept among the parameters must come out
of every update unchanged, as ``optax.sgd`` leaves it with its zero gradient. Left to the
optimizers, decoupled weight decay would move it (``theta - lr * wd * theta``, rounded back:
a counter 3 becomes 2), AdamW would divide integers and Muon would orthogonalize an integer
matrix. Its gradient is an integer zero or a ``float0`` array (``jax.grad(...,
allow_int=True)``), which optax's transforms cannot add to anything. A zero-size leaf (a
``(0, 8)`` kernel) has no entry to update, and Newton–Schulz's reductions have no element
to reduce.

``skip_frozen_leaves(tx)`` keeps such leaves away from ``tx``, as ``optax.masked`` keeps
masked leaves away from its inner transform: ``tx`` sees each of them as
``optax.MaskedNode()`` (an empty node), so it holds no state for them, and their update is
zero. A tree without such leaves goes to ``tx`` as it is (same state, same updates).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


def is_frozen(leaf: Any) -> bool:
  """True for a leaf no optimizer changes: a dtype that is not inexact (integers, booleans,
  ``float0``) or no element. Reads only the dtype and the shape (works on abstract values)."""
  dtype = getattr(leaf, "dtype", None)
  if dtype is None:
    if not isinstance(leaf, (bool, int, float, complex)):
      return False  # not an array (e.g. the placeholder optax.tree_map_params initializes with)
    dtype = jnp.result_type(leaf)
  return not jnp.issubdtype(dtype, jnp.inexact) or 0 in jnp.shape(leaf)


def _zero_update(update: Any, param: Any) -> jax.Array:
  """The zero update of a frozen leaf: zeros of the param's dtype (of the update's without
  params; ``False`` for a ``float0`` update, which adds to any dtype without changing it)."""
  like = param if param is not None else update
  dtype = jnp.bool_ if like.dtype == jax.dtypes.float0 else like.dtype
  return jnp.zeros(jnp.shape(like), dtype)


def skip_frozen_leaves(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``tx`` on the leaves that ``is_frozen`` does not flag; a zero update for the others.

  Which leaves are frozen is read from the params (at ``init``, and at ``update`` when they
  are given), else from the updates: an integer, boolean or ``float0`` gradient marks its
  leaf. Extra arguments (``max_logits``) go to ``tx`` unchanged.
  """
  tx = optax.with_extra_args_support(tx)

  def mask_of(tree: Any) -> Any:  # True: the leaf goes to tx
    return jax.tree.map(lambda x: not is_frozen(x), tree)

  def without_frozen(tree: Any, keep: Any) -> Any:
    return jax.tree.map(lambda k, x: x if k else optax.MaskedNode(), keep, tree)

  def init_fn(params):
    keep = mask_of(params)
    if all(jax.tree.leaves(keep)):
      return tx.init(params)
    return tx.init(without_frozen(params, keep))

  def update_fn(updates, state, params=None, **extra_args):
    keep = mask_of(updates if params is None else params)
    if all(jax.tree.leaves(keep)):
      return tx.update(updates, state, params, **extra_args)
    inner_params = None if params is None else without_frozen(params, keep)
    new, state = tx.update(without_frozen(updates, keep), state, inner_params, **extra_args)
    if params is None:
      return jax.tree.map(lambda k, n, u: n if k else _zero_update(u, None), keep, new, updates), state
    return jax.tree.map(lambda k, n, u, p: n if k else _zero_update(u, p), keep, new, updates, params), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
