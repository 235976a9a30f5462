"""The premise of ``_exactness.ULPS``: one float32 evaluation of an update is within
``ULPS / 2`` ulps (of its largest entry) of the same update evaluated in float64, so any two
float32 evaluations (two programs, two machines) are within ``ULPS``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import muonclip_jax as mc
from _exactness import ULPS, assert_same_math, same_math_atol

SHAPES = [(12, 64), (64, 12), (3, 16, 40), (24, 24)]  # wide (Gram under "auto"), tall, a stack, square


def _ulps_of_max(got, exact) -> float:
  got, exact = np.asarray(got, np.float64), np.asarray(exact, np.float64)
  return float(np.abs(got - exact).max() / np.abs(exact).max() / np.finfo(np.float32).eps)


def _both(fn, x):
  """``fn`` of ``x`` in float32, and in float64 (the iteration in float64: ``newton_schulz``
  normalizes in float32, then iterates in the input's dtype)."""
  got = jax.jit(fn)(jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), x))
  with jax.enable_x64(True):
    exact = jax.jit(fn)(jax.tree.map(lambda v: jnp.asarray(v, jnp.float64), x))
    exact = jax.tree.map(np.asarray, exact)
  assert all(v.dtype == np.float64 for v in jax.tree.leaves(exact))
  return got, exact


@pytest.mark.parametrize("coeffs", ["muon", "polar_express", "polar_express_4", "deepseek_v4"])
@pytest.mark.parametrize("method", ["standard", "auto"])
def test_one_float32_newton_schulz_is_within_half_the_bound_of_float64(coeffs, method):
  """The standard iteration on Gaussian and ill-conditioned inputs (measured: at most 43
  ulps); the default ``"auto"`` (Gram where the aspect is >= 2) on Gaussian ones (at most
  47). The Gram iteration squares the condition number: on inputs whose columns decay to
  1e-3, and on square Gaussian ones, it measures 100-3000 ulps, so the tests that compare
  such results state their own tolerance."""
  rng = np.random.default_rng(0)
  ns = functools.partial(mc.newton_schulz, steps=None, coeffs=coeffs, method=method)  # one program per shape
  for shape in SHAPES:
    for decay in ((1.0, 1e-3) if method == "standard" else (1.0,)):
      x = rng.standard_normal(shape) * np.geomspace(1.0, decay, shape[-1])
      got, exact = _both(ns, x)
      assert _ulps_of_max(got, exact) <= ULPS / 2, (shape, decay, _ulps_of_max(got, exact))


@pytest.mark.parametrize("blocks", ["head", "group:2", "matrix"])
def test_one_float32_per_head_update_is_within_half_the_bound_of_float64(blocks):
  """``scale_by_muon``'s defaults on head blocks (the cases whose programs differed by
  machine), a 3-D DenseGeneral kernel and a 2-D one."""
  rng = np.random.default_rng(4)
  g = {"general": rng.standard_normal((12, 8, 8)), "flat": rng.standard_normal((12, 64))}
  layout = mc.GQALayout(8, 8, 8, query="general", key="flat", value=None, out=None)
  opt = mc.scale_by_muon(layout=layout, muon_blocks=blocks)

  def update(x):
    tree = {n: {"kernel": x[n]} for n in x}
    return opt.update(tree, opt.init(tree))[0]

  got, exact = _both(update, g)
  for n in g:
    assert _ulps_of_max(got[n]["kernel"], exact[n]["kernel"]) <= ULPS / 2, n


def test_the_rule_keeps_the_power_to_tell_a_wrong_result():
  """The tolerance passes a re-rounded copy and fails what the tests guard against: a clip
  factor 1e-3 away from 1, one head's block swapped for another's, a transposed block."""
  x = np.asarray(mc.newton_schulz(jnp.asarray(np.random.default_rng(1).standard_normal((16, 32)), jnp.float32)))
  noisy = x + same_math_atol(x) * 0.9 * np.sign(np.random.default_rng(2).standard_normal(x.shape))
  assert_same_math(noisy.astype(np.float32), x)
  for wrong in (x * (1 - 1e-3), x[:, ::-1], np.concatenate([x[:, 16:], x[:, :16]], 1)):
    with pytest.raises(AssertionError):
      assert_same_math(wrong, x)
  with pytest.raises(AssertionError):  # an infinity where the other has a number
    assert_same_math(np.where(x > 0.2, np.inf, x), x)
