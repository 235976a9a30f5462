"""NumPy reference of a Moonlight-style Muon step (arXiv 2502.16982, Algorithm 1), in float64."""

import numpy as np


def np_newton_schulz(g, coeffs=(3.4445, -4.7750, 2.0315), steps=5, eps=1e-7):
  a, b, c = coeffs
  x = np.asarray(g, np.float64)
  tall = x.shape[0] > x.shape[1]
  if tall:
    x = x.T
  x = x / (np.linalg.norm(x) + eps)
  for _ in range(steps):
    A = x @ x.T
    x = a * x + (b * A + c * A @ A) @ x
  return x.T if tall else x


def np_muon_step(param, grad, buf, *, lr, weight_decay=0.1, momentum=0.95, nesterov=True):
  """One Moonlight Muon step on an (in, out) kernel; returns (new_param, new_buf)."""
  buf = momentum * buf + grad
  g = grad + momentum * buf if nesterov else buf
  u = np_newton_schulz(g)
  u = u * 0.2 * np.sqrt(max(param.shape))
  param = param * (1 - lr * weight_decay) - lr * u
  return param, buf


def ns_test_matrices(seed, shapes):
  """For each shape: a Gaussian matrix, then one with its singular values set to 1 .. 1e-6."""
  rng = np.random.default_rng(seed)
  for shape in shapes:
    x = rng.standard_normal(shape)
    yield x
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    yield (u * np.logspace(0, -6, min(shape))) @ vt  # condition number 1e6


def svd_response(x, y):
  """``(U^T y V, s / ||x||_F)`` for the SVD ``x = U diag(s) V^T``: p(s) along each direction."""
  u, s, vt = np.linalg.svd(x, full_matrices=False)
  return u.T @ y @ vt.T, s / np.linalg.norm(x)
