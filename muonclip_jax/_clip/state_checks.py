"""Checks of an optimizer's state that no single transform can make: where the clip sits.

QK-Clip turns the updates ``u`` into ``u'`` with ``params + u' = qk_clip(params + u)``
(``qk_clip_transform``). It cannot see what the rest of a chain does with ``u'``: a
transform after it changes the final parameters, and then the clip's correction is scaled
(``optax.scale(0.5)`` halves it) or undone (``optax.clip_by_global_norm`` shrinks it to
nothing), while its state still reports the heads as clipped. The clip acts on the final
parameters only as the last transform, so a transform after it is refused, by the places
that can see the whole optimizer state: ``make_train_step`` (at its first trace),
``sharding.init_state``, ``multi_steps`` and ``check_opt_state`` itself.

The same walk finds a plain ``optax.MultiSteps`` around a clip: it hands its inner
optimizer the extra arguments of the last micro-step only (and, called through
``optax.with_extra_args_support``, none: ``max_logits`` never reaches the clip), so the
clip of an accumulated step would see one microbatch. ``multi_steps`` keeps the maximum.

Given the optimizer and the params, ``check_opt_state`` also compares the state with the
one ``optimizer.init(params)`` would give, by structure, shape and dtype, abstractly (no
computation, no host sync): an optimizer state from another model (a 1-layer state meeting
3-layer params) would otherwise broadcast into the update without an error.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from .accumulation import MultiStepsMaxLogitsState
from .transform import QKClipState


def _children(node: Any) -> list[tuple[Any, Any]]:
  """The immediate pytree children of ``node`` as ``(key, child)``; none for a leaf."""
  flat = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
  if len(flat) == 1 and not flat[0][0]:  # node is itself a leaf
    return []
  return [(path[0], child) for path, child in flat]


def _where(path: tuple) -> str:
  return "opt_state" + jax.tree_util.keystr(path)


def _walk(node: Any, path: tuple, caller: str, inner_of_multi_steps: bool = False) -> bool:
  """Raises on a transform after a clip or a plain MultiSteps around one; True if a clip is inside."""
  if isinstance(node, QKClipState):
    return True
  kids = _children(node)
  inside = [
      _walk(child, (*path, key), caller, isinstance(node, MultiStepsMaxLogitsState))
      for key, child in kids
  ]
  if isinstance(node, optax.MultiStepsState) and not inner_of_multi_steps and any(inside):
    raise ValueError(
        f"{caller}: a plain optax.MultiSteps (state at {_where(path)}) wraps a QK-Clip: MultiSteps hands "
        "its inner optimizer the extra arguments of the last micro-step only, and none at all when it is "
        "called through optax.with_extra_args_support (as make_train_step does), so max_logits would not "
        "reach the clip, or the clip would see the last microbatch only. Use "
        "muonclip_jax.multi_steps(opt, every_k, layout=...), which hands the clip the maximum over the "
        "micro-steps, or make_train_step(num_microbatches=k)"
    )
  if type(node) is tuple:  # the state of optax.chain: one entry per transform, in order
    for i, has_clip in enumerate(inside[:-1]):
      if has_clip:
        key, after = kids[i + 1]
        raise ValueError(
            f"{caller}: a transform follows the QK-Clip in an optax.chain (the clip's state is inside "
            f"{_where((*path, kids[i][0]))}, the next transform's state, a {type(after).__name__}, at "
            f"{_where((*path, key))}). The clip makes params + updates the clipped weights only as the last "
            "transform: one after it changes its correction (optax.scale(0.5) halves it, "
            "clip_by_global_norm can undo it) while QKClipState still reports the heads as clipped. Put "
            "every transform before it, e.g. optax.chain(optax.clip_by_global_norm(1.0), "
            "muonclip_jax.muonclip(...))"
        )
  return any(inside)


def _check_fits(opt_state: Any, optimizer: Any, params: Any, caller: str) -> None:
  expected = jax.eval_shape(optimizer.init, params)
  got, got_def = jax.tree_util.tree_flatten_with_path(opt_state)
  want, want_def = jax.tree_util.tree_flatten_with_path(expected)
  hint = ("a state restored from another model or optimizer configuration? Initialize it with "
          "optimizer.init(params), or restore it with that as the target")
  if got_def != want_def:
    got_paths = {_where(p) for p, _ in got}
    want_paths = {_where(p) for p, _ in want}
    missing, extra = sorted(want_paths - got_paths)[:3], sorted(got_paths - want_paths)[:3]
    detail = (f"missing {missing}, unexpected {extra}" if missing or extra
              else f"the same leaves in other node types: {str(got_def)[:300]} vs {str(want_def)[:300]}")
    raise ValueError(f"{caller}: the optimizer state does not have the structure optimizer.init(params) "
                     f"gives ({detail}); {hint}")
  for (path, leaf), (_, ref) in zip(got, want):
    if jax.numpy.shape(leaf) != ref.shape:
      raise ValueError(
          f"{caller}: the optimizer state does not fit the params: {_where(path)} has shape "
          f"{jax.numpy.shape(leaf)}, optimizer.init(params) gives {ref.shape} (it would broadcast into the "
          f"update without an error); {hint}")
    if jax.numpy.result_type(leaf) != ref.dtype:
      raise ValueError(
          f"{caller}: the optimizer state does not fit the params: {_where(path)} is "
          f"{jax.numpy.result_type(leaf)}, optimizer.init(params) gives {ref.dtype} (a state cast as a whole, "
          "e.g. optax.tree.cast, casts counters and Muon's mu_scale too, whose powers of two then overflow): "
          "store the momentum in another dtype with mu_dtype= instead, or cast the state back")


def check_opt_state(opt_state: Any, *, optimizer: Any = None, params: Any = None,
                    caller: str = "check_opt_state") -> None:
  """Refuses an optimizer state in which the QK-Clip cannot act on the final parameters.

  QK-Clip (``muonclip``, ``qk_clip_transform``) must be the last transform of its chain:
  it makes ``params + updates`` the clipped weights, and a transform after it (a scale, a
  clip of the global norm) would change that while the clip's state reports the heads as
  clipped. A GradientTransformation cannot see what follows it, so this function looks at
  the whole state: every ``optax.chain`` (whose state is a tuple, one entry per transform)
  that holds a clip in an entry other than its last is an error, and so is a plain
  ``optax.MultiSteps`` around a clip (use ``muonclip_jax.multi_steps``). ``make_train_step``
  calls it at its first trace, ``sharding.init_state`` and ``multi_steps`` at ``init``;
  call it yourself after ``opt.init`` when you write your own loop. ``optax.named_chain``
  (a dict state) is not checked.

  With ``optimizer`` and ``params`` it also checks that ``opt_state`` has the structure and
  the leaf shapes of ``optimizer.init(params)`` (computed abstractly, ``jax.eval_shape``:
  no computation, no host sync; jit-safe): a state restored from another model, e.g. a
  1-layer model's state meeting a 3-layer model's params, would otherwise broadcast into
  the update silently. Dtypes are compared too: a state cast as a whole (``optax.tree.cast``
  to float16) would cast Muon's ``mu_scale``, whose powers of two overflow float16.

  Raises:
    ValueError: a transform after the clip (with the paths of both states); a plain
      ``optax.MultiSteps`` wrapping a clip; with ``optimizer`` and ``params``, a state whose
      structure, leaf shapes or leaf dtypes differ from ``optimizer.init(params)``'s (with the path).

  Example:
    >>> import jax.numpy as jnp, optax, muonclip_jax as mc
    >>> layout = mc.GQALayout(2, 2, 4)
    >>> opt = optax.chain(mc.muonclip(0.02, layout=layout), optax.scale(0.5))
    >>> params = {"w": jnp.ones((4, 4))}
    >>> mc.check_opt_state(opt.init(params))
    Traceback (most recent call last):
    ...
    ValueError: check_opt_state: a transform follows the QK-Clip in an optax.chain ...
  """
  _walk(opt_state, (), caller)
  if optimizer is not None and params is not None:
    _check_fits(opt_state, optimizer, params, caller)
