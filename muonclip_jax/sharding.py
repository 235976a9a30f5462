"""Sharded MuonClip: logical-axis rules and shardings for a mesh.

MuonClip runs under ``jax.jit`` with ``NamedSharding``s on a ``Mesh`` (the pjit model):
parameters, optimizer state and batch carry shardings, XLA partitions the program. This
module gives

* ``DEFAULT_RULES``: logical axis names of the library's modules (and of
  ``examples/mla_lm.py``, and MaxText's expert names) -> mesh axes ``data``, ``fsdp``,
  ``model``, ``expert``; ``logical_to_spec``
  applies them to one array, ``param_shardings`` to a parameter tree, ``batch_shardings``
  to a batch, ``state_shardings``/``init_state`` give optimizer state the shardings of the
  parameters each leaf belongs to (never replicated), ``jit_train_step`` jits a train step
  with them;
* ``orthogonalize_sharded``: Newton–Schulz with each matrix orthogonalized whole on one
  device, balanced by FLOPs over all matrices, or the largest split over a device group
  (planned over all the matrices, then run in one ``shard_map``), used by ``scale_by_muon(shard_orthogonalization=...)``
  (and ``muon``, ``muon_adamw``, ``muonclip``). See ``docs/sharding.md``.

Multi-host: nothing here is host-specific; ``jax.distributed.initialize`` before anything
else, a mesh over ``jax.devices()`` (all processes' devices) and the same program on every
process. See ``docs/sharding.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._util import check_bool, EXPERT_NAMES, key_name, path_str, strip_value
from ._orthogonalize import entry_axes, mesh_of
from ._orthogonalize import orthogonalize_sharded as orthogonalize_sharded
from ._clip import check_opt_state

__all__ = ["DEFAULT_RULES", "batch_shardings", "init_state", "jit_train_step", "logical_to_spec",
           "orthogonalize_sharded", "param_shardings", "state_shardings"]

MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]

# Logical axis name -> mesh axes, tried in order (several rules may name the same logical
# axis: the first whose mesh axes exist, are unused by the array's other dimensions and
# divide the dimension wins; None replicates). See docs/sharding.md for the table.
DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", ("data", "fsdp", "expert")),  # activations/batch: data parallel (FSDP and expert devices too)
    ("batch", ("data", "fsdp")),  # (a batch that the expert axis does not divide further)
    ("vocab", "model"),  # embedding rows, LM-head columns
    ("heads", "model"),  # attention heads (head-major columns of wq/wq_b/wkv_b, rows of wo)
    ("kv_heads", "model"),  # GQA key/value heads
    ("mlp", "model"),  # MLP hidden units
    # the expert axis of expert stacks (E, [layers,] in, out), every spelling of the one list of logical names
    # (MaxText's "exp", "expert", "experts", ...): expert parallelism, each device holds whole experts
    *((name, "expert") for name in sorted(EXPERT_NAMES)),
    ("embed", "fsdp"),  # the model width: FSDP shards every large matrix along it
    ("embed_no_exp", "fsdp"),  # MaxText's width axis of its expert kernels
    ("q_lora", "fsdp"),  # MLA query latent (wq_a columns, wq_b rows)
    ("kv_lora", "fsdp"),  # MLA key/value latent (wkv_a columns, wkv_b rows)
    ("layers", None),  # nn.scan's stacked-layer axis
    ("norm", None),  # norm scales: small, replicated
    ("length", None),  # sequence
)

# A dimension named for experts (EXPERT_NAMES) must be split by its mesh axis when the mesh has
# it (expert parallelism keeps whole experts on each device; replicating every expert on every
# device instead is refused, not done silently).

# ----------------------------------------------------------------------------- rules


def _spec_entry(axes: tuple[str, ...]) -> MeshAxes:
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Rules = DEFAULT_RULES) -> P:
  """The ``PartitionSpec`` of an array of ``shape`` whose dimensions are named ``names``.

  For each dimension, in order, the rules for its logical name are tried in order; a rule
  applies when its mesh axes (those present in ``mesh`` with size > 1; a rule left with
  none is skipped) are not used by an earlier dimension and their sizes' product divides
  the dimension. A rule with mesh axes ``None`` replicates the dimension; a name without
  an applicable rule, and a ``None`` name, is replicated too. So a mesh without an
  ``fsdp`` axis simply leaves ``embed`` unsharded, and an MLA ``wkv_a`` kernel
  ``("embed", "kv_lora")`` shards ``embed`` over ``fsdp`` and leaves ``kv_lora`` whole.
  An expert axis (``"exp"``, ``"expert"``, ``"experts"``) whose rule's mesh axes are in the
  mesh but do not divide the number of experts is a ValueError instead (pick an expert axis
  size that divides it, or map the name to ``None`` in ``rules`` to replicate the experts).

  Args:
    names: one logical name (or None) per leading dimension (``len(names) <= len(shape)``;
      missing trailing names are None), e.g. a Flax logical ``PartitionSpec``.
    shape: the array's shape.
    mesh: the device mesh.
    rules: ``(logical name, mesh axes)`` pairs (``DEFAULT_RULES``).

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import AbstractMesh, Mesh
    >>> from muonclip_jax import sharding
    >>> mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "model"))  # axis sizes only, no devices needed
    >>> sharding.logical_to_spec(("embed", "mlp"), (1024, 4096), mesh)  # an MLP kernel: FSDP x tensor parallel
    P('fsdp', 'model')
    >>> sharding.logical_to_spec(("batch", "length"), (32, 128), mesh)
    P(('data', 'fsdp'), None)
    >>> sharding.logical_to_spec(("embed", "heads"), (1024, 5), mesh)  # 5 heads do not split over 2 devices
    P('fsdp', None)
    >>> one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "model"))
    >>> sharding.logical_to_spec(("embed", "mlp"), (1024, 4096), one)  # axes of size 1 are not used
    P(None, None)
    >>> experts = AbstractMesh((4, 2), ("expert", "fsdp"))  # expert parallelism x FSDP
    >>> sharding.logical_to_spec(("exp", "embed_no_exp", "mlp"), (64, 1024, 4096), experts)
    P('expert', 'fsdp', None)
  """
  names = tuple(names)
  shape = tuple(int(s) for s in shape)
  if len(names) > len(shape):
    raise ValueError(f"logical_to_spec: {len(names)} names {names} for an array of shape {shape}")
  used: set[str] = set()
  out: list[MeshAxes] = []
  for dim, name in zip(shape, names + (None,) * (len(shape) - len(names))):
    chosen: tuple[str, ...] = ()
    if name is not None:
      if not isinstance(name, str):
        raise TypeError(f"logical_to_spec: logical names must be strings or None, got {name!r} in {names}")
      for logical, target in rules:
        if logical != name:
          continue
        if target is None:
          break
        axes = tuple(a for a in entry_axes(target) if mesh.shape.get(a, 1) > 1)
        size = math.prod(mesh.shape[a] for a in axes)
        if axes and not used.intersection(axes) and dim % size == 0:
          chosen = axes
          break
        if axes and name in EXPERT_NAMES and dim % size:
          raise ValueError(
              f"logical_to_spec: {dim} experts (axis {name!r} of shape {shape}) do not split over mesh axes "
              f"{axes} of {size} devices; use an expert axis whose size divides {dim}, or rules mapping "
              f"{name!r} to None to replicate the experts")
    used.update(chosen)
    out.append(_spec_entry(chosen))
  return P(*out)


def _is_names(x: Any) -> bool:
  return x is None or isinstance(x, P) or (
      isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x))


def param_shardings(params: Any, mesh: Mesh, *, logical_axes: Any = None,
                    rules: Rules = DEFAULT_RULES) -> Any:
  """``NamedSharding``s of the parameters on ``mesh`` from their logical axis names.

  Args:
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``s), or Flax boxed parameters
      (``nn.with_logical_partitioning``), whose names are then read from the boxes.
    mesh: the device mesh, with axes among ``data``, ``fsdp``, ``model`` for the default
      rules (missing axes are simply not used).
    logical_axes: a pytree with the parameters' paths whose leaves are logical
      ``PartitionSpec``s or tuples of names (e.g. ``nn.get_partition_spec`` of the boxed
      abstract variables; ``examples/mla_lm.logical_axes``). Matched by path; a parameter
      without an entry is replicated, an entry that names no parameter is a ValueError.
    rules: see ``logical_to_spec``.

  Returns:
    A pytree of ``NamedSharding`` with the structure of the (unboxed) parameters.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, flax.linen as nn
    >>> from jax.sharding import AbstractMesh, Mesh
    >>> from muonclip_jax import sharding
    >>> params = {"mlp": {"kernel": nn.Partitioned(jnp.ones((64, 256)), names=("embed", "mlp"))},
    ...           "norm": {"scale": nn.Partitioned(jnp.ones((64,)), names=("norm",))}}
    >>> sizes = AbstractMesh((2, 2, 2), ("data", "fsdp", "model"))  # the specs an 8-device mesh would get
    >>> jax.tree.map(lambda s: s.spec, sharding.param_shardings(params, sizes))
    {'mlp': {'kernel': P('fsdp', 'model')}, 'norm': {'scale': P(None,)}}
    >>> mesh = Mesh(np.array(jax.devices()).reshape(1, 1, -1), ("data", "fsdp", "model"))  # the devices at hand
    >>> shardings = sharding.param_shardings(params, mesh)
    >>> placed = jax.device_put(nn.unbox(params), shardings)
    >>> placed["mlp"]["kernel"].sharding == shardings["mlp"]["kernel"]
    True
  """
  if logical_axes is None:
    import flax.linen as nn  # noqa: PLC0415 (only boxed params need Flax)

    logical_axes = nn.get_partition_spec(params)
    params = nn.unbox(params)
  table = {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(logical_axes, is_leaf=_is_names)[0]}

  def one(path, x):
    names = table.get(path_str(path)) or ()
    try:
      return NamedSharding(mesh, logical_to_spec(tuple(names), np.shape(x), mesh, rules))
    except ValueError as e:
      raise ValueError(f"param_shardings: {path_str(path)}: {e}") from None

  paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  known = set(paths)
  stray = sorted(k for k, names in table.items() if names and k not in known)
  if stray:
    raise ValueError(f"param_shardings: logical_axes names {len(stray)} path(s) that are no parameter (a typo, or "
                     f"the names of another tree?): {stray[:5]}; the parameters' paths include {paths[:5]}")
  return jax.tree_util.tree_map_with_path(one, params)


def batch_shardings(batch: Any, mesh: Mesh, *, rules: Rules = DEFAULT_RULES) -> Any:
  """Shardings of a batch pytree whose leaves' leading axis is the logical ``"batch"``.

  With the default rules the batch is split over ``data``, ``fsdp`` and ``expert`` (every
  device of a data x fsdp x model mesh sees ``B / (data * fsdp)`` examples; ``model``
  replicas share theirs; expert-parallel devices are data-parallel for everything but their
  experts). A batch size not divisible by the product is split over ``data`` and ``fsdp``
  alone, and one not divisible by that falls back to replication.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import AbstractMesh, Mesh
    >>> from muonclip_jax import sharding
    >>> sizes = AbstractMesh((2, 2, 2), ("data", "fsdp", "model"))
    >>> batch = {"tokens": jnp.zeros((8, 16), jnp.int32)}
    >>> sharding.batch_shardings(batch, sizes)["tokens"].spec  # 8 examples over data x fsdp
    P(('data', 'fsdp'), None)
    >>> sharding.batch_shardings({"tokens": jnp.zeros((3, 16), jnp.int32)}, sizes)["tokens"].spec  # 3 over 4: no
    P(None, None)
    >>> mesh = Mesh(np.array(jax.devices()).reshape(1, 1, -1), ("data", "fsdp", "model"))
    >>> jax.device_put(batch, sharding.batch_shardings(batch, mesh))["tokens"].shape
    (8, 16)
  """
  return jax.tree.map(lambda x: NamedSharding(mesh, logical_to_spec(("batch",), np.shape(x), mesh, rules)), batch)


def _names(path: Sequence[Any]) -> tuple[str, ...]:
  """The path's names as strings, without the trailing ``value`` of boxed leaves."""
  return tuple(str(key_name(k)) for k in strip_value(path))


def _per_matrix(shape: tuple[int, ...], param_shape: tuple[int, ...]) -> bool:
  """A state leaf of one value per stacked matrix: the parameter's rank, its size or 1 on each axis."""
  return (len(shape) == len(param_shape) and shape != param_shape and any(n > 1 for n in shape)
          and all(n in (1, m) for n, m in zip(shape, param_shape)))


def state_shardings(state: Any, params: Any, param_shardings: Any) -> Any:
  """Shardings for an optimizer state: each leaf gets its parameter's sharding.

  A state leaf belongs to a parameter when the parameter's path is a suffix of the leaf's
  path and the shapes agree (the momentum at ``.../mu/layers/attn/wq_b/kernel`` belongs
  to ``layers/attn/wq_b/kernel``; optax's ``partition``, ``chain``, ``MultiSteps`` and
  ``inject_hyperparams`` only add prefixes). The longest such suffix wins. Every other leaf
  (step counts, hyperparameters, the running ``max_logits`` of ``multi_steps``) is small
  and replicated. Muon's ``mu_scale`` of a stacked leaf (one scale per layer or expert: the
  parameter's rank, size 1 on its matrix axes) is sharded as the parameter's stacked axes are.

  Args:
    state: the state or its abstract version (``jax.eval_shape(opt.init, params)``).
    params: the parameters (or their ``ShapeDtypeStruct``s).
    param_shardings: the parameters' shardings (``param_shardings(params, mesh, ...)``).

  Returns:
    A pytree of ``NamedSharding`` with the structure of ``state``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from jax.sharding import AbstractMesh
    >>> from muonclip_jax import sharding
    >>> sizes = AbstractMesh((2, 2, 2), ("data", "fsdp", "model"))
    >>> params = {"mlp": {"kernel": jnp.ones((64, 256))}, "norm": {"scale": jnp.ones((64,))}}
    >>> p_sh = sharding.param_shardings(params, sizes, logical_axes={"mlp": {"kernel": ("embed", "mlp")}})
    >>> state = jax.eval_shape(optax.adamw(1e-3).init, params)
    >>> s_sh = sharding.state_shardings(state, params, p_sh)
    >>> s_sh[0].mu["mlp"]["kernel"].spec, s_sh[0].nu["mlp"]["kernel"].spec, s_sh[0].count.spec
    (P('fsdp', 'model'), P('fsdp', 'model'), P())
  """
  mesh = mesh_of(param_shardings)
  flat_p, treedef = jax.tree_util.tree_flatten_with_path(params)

  flat_s = treedef.flatten_up_to(param_shardings)
  table = {_names(p): (tuple(np.shape(x)), s) for (p, x), s in zip(flat_p, flat_s)}
  replicated = NamedSharding(mesh, P())

  def one(path, leaf):
    names, shape = _names(path), tuple(np.shape(leaf))
    for k in range(len(names)):
      hit = table.get(names[k:])
      if hit is not None and hit[0] == shape:
        return hit[1]
      if hit is not None and _per_matrix(shape, hit[0]):  # Muon's mu_scale of a stack: its stacked axes
        spec = tuple(hit[1].spec) + (None,) * (len(shape) - len(hit[1].spec))
        return NamedSharding(mesh, P(*(e if n > 1 else None for e, n in zip(spec, shape))))
    return replicated

  return jax.tree_util.tree_map_with_path(one, state)


def init_state(optimizer: Any, params: Any, param_shardings: Any) -> Any:
  """``optimizer.init(params)`` under ``jit`` with ``state_shardings`` as output shardings.

  ``params`` should already carry ``param_shardings`` (``jax.device_put(params, param_shardings)``).
  Refuses, like ``check_opt_state``, an optimizer with a transform after its QK-Clip.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, muonclip_jax as mc
    >>> from jax.sharding import Mesh
    >>> from muonclip_jax import sharding
    >>> mesh = Mesh(np.array(jax.devices()).reshape(1, 1, -1), ("data", "fsdp", "model"))
    >>> shardings = sharding.param_shardings({"w": jnp.ones((8, 16))}, mesh, logical_axes={"w": ("embed", "mlp")})
    >>> params = jax.device_put({"w": jnp.ones((8, 16))}, shardings)
    >>> state = sharding.init_state(mc.muon(0.01), params, shardings)
    >>> state[0].mu["w"].shape, state[0].mu["w"].sharding == shardings["w"]  # the momentum, laid out as w
    ((8, 16), True)
    >>> clip = mc.qk_clip_transform(100.0, layout=mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=4))
    >>> sharding.init_state(optax.chain(clip, optax.scale(0.5)), params, shardings)  # the clip must come last
    Traceback (most recent call last):
    ...
    ValueError: init_state: ...
  """
  abstract = jax.eval_shape(optimizer.init, params)
  check_opt_state(abstract, caller="init_state")  # e.g. no transform after the QK-Clip
  return jax.jit(optimizer.init, out_shardings=state_shardings(abstract, params, param_shardings))(params)


def jit_train_step(step: Callable, param_shardings: Any, state_shardings: Any, batch_shardings: Any, *,
                   donate: bool = False) -> Callable:
  """``jax.jit`` of ``step(params, opt_state, batch, rng=None) -> (params, opt_state, metrics)``.

  In and out shardings of params and state are the given ones, so that every step returns
  them in the layout they came in (without ``out_shardings`` XLA chooses output layouts by
  propagation, and may, e.g., shard a replicated norm scale); metrics and the optional
  ``rng`` (dropout key of ``make_train_step``) are replicated. The returned function takes
  ``(params, opt_state, batch)`` or ``(params, opt_state, batch, rng)``.

  Args:
    step: e.g. ``muonclip_jax.training.make_train_step(...)``.
    param_shardings: ``param_shardings(params, mesh, ...)``.
    state_shardings: ``state_shardings(...)`` (or ``jax.tree.map(lambda x: x.sharding,
      init_state(...))``).
    batch_shardings: ``batch_shardings(batch, mesh)``.
    donate: donate params and state (their buffers are reused for the outputs); a ``bool``
      (anything else is a TypeError).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, muonclip_jax as mc
    >>> from jax.sharding import Mesh
    >>> from muonclip_jax import sharding, training
    >>> mesh = Mesh(np.array(jax.devices()).reshape(1, 1, -1), ("data", "fsdp", "model"))
    >>> layout = mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=4)
    >>> params = {"attn": {"wq": {"kernel": jnp.ones((8, 8))}, "wk": {"kernel": jnp.ones((8, 8))}}}
    >>> names = {"attn": {"wq": {"kernel": ("embed", "heads")}, "wk": {"kernel": ("embed", "kv_heads")}}}
    >>> p_sh = sharding.param_shardings(params, mesh, logical_axes=names)
    >>> params = jax.device_put(params, p_sh)
    >>> def loss_fn(params, x):  # one attention layer's scaled logits, and its per-head maxima
    ...   q = (x @ params["attn"]["wq"]["kernel"]).reshape(-1, 2, 4)
    ...   k = (x @ params["attn"]["wk"]["kernel"]).reshape(-1, 2, 4)
    ...   logits = jnp.einsum("qhd,khd->hqk", q, k) / 2.0
    ...   return jnp.mean(jax.nn.logsumexp(logits, axis=-1)), {"attn": {"max_logits": logits.max(axis=(1, 2))}}
    >>> opt = mc.muonclip(0.01, layout=layout, qk_clip_threshold=10.0)
    >>> opt_state = sharding.init_state(opt, params, p_sh)
    >>> s_sh = sharding.state_shardings(opt_state, params, p_sh)
    >>> batch = jnp.ones((4, 8))
    >>> step = sharding.jit_train_step(training.make_train_step(loss_fn, opt), p_sh, s_sh,
    ...                                sharding.batch_shardings(batch, mesh))
    >>> params, opt_state, metrics = step(params, opt_state, batch)
    >>> params["attn"]["wq"]["kernel"].sharding == p_sh["attn"]["wq"]["kernel"]  # back in its own layout
    True
    >>> metrics["max_logits"]["attn"], int(metrics["num_clipped"]), float(metrics["min_gamma"])  # gamma 10 / 128
    (Array([128., 128.], dtype=float32), 2, 0.078125)
  """
  check_bool("jit_train_step: donate", donate)
  mesh = mesh_of(param_shardings)
  replicated = NamedSharding(mesh, P())
  # jit applies in_shardings to positional arguments only: rng is passed positionally
  # (None, an empty pytree, when there is no key).
  def positional(params, opt_state, batch, rng):
    return step(params, opt_state, batch) if rng is None else step(params, opt_state, batch, rng)

  jitted = jax.jit(positional,
                   in_shardings=(param_shardings, state_shardings, batch_shardings, replicated),
                   out_shardings=(param_shardings, state_shardings, replicated),
                   donate_argnums=(0, 1) if donate else ())

  def train_step(params: Any, opt_state: Any, batch: Any, rng: Any = None):
    return jitted(params, opt_state, batch, rng)

  return train_step
