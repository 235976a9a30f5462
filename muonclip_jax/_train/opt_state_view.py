"""What a train step reads from an optimizer state, found by one documented search.

Optax states are nested tuples, NamedTuples and dicts whose shape depends on how the
optimizer was composed (``chain``, ``inject_hyperparams``, ``MultiSteps``, ``partition``).
``make_train_step`` needs a few facts from whatever the composition is: the QK-Clip's state
(what the clip did, and its tau), ``multi_steps``' running maximum (what the clip will see),
whether an ``optax.MultiSteps`` made its real update this call, the step count (for a tau
schedule) and any injected learning rate. ``view_opt_state`` finds all of them in one walk,
by node type (``QKClipState``, ``MultiStepsMaxLogitsState``, ``optax.MultiStepsState``) and,
for the count and learning rate, by field name (optax's ``tree_get_all_with_path``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._clip import collect_max_logits, MultiStepsMaxLogitsState, QKClipState


class OptStateView(NamedTuple):
  """The facts ``make_train_step`` reads from an optimizer state (``view_opt_state``)."""

  clip: QKClipState | None  # the state of the optimizer's one QK-Clip; None: it does not clip
  running_max_logits: dict[str, jax.Array] | None  # multi_steps' running maximum {module: (*stack, H)}
  updated: jax.Array | None  # bool, (): every optax.MultiSteps made its real update; None: no MultiSteps
  count: jax.Array | None  # int32, (): the clip's update count, else the first `count`; None: none
  learning_rate: Any  # injected learning rate: a scalar array, {state path: array} for several, or None


def _of_type(tree: Any, cls: type) -> list:
  return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, cls)) if isinstance(x, cls)]


def view_opt_state(opt_state: Any, caller: str = "make_train_step") -> OptStateView:
  """Reads an optimizer state's ``OptStateView``, wherever in the state each fact sits.

  * ``clip``: the one ``QKClipState`` (``muonclip``, ``qk_clip_transform``), or None.
    Several clips are a ValueError: the step reports one tau and one clip.
  * ``running_max_logits``: the running maximum of the one ``multi_steps``
    (``MultiStepsMaxLogitsState``), flattened to ``{module: maxima}``; None when there is
    none, or several nested ones (their maxima are not tracked).
  * ``updated``: with ``optax.MultiSteps`` (plain or inside ``multi_steps``), whether every
    one of them is at ``mini_step == 0``: read after an update, whether this call made the
    real update. None without MultiSteps.
  * ``count``: the clip's ``count``, else the first field named ``count`` (optax's
    ``tree_get_all_with_path`` order), else None.
  * ``learning_rate``: the scalar fields named ``learning_rate`` (``inject_hyperparams``;
    a schedule's own state is not a scalar and is skipped): one array, a dict by state path
    when there are several, or None.

  Reads only the state's structure and leaves: jit-safe, no host sync.
  """
  clips = _of_type(opt_state, QKClipState)
  if len(clips) > 1:
    raise ValueError(f"{caller}: the optimizer has {len(clips)} QK-Clip transforms; the metrics and "
                     "exact_clip need one tau")
  clip = clips[0] if clips else None
  accumulating = _of_type(opt_state, MultiStepsMaxLogitsState)
  running = collect_max_logits(accumulating[0].max_logits, caller) if len(accumulating) == 1 else None
  multi = _of_type(opt_state, optax.MultiStepsState)
  updated = functools.reduce(jnp.logical_and, [x.mini_step == 0 for x in multi]) if multi else None
  if clip is not None:
    count = clip.count
  else:
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    count = counts[0][1] if counts else None
  rates = [(jax.tree_util.keystr(p, simple=True, separator="/"), v)
           for p, v in optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
           if isinstance(v, (jax.Array, np.ndarray)) and v.ndim == 0]
  learning_rate = (rates[0][1] if len(rates) == 1 else dict(rates)) if rates else None
  return OptStateView(clip, running, updated, count, learning_rate)
