"""MuonClip as one Optax optimizer: Muon + AdamW (``_muon``), then QK-Clip on the updated weights (``_clip``).

Kimi K2 (arXiv 2507.20534), Algorithm 1: after the Muon/AdamW update, every attention head
whose max logit S_max^h on the step's batch exceeds tau has its query/key weights scaled by
gamma_h = tau / S_max^h (see ``qk_clip``). ``muonclip`` chains ``muon_adamw`` with
``qk_clip_transform``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import optax

from ._clip import LayoutSpec, qk_clip_transform
from ._muon import muon_adamw
from ._util import MatrixAxesSpec


def muonclip(
    learning_rate: optax.ScalarOrSchedule,
    *,
    layout: LayoutSpec,
    qk_clip_threshold: optax.ScalarOrSchedule | None = 100.0,
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
    muon_blocks: str = "matrix",
    shard_orthogonalization: jax.sharding.Mesh | optax.Params | None = None,
    shard_split: str = "auto",
) -> optax.GradientTransformationExtraArgs:
  """MuonClip (Kimi K2, arXiv 2507.20534, Algorithm 1): ``muon_adamw`` then QK-Clip.

  ``updates, state = opt.update(grads, state, params, max_logits=intermediates)``, then
  ``optax.apply_updates(params, updates)`` gives the updated and clipped parameters. It
  composes like any Optax optimizer: ``optax.chain(optax.clip_by_global_norm(1.0),
  muonclip(...))`` (``chain`` hands ``max_logits`` on), schedules, and
  ``optax.inject_hyperparams`` (``qk_clip_threshold`` may be injected). For gradient
  accumulation wrap it with ``muonclip_jax.multi_steps`` (not plain ``optax.MultiSteps``,
  which would hand on only the last microbatch's maxima, or none), or take the maximum over
  the microbatches yourself (``muonclip_jax.training.make_train_step(num_microbatches=k)``).

  The clip must act on the final parameters, so ``muonclip`` must be the last transform:
  put gradient clipping and the like before it (``optax.chain(optax.clip_by_global_norm(1.0),
  muonclip(...))``), never after (``optax.chain(muonclip(...), optax.scale(0.5))`` would
  halve the clip's correction while its state still reported the heads as clipped).
  ``make_train_step``, ``sharding.init_state``, ``multi_steps`` and ``check_opt_state``
  refuse a transform after the clip with a ValueError; in a loop of your own, call
  ``check_opt_state(opt.init(params))`` once.

  Args:
    learning_rate: a scalar or schedule, shared by Muon and (by default) AdamW.
    layout: the attention head layout (``module.layout`` of the library's attention
      modules), or a mapping from module-path glob patterns to layouts. It is Muon's
      declaration too: every query, key, value and output kernel it describes gets its
      matrix from it, with no ``matrix_axes`` (see ``scale_by_muon``).
    muon_blocks: ``"matrix"`` (default: each projection one matrix, Kimi K2), ``"part"``
      (fused projections as their parts), ``"head"`` (Kimi K3's per-head Muon),
      ``"group:<k>"`` (``k`` consecutive heads per block, Group Muon), ``"group:kv"`` (GQA's
      groups), each of the last three with ``"+out"`` (the output projection cut too,
      ``"head+out"``); see ``scale_by_muon``.
    qk_clip_threshold: tau (Kimi K2: 100), or a schedule of the step count (see
      ``qk_clip_transform``). ``None`` or ``inf`` turns the clip off, and
      ``max_logits`` is then optional; with a finite tau a missing ``max_logits`` is a
      ValueError at trace time, never a silent no-clip. A traced tau that turns NaN, zero
      or negative clips nothing and shows as NaN in ``QKClipState.threshold``
      (``qk_clip_threshold_valid`` False in ``make_train_step``'s metrics).
    weight_decay, labels, adam_learning_rate, adam_b1, adam_b2, adam_eps,
      adam_weight_decay, weight_decay_mask: as for ``muon_adamw``, with its defaults.
    beta, nesterov, ns_steps, ns_coeffs, ns_method, ns_normalize, ns_restarts, ns_precision, ns_batch,
      eps, compute_dtype, mu_dtype, rms_match, rms_scale, matrix_axes,
      shard_orthogonalization, shard_split: Muon's options (``scale_by_muon``), with its
      defaults.

  Under ``optax.inject_hyperparams`` a callable ``labels``/``matrix_axes``/``weight_decay_mask``
  must be named in ``static_args`` (inject_hyperparams takes every callable for a schedule
  and calls it with the step count: a mask such as ``lambda p: jax.tree.map(lambda x: x.ndim
  >= 2, p)`` then returns ``False`` and turns weight decay off everywhere, silently, as for
  ``optax.adamw(mask=...)``); a ``MatrixAxes`` or a pytree is static as it is. So must a dtype
  given as a type (``compute_dtype=jnp.bfloat16``, ``mu_dtype=...``: a callable too), else a
  TypeError says so; a string (``"bfloat16"``) is static as it is.

  See ``qk_clip_transform`` for the (at most one-ulp) rounding difference between this and
  calling ``qk_clip`` on ``optax.apply_updates(params, updates)`` yourself.

  Returns:
    An ``optax.GradientTransformationExtraArgs``: ``muon_adamw`` chained with
    ``qk_clip_transform``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, muonclip_jax as mc
    >>> layout = mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=4)
    >>> params = {"attn": {"wq": {"kernel": jnp.ones((8, 8))}, "wk": {"kernel": jnp.ones((8, 8))}}}
    >>> opt = mc.muonclip(0.0, layout=layout, qk_clip_threshold=100.0, weight_decay=0.0)
    >>> state = opt.init(params)
    >>> max_logits = {"attn": {"max_logits": jnp.array([400.0, 50.0])}}  # head 0 is above tau
    >>> grads = jax.tree.map(jnp.zeros_like, params)
    >>> updates, state = opt.update(grads, state, params, max_logits=max_logits)
    >>> new = optax.apply_updates(params, updates)
    >>> new["attn"]["wq"]["kernel"][0]  # head 0's columns by sqrt(100 / 400), head 1's kept
    Array([0.5, 0.5, 0.5, 0.5, 1. , 1. , 1. , 1. ], dtype=float32)
    >>> int(state[1].num_clipped), float(state[1].min_gamma)
    (1, 0.25)
  """
  return optax.chain(
      muon_adamw(
          learning_rate, weight_decay=weight_decay, labels=labels, adam_learning_rate=adam_learning_rate,
          adam_b1=adam_b1, adam_b2=adam_b2, adam_eps=adam_eps, adam_weight_decay=adam_weight_decay,
          weight_decay_mask=weight_decay_mask, beta=beta, nesterov=nesterov, ns_steps=ns_steps,
          ns_coeffs=ns_coeffs, ns_method=ns_method, ns_normalize=ns_normalize, ns_restarts=ns_restarts,
          ns_precision=ns_precision, ns_batch=ns_batch, eps=eps, compute_dtype=compute_dtype, mu_dtype=mu_dtype,
          rms_match=rms_match, rms_scale=rms_scale, matrix_axes=matrix_axes, layout=layout, muon_blocks=muon_blocks,
          shard_orthogonalization=shard_orthogonalization, shard_split=shard_split),
      qk_clip_transform(qk_clip_threshold, layout=layout),
  )
