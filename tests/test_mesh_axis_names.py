"""Mesh axis names in NNX metadata (Tunix's ``("fsdp", "tp")``) are not logical names; a
``matrix_axes`` callable sees no ``optax.MaskedNode`` leaves (``docs/matrix-axes.md``)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import muonclip_jax as mc

E, D, F = 4, 8, 12


class TunixLikeMoE(nnx.Module):   # mesh axis names where logical names belong, as Tunix's models
  def __init__(self, rngs):
    init = jax.nn.initializers.normal(1.0)
    param = lambda shape, names: nnx.Param(init(rngs.params(), shape), sharding=names, eager_sharding=False)
    self.embedder = param((32, D), ("tp", "fsdp"))
    self.q = param((D, 2, 4), ("fsdp", "tp", None))
    self.wi = param((E, D, F), (None, "fsdp", "tp"))


def _axes(p):   # a natural function of the leaves (x.ndim), boxes as leaves
  pick = lambda x: (mc.MatrixAxes((-2,), (-1,)) if x.ndim == 3 and x.shape[0] == E
                    else mc.MatrixAxes((0,), (1, 2)) if x.ndim == 3 else None)
  return jax.tree.map(pick, p, is_leaf=lambda x: isinstance(x, nnx.Variable))


def test_mesh_names_do_not_refuse_per_expert_axes_and_no_masked_nodes():
  model = TunixLikeMoE(nnx.Rngs(0))
  before = {k: np.asarray(v) for k, v in nnx.state(model, nnx.Param).to_pure_dict().items()}
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no names disagree: "fsdp"/"tp" are read as None
    opt_fn = nnx.Optimizer(model, mc.muon_adamw(1.0, weight_decay=0.0, matrix_axes=_axes), wrt=nnx.Param)
  # mesh names say nothing: undeclared 3-D kernels are the usual ValueError naming the path
  with pytest.raises(ValueError, match=r"^q: Muon needs to know which axes"):
    nnx.Optimizer(model, mc.muon_adamw(1.0), wrt=nnx.Param)
  grads = jax.tree.map(lambda x: jnp.cos(3.0 * x), nnx.state(model, nnx.Param))
  opt_fn.update(model, grads)
  after = nnx.state(model, nnx.Param).to_pure_dict()
  g = np.asarray(grads.to_pure_dict()["wi"])
  for e in range(E):   # each expert its own Newton-Schulz polar factor
    upd = (before["wi"][e] - np.asarray(after["wi"][e])) / (0.2 * np.sqrt(max(D, F)))
    ns = np.asarray(mc.newton_schulz(jnp.asarray(g[e]), steps=None, coeffs="polar_express_4"))
    np.testing.assert_allclose(upd, ns, atol=2e-5)


def test_the_mesh_axis_rule_and_its_limits():
  """Mesh axis names read as no name: the usual ones, a tuple of them (one axis sharded over two), and
  the axes of the mesh in context; names the library reads (``expert``, ``stage``, ``model``,
  ``vocab``, ``*_layers``) keep their logical reading even where a mesh has an axis of that name."""
  from muonclip_jax._util import logical_names

  box = lambda names, shape=(4, 8, 12): nnx.Param(jnp.zeros(shape), sharding=names, eager_sharding=False)  # noqa: E731
  assert logical_names(box((("fsdp", "sp"), "tp", None))) is None
  assert logical_names(box(("expert", "fsdp", "tp"))) == ("expert", None, None)
  assert logical_names(box(("stage", "embed", "mlp"))) == ("stage", "embed", "mlp")
  assert logical_names(box(("moe_layers", "model", "tp"))) == ("moe_layers", "model", None)
  mesh = jax.make_mesh((2, 4), ("vocab", "replica_x"))
  replica, vocab = box(("replica_x", "embed", "mlp")), box(("vocab", "embed"), (4, 8))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    assert logical_names(replica) == (None, "embed", "mlp")  # an axis of the mesh in context
    assert logical_names(vocab) == ("vocab", "embed")
  assert logical_names(replica) == ("replica_x", "embed", "mlp")  # outside it: a name
