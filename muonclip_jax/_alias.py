"""Optimizers built from the transforms: ``muon`` (matrices) and ``muon_adamw`` (a whole model)."""

from __future__ import annotations

from typing import Any

import optax

from ._muon import check_number, scale_by_muon
from ._routing import ADAM, MUON, MatrixAxesSpec, muon_labels


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    weight_decay: float = 0.1,
    weight_decay_mask: Any = None,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_steps: int | None = None,
    ns_coeffs: Any = "polar_express_4",
    ns_method: str = "auto",
    ns_normalize: str | None = None,
    ns_restarts: Any = (),
    ns_batch: int | None = None,
    eps: float = 1e-7,
    compute_dtype: Any = None,
    mu_dtype: Any = None,
    rms_match: str | None = "moonlight",
    rms_scale: float = 0.2,
    matrix_axes: MatrixAxesSpec = None,
    shard_orthogonalization: Any = None,
) -> optax.GradientTransformation:
  """Muon for weight matrices, as in Kimi K2 (arXiv 2507.20534, Algorithm 1).

  ``theta <- theta - lr * (O + weight_decay * theta)``, with ``O`` the RMS-matched
  orthogonalized momentum of ``scale_by_muon`` (decoupled weight decay, Loshchilov & Hutter;
  Moonlight, arXiv 2502.16982, eq. 4). Built as
  ``chain(scale_by_muon, add_decayed_weights, scale_by_learning_rate)``, so every numeric
  argument works under ``optax.inject_hyperparams`` and ``learning_rate`` may be a schedule.

  Args:
    learning_rate: a scalar or an optax schedule.
    weight_decay: decoupled weight decay (Moonlight/Kimi: 0.1); must be >= 0.
    weight_decay_mask: optional mask or callable, as in ``optax.add_decayed_weights``.
    beta, nesterov, ns_steps, ns_coeffs, ns_method, ns_normalize, ns_restarts, ns_batch, eps,
      compute_dtype, mu_dtype, rms_match,
      rms_scale, matrix_axes, shard_orthogonalization: see ``scale_by_muon``.
  """
  check_number("weight_decay", weight_decay, low=0.0)
  return optax.chain(
      scale_by_muon(
          beta,
          nesterov=nesterov,
          ns_steps=ns_steps,
          ns_coeffs=ns_coeffs,
          ns_method=ns_method,
          ns_normalize=ns_normalize,
          ns_restarts=ns_restarts,
          ns_batch=ns_batch,
          eps=eps,
          compute_dtype=compute_dtype,
          mu_dtype=mu_dtype,
          rms_match=rms_match,
          rms_scale=rms_scale,
          matrix_axes=matrix_axes,
          shard_orthogonalization=shard_orthogonalization,
      ),
      optax.add_decayed_weights(weight_decay, weight_decay_mask),
      optax.scale_by_learning_rate(learning_rate),
  )


def muon_adamw(
    learning_rate: optax.ScalarOrSchedule,
    *,
    weight_decay: float = 0.1,
    labels: Any = None,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    adam_weight_decay: float | None = None,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_steps: int | None = None,
    ns_coeffs: Any = "polar_express_4",
    ns_method: str = "auto",
    ns_normalize: str | None = None,
    ns_restarts: Any = (),
    ns_batch: int | None = None,
    eps: float = 1e-7,
    compute_dtype: Any = None,
    mu_dtype: Any = None,
    rms_match: str | None = "moonlight",
    rms_scale: float = 0.2,
    matrix_axes: MatrixAxesSpec = None,
    shard_orthogonalization: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """The optimizer for a whole model: Muon on hidden matrices, AdamW on the rest.

  Routing (Moonlight, arXiv 2502.16982, section 2.2: embeddings, the output head and
  vectors use AdamW) is ``labels``: ``None`` for ``muon_labels`` (by path and shape;
  embedding tables and LM heads never go to Muon, unlike ``optax.contrib.muon``), a pytree
  of ``"muon"``/``"adam"`` with the structure of the params, or a callable from the params
  to such a tree. With Moonlight's RMS matching both halves share one learning rate.

  Args:
    learning_rate: Muon's learning rate, a scalar or schedule.
    weight_decay: Muon's decoupled weight decay (0.1).
    labels: the routing (see above).
    adam_learning_rate: AdamW's learning rate; defaults to ``learning_rate``.
    adam_b1, adam_b2, adam_eps: AdamW moments (Moonlight: 0.9, 0.95, 1e-8).
    adam_weight_decay: AdamW's decoupled weight decay; defaults to ``weight_decay``.
    beta, nesterov, ns_steps, ns_coeffs, ns_method, ns_normalize, ns_restarts, ns_batch, eps,
      compute_dtype, mu_dtype, rms_match,
      rms_scale, matrix_axes, shard_orthogonalization: Muon's options (see ``scale_by_muon``).
  """
  adam_wd = weight_decay if adam_weight_decay is None else adam_weight_decay
  check_number("adam_weight_decay", adam_wd, low=0.0)
  transforms = {
      MUON: muon(
          learning_rate,
          weight_decay=weight_decay,
          beta=beta,
          nesterov=nesterov,
          ns_steps=ns_steps,
          ns_coeffs=ns_coeffs,
          ns_method=ns_method,
          ns_normalize=ns_normalize,
          ns_restarts=ns_restarts,
          ns_batch=ns_batch,
          eps=eps,
          compute_dtype=compute_dtype,
          mu_dtype=mu_dtype,
          rms_match=rms_match,
          rms_scale=rms_scale,
          matrix_axes=matrix_axes,
          shard_orthogonalization=shard_orthogonalization,
      ),
      ADAM: optax.adamw(
          learning_rate if adam_learning_rate is None else adam_learning_rate,
          b1=adam_b1,
          b2=adam_b2,
          eps=adam_eps,
          weight_decay=adam_wd,
          mu_dtype=mu_dtype,
      ),
  }
  return optax.partition(transforms, muon_labels if labels is None else labels)
