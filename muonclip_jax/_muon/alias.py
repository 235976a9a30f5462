"""Optimizers built from the transforms: ``muon`` (matrices) and ``muon_adamw`` (a whole model)."""

from __future__ import annotations

import math

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._util import accept_bare_updates, check_number, MatrixAxesSpec, skip_frozen_leaves
from .scale_by_muon import scale_by_muon
from .labels import ADAM, FROZEN, MUON, muon_labels, remembering_labels
from .._clip import LayoutSpec


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    weight_decay: optax.ScalarOrSchedule = 0.1,
    weight_decay_mask: optax.Params | Callable[[optax.Params], optax.Params] | None = None,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_steps: int | None = None,
    ns_coeffs: str | jax.typing.ArrayLike = "polar_express_4",
    ns_method: str = "auto",
    ns_normalize: str | None = None,
    ns_restarts: Sequence[int] = (),
    ns_precision: str | None = None,
    ns_batch: int | None = None,
    eps: float = 1e-7,
    compute_dtype: jax.typing.DTypeLike | None = None,
    mu_dtype: jax.typing.DTypeLike | None = None,
    rms_match: str | None = "moonlight",
    rms_scale: float = 0.2,
    matrix_axes: MatrixAxesSpec = None,
    layout: LayoutSpec | None = None,
    muon_blocks: str = "matrix",
    shard_orthogonalization: jax.sharding.Mesh | optax.Params | None = None,
    shard_split: str = "auto",
) -> optax.GradientTransformationExtraArgs:
  """Muon for weight matrices, as in Kimi K2 (arXiv 2507.20534, Algorithm 1).

  Muon only, for a tree of matrices: unlike ``optax.contrib.muon`` (Muon on matrices and
  Adam on the rest), nothing here goes to Adam; ``muon_adamw`` is the whole-model
  optimizer that corresponds to ``optax.contrib.muon``.

  ``theta <- theta - lr * (O + weight_decay * theta)``, with ``O`` the RMS-matched
  orthogonalized momentum of ``scale_by_muon`` (decoupled weight decay, Loshchilov & Hutter;
  Moonlight, arXiv 2502.16982, eq. 4). Built as
  ``chain(scale_by_muon, add_decayed_weights, scale_by_learning_rate)``, so every numeric
  argument works under ``optax.inject_hyperparams`` and ``learning_rate`` may be a schedule.

  Args:
    learning_rate: a number >= 0 or an optax schedule (see "Inputs" below).
    weight_decay: decoupled weight decay (Moonlight/Kimi: 0.1), a number >= 0 or a schedule.
    weight_decay_mask: optional mask or callable, as in ``optax.add_decayed_weights``. Under
      ``optax.inject_hyperparams`` name a callable in ``static_args``: it would be taken for a
      schedule (see ``muonclip``); so must a dtype type such as ``compute_dtype=jnp.bfloat16``.
    beta, nesterov, ns_steps, ns_coeffs, ns_method, ns_normalize, ns_restarts, ns_precision, ns_batch,
      eps, compute_dtype, mu_dtype, rms_match, rms_scale, matrix_axes, layout, muon_blocks,
      shard_orthogonalization, shard_split: the options of ``scale_by_muon``, with its
      defaults.

  Inputs (the library's input contract, ``docs/training.md``):

  * A negative, NaN or non-numeric constant ``learning_rate`` or ``weight_decay`` is refused
    here (ValueError / TypeError); a boolean option (``nesterov``) must be a ``bool``.
  * A schedule is evaluated inside the update, under ``jit``, where nothing can raise: its
    value is applied as given, as ``optax.scale_by_learning_rate`` and
    ``optax.add_decayed_weights`` apply it, so a schedule that returns a negative learning
    rate ascends the loss at those steps. Clamping it to 0 would hide the bug instead of
    showing it; check a schedule over your step range before training, and log it
    (``optax.inject_hyperparams`` puts it in the state, and ``make_train_step`` reports it
    as ``learning_rate``).
  * Non-float leaves (integers, booleans; their gradients may be ``float0``, from
    ``jax.grad(..., allow_int=True)``) and zero-size leaves get a zero update, and no
    state: weight decay never moves them (``_util.frozen_leaves``).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, muonclip_jax as mc
    >>> params = {"w": jnp.ones((4, 8))}
    >>> opt = mc.muon(0.02)
    >>> state = opt.init(params)
    >>> grads = {"w": jax.random.normal(jax.random.key(0), (4, 8))}
    >>> updates, state = opt.update(grads, state, params)
    >>> optax.apply_updates(params, updates)["w"].shape
    (4, 8)
  """
  check_number("learning_rate", learning_rate, low=0.0, high=math.inf, high_open=True, schedule=True)
  check_number("weight_decay", weight_decay, low=0.0, high=math.inf, high_open=True, schedule=True)
  return skip_frozen_leaves(optax.chain(
      scale_by_muon(beta, nesterov=nesterov, ns_steps=ns_steps, ns_coeffs=ns_coeffs, ns_method=ns_method,
                    ns_normalize=ns_normalize, ns_restarts=ns_restarts, ns_precision=ns_precision,
                    ns_batch=ns_batch, eps=eps, compute_dtype=compute_dtype, mu_dtype=mu_dtype, rms_match=rms_match,
                    rms_scale=rms_scale, matrix_axes=matrix_axes, layout=layout, muon_blocks=muon_blocks,
                    shard_orthogonalization=shard_orthogonalization, shard_split=shard_split),
      optax.add_decayed_weights(weight_decay, weight_decay_mask),
      optax.scale_by_learning_rate(learning_rate),
  ))


def muon_adamw(
    learning_rate: optax.ScalarOrSchedule,
    *,
    weight_decay: optax.ScalarOrSchedule = 0.1,
    labels: optax.Params | Callable[[optax.Params], optax.Params] | None = None,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    adam_weight_decay: optax.ScalarOrSchedule | None = None,
    weight_decay_mask: optax.Params | Callable[[optax.Params], optax.Params] | None = None,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_steps: int | None = None,
    ns_coeffs: str | jax.typing.ArrayLike = "polar_express_4",
    ns_method: str = "auto",
    ns_normalize: str | None = None,
    ns_restarts: Sequence[int] = (),
    ns_precision: str | None = None,
    ns_batch: int | None = None,
    eps: float = 1e-7,
    compute_dtype: jax.typing.DTypeLike | None = None,
    mu_dtype: jax.typing.DTypeLike | None = None,
    rms_match: str | None = "moonlight",
    rms_scale: float = 0.2,
    matrix_axes: MatrixAxesSpec = None,
    layout: LayoutSpec | None = None,
    muon_blocks: str = "matrix",
    shard_orthogonalization: jax.sharding.Mesh | optax.Params | None = None,
    shard_split: str = "auto",
) -> optax.GradientTransformationExtraArgs:
  """The optimizer for a whole model: Muon on hidden matrices, AdamW on the rest.

  Routing (Moonlight, arXiv 2502.16982, section 2.2: embeddings, the output head and
  vectors use AdamW) is ``labels``: ``None`` for ``muon_labels`` (by path, shape and logical
  names, every rule listed in its docstring; embedding tables and LM
  heads never go to Muon, unlike ``optax.contrib.muon``), a pytree of ``"muon"``/``"adam"``/
  ``"frozen"`` with the structure of the params, or a callable from the params to such a
  tree. ``"frozen"`` leaves are left as they are: a zero update, no weight decay, no state
  (``optax.set_to_zero``); the default labels give it to a mixture-of-experts routing bias
  moved outside the gradient (DeepSeek-V3's ``e_score_correction_bias``). A router (gate)
  goes to Muon by default; ``labels=lambda p: muonclip_jax.muon_labels(p, router="adam")``
  sends it to AdamW (``muon_labels``, rule 10). A callable
  is called on the boxed params at ``init`` and its labels reused at ``update`` for the bare
  arrays of the same paths and shapes, so ``nnx.Optimizer`` (boxed ``nnx.Param`` at ``init``,
  bare arrays at ``update``) routes every leaf alike in both. With Moonlight's RMS matching both halves share one learning rate.

  Args:
    learning_rate: Muon's learning rate, a number >= 0 or a schedule (applied as given
      inside the update: see ``muon``).
    weight_decay: Muon's decoupled weight decay (0.1).
    labels: the routing (see above). Non-float and zero-size leaves get a zero update
      whatever their label (see ``muon``), and no half keeps state for them.
    adam_learning_rate: AdamW's learning rate, a number >= 0 or a schedule; defaults to
      ``learning_rate``.
    adam_b1, adam_b2, adam_eps: AdamW moments (Moonlight: 0.9, 0.95, 1e-8).
    adam_weight_decay: AdamW's decoupled weight decay; defaults to ``weight_decay``.
    weight_decay_mask: which leaves are decayed, in both halves (below). Under
      ``optax.inject_hyperparams`` name a callable in ``static_args`` (see ``muonclip``).
    beta, nesterov, ns_steps, ns_coeffs, ns_method, ns_normalize, ns_restarts, ns_precision, ns_batch,
      eps, compute_dtype, mu_dtype, rms_match, rms_scale, matrix_axes, layout, muon_blocks,
      shard_orthogonalization, shard_split: Muon's options (``scale_by_muon``), with its
      defaults; ``mu_dtype`` applies to AdamW's first moment too. ``layout`` makes the
      attention layout Muon's declaration without a clip (``muonclip`` passes its own), e.g.
      ``muon_adamw(lr, layout=model.layout, muon_blocks="head")`` for per-head Muon where
      QK-Clip does not apply (linear attention, or no clip at all).

  ``weight_decay_mask`` (as in ``optax.add_decayed_weights``: ``True`` where a leaf is
  decayed) applies to both halves. A pytree mask has the structure of the whole params:
  each half reads the mask's entries at its own leaves. A callable is called once per half
  with that half's sub-tree of the params, the ``optax.partition`` view in which the
  other half's leaves (and every non-float or zero-size leaf) are ``optax.MaskedNode()``
  (empty nodes without leaves), and must
  return a mask of that sub-tree's structure: ``jax.tree.map`` or
  ``jax.tree_util.tree_map_with_path`` over its argument does, e.g.
  ``lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)`` to decay no bias or norm scale.

  Inherited from optax (``optax.adamw`` does the same):

  * float16 parameters: ``adam_eps=1e-8`` rounds to 0 in float16, and squared gradients
    below ~2e-4 underflow, so AdamW's half divides 0 by 0 and its updates turn NaN. Keep
    float32 master parameters and run the model in float16
    (``training.make_train_step(compute_dtype=jnp.float16)``), or use bfloat16, whose
    range holds 1e-8. The Muon half is not affected. ``init`` refuses (ValueError) float16
    leaves routed to AdamW when ``adam_eps`` is 0 in float16.
  * The state is not checked against the params by ``update``: a state from another model
    (a 1-layer model's state on a 3-layer model) broadcasts into the update silently.
    ``make_train_step`` refuses it at its first trace; in a loop of your own call
    ``check_opt_state(state, optimizer=opt, params=params)`` after restoring a checkpoint.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (extra arguments such as ``max_logits``
    are accepted and ignored).

  Example:
    >>> import jax, jax.numpy as jnp, optax, muonclip_jax as mc
    >>> params = {"embed": {"embedding": jnp.ones((16, 8))}, "mlp": {"kernel": jnp.ones((8, 8))}}
    >>> mc.muon_labels(params)
    {'embed': {'embedding': 'adam'}, 'mlp': {'kernel': 'muon'}}
    >>> opt = mc.muon_adamw(3e-3)
    >>> state = opt.init(params)
    >>> grads = jax.tree.map(lambda p: 0.1 * jnp.ones_like(p), params)
    >>> updates, state = opt.update(grads, state, params)
    >>> jax.tree.map(jnp.shape, updates)
    {'embed': {'embedding': (16, 8)}, 'mlp': {'kernel': (8, 8)}}
  """
  muon_half = muon(  # checks Muon's options first
      learning_rate, weight_decay=weight_decay, weight_decay_mask=weight_decay_mask, beta=beta,
      nesterov=nesterov, ns_steps=ns_steps, ns_coeffs=ns_coeffs, ns_method=ns_method, ns_normalize=ns_normalize,
      ns_restarts=ns_restarts, ns_precision=ns_precision, ns_batch=ns_batch, eps=eps, compute_dtype=compute_dtype,
      mu_dtype=mu_dtype, rms_match=rms_match, rms_scale=rms_scale, matrix_axes=matrix_axes, layout=layout,
      muon_blocks=muon_blocks, shard_orthogonalization=shard_orthogonalization, shard_split=shard_split)
  adam_wd = weight_decay if adam_weight_decay is None else adam_weight_decay
  check_number("adam_weight_decay", adam_wd, low=0.0, high=math.inf, high_open=True, schedule=True)
  if adam_learning_rate is not None:
    check_number("adam_learning_rate", adam_learning_rate, low=0.0, high=math.inf, high_open=True,
                 schedule=True)
  check_number("adam_b1", adam_b1, low=0.0, high=1.0, high_open=True)  # 1: Adam divides by 1 - b1^t = 0
  check_number("adam_b2", adam_b2, low=0.0, high=1.0, high_open=True)
  check_number("adam_eps", adam_eps, low=0.0, high=math.inf, high_open=True)
  transforms = {
      MUON: muon_half,
      ADAM: optax.adamw(
          learning_rate if adam_learning_rate is None else adam_learning_rate,
          b1=adam_b1,
          b2=adam_b2,
          eps=adam_eps,
          weight_decay=adam_wd,
          mu_dtype=mu_dtype,
          mask=weight_decay_mask,
      ),
      FROZEN: optax.set_to_zero(),
  }
  if labels is None or callable(labels):  # read once from boxed params (nnx.Optimizer's init), reused at update
    labels = remembering_labels(muon_labels if labels is None else labels)
  tx = skip_frozen_leaves(optax.partition(transforms, labels))

  def init_fn(params):
    _check_adam_eps_dtype(params, labels, adam_eps)
    return tx.init(params)

  # Linen boxes at init, bare arrays at update (the state keeps its boxes)
  return accept_bare_updates(optax.GradientTransformationExtraArgs(init_fn, tx.update))


def _check_adam_eps_dtype(params: Any, routing: Any, adam_eps: Any) -> None:
  """AdamW on float16 leaves with an ``adam_eps`` that is 0 in float16 divides 0 by 0: refuse it.

  (Its second moment has the params' dtype whatever ``mu_dtype`` is, so that does not help.)
  """
  if isinstance(adam_eps, jax.core.Tracer) or np.float16(float(adam_eps)) != 0:
    return
  labels = routing(params) if callable(routing) else routing
  for (path, leaf), label in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(labels)):
    if label == ADAM and jnp.result_type(leaf) == jnp.float16:
      raise ValueError(
          f"muon_adamw: {jax.tree_util.keystr(path, simple=True, separator='/')} is float16 and goes to AdamW, "
          f"whose adam_eps={adam_eps!r} is 0 in float16: squared gradients below ~2e-4 underflow too, so "
          "AdamW's update would be 0/0 = NaN (plain optax.adamw does the same). Keep float32 master params "
          "(make_train_step(compute_dtype=jnp.float16)), use bfloat16, or pass adam_eps >= 6e-8")
