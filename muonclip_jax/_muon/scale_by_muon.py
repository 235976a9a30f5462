"""``scale_by_muon``: momentum, Newton–Schulz orthogonalization and update-RMS matching.

Muon (Keller Jordan 2024) as used by Moonlight (arXiv 2502.16982, Algorithm 1) and Kimi K2
(arXiv 2507.20534, Algorithm 1):

  M_t = mu M_{t-1} + G_t
  O_t = NewtonSchulz(G_t + mu M_t)        (Nesterov; NewtonSchulz(M_t) without it)
  O_t <- r(fan_in, fan_out) * O_t

with the RMS factor ``r`` of ``rms_match``: Moonlight's ``rms_scale * sqrt(max(fan_in,
fan_out))`` (rms_scale = 0.2 makes the update RMS match AdamW's, so AdamW hyperparameters
transfer), Keller Jordan's ``sqrt(max(1, fan_out / fan_in))``, or 1.

Finite gradients never overflow: a constant gradient of 2e37 makes ``M_t`` pass
float32's largest (it tends to ``G / (1 - mu)``), and ``G + mu M_t`` does from ``G`` ~ 1.8e38.
So each matrix's momentum is stored as ``M_t / s_t`` (``ScaleByMuonState``), ``s_t`` a power
of two >= 1 chosen at each step (``momentum_scale.rescale``, from the matrix's largest entries;
one per layer or expert of a stack, so a neighbour's size never moves it) so that ``M_t / s_t``
stays below about half of the dtype's largest and the direction ``(G_t + mu M_t) / s_t``
below about three quarters (the bound is in ``rescale``). Dividing by a power of two is
exact, and ``NewtonSchulz`` is scale-invariant (up to its ``eps``, negligible there: ``s_t > 1``
only when the direction's entries are near float32's largest, or float16's), so the update is
that of the true ``M_t``. While ``s_t = 1`` (every run whose momentum fits, and again once a
large one decays) the arithmetic is the plain formula above: its operations, with at most an
exact multiplication by 1, so it rounds as the unscaled formula does.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from .._util import (check_bool, check_float_dtype, check_number, is_box, is_int, MatrixAxesSpec, MetadataMemo,
                     path_str, skip_frozen_leaves)
from .._orthogonalize import (check_target, orthogonalize_leaves, orthogonalize_leaves_sharded, policy,
                              resolve_coeffs, resolve_options)
from .block_orthogonalize import orthogonalize_blocks
from .layout_matrices import check_blocks, muon_blocks_lookup
from .blocks import piece_dims
from .momentum_scale import in_units, rounded, rescale, scale_dtype, scale_shape
from .._clip import LayoutSpec, report_layout

RMS_MODES = ("moonlight", "keller", None)


class ScaleByMuonState(NamedTuple):
  """State of ``scale_by_muon``: the momentum of each leaf, stored divided by a power of two.

  The momentum ``M_t`` of a leaf is ``mu * mu_scale``, one scale per matrix (``mu_scale`` has
  shape ``()`` for one matrix, ``(experts, 1, 1)`` for an expert stack ``(experts, in, out)``:
  ``momentum_scale.scale_shape``; never boxed). ``mu_scale`` is 1 unless ``M_t`` or the
  update direction would overflow ``mu``'s or the gradient's dtype (finite gradients near
  float32's largest, or a momentum past float16's 65504): then it is the power of two that
  keeps them in range, and it returns to 1 once the momentum fits again (see ``rescale``).
  Non-finite gradients make ``mu`` non-finite for good (guard with ``optax.apply_if_finite``).

  Example:
    >>> import jax.numpy as jnp, muonclip_jax as mc
    >>> opt = mc.scale_by_muon(beta=0.9)
    >>> state = opt.init({"w": jnp.zeros((2, 3))})
    >>> state.mu["w"]  # the momentum starts at zero
    Array([[0., 0., 0.],
           [0., 0., 0.]], dtype=float32)
    >>> grads = {"w": jnp.ones((2, 3))}
    >>> _, state = opt.update(grads, state)
    >>> _, state = opt.update(grads, state)
    >>> state.mu["w"][0]  # M_2 = 0.9 M_1 + G_2 = 0.9 + 1
    Array([1.9, 1.9, 1.9], dtype=float32)
    >>> state.mu_scale["w"]  # no scaling needed: mu is the momentum
    Array(1., dtype=float32)
    >>> _, state = opt.update({"w": jnp.full((2, 3), 3e38)}, state)  # near float32's largest
    >>> state.mu_scale["w"], state.mu["w"][0, 0] * state.mu_scale["w"] / 3e38  # M_3 = 0.9 M_2 + G_3
    (Array(8., dtype=float32), Array(1., dtype=float32))
    >>> mc.scale_by_muon(mu_dtype=jnp.bfloat16).init({"w": jnp.zeros((2, 3))}).mu["w"].dtype
    dtype(bfloat16)
  """

  mu: optax.Updates  # M_t / mu_scale; shapes of the params, dtype mu_dtype (default: the params')
  mu_scale: optax.Updates  # powers of two >= 1, float32 (float64 for float64 momentum): shape () for a leaf
  # of one matrix; for a stack (layers, experts) the leaf's rank, its stacked sizes and 1 elsewhere


def unboxed(tree: Any) -> Any:
  """``tree`` with each box (Linen ``nn.Partitioned``, NNX variable) replaced by what it holds."""
  def content(x):
    inside = jax.tree.leaves(x)
    return inside[0] if inside else optax.MaskedNode()
  return jax.tree.map(lambda x: content(x) if is_box(x) else x, tree, is_leaf=is_box)


def _leaves_at(tree: Any, paths: list[str], name: str) -> tuple[list, Any]:
  """The arrays of a state tree, in the order of the updates' ``paths`` (checked), and its treedef."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  got = [path_str(p) for p, _ in flat]
  if got != paths:
    missing, extra = sorted(set(paths) - set(got))[:3], sorted(set(got) - set(paths))[:3]
    raise ValueError(f"scale_by_muon: the state's {name} does not hold the leaves of the updates (missing "
                     f"{missing}, unexpected {extra}): a state from another model, or from before mu_scale "
                     "(muonclip_jax.upgrade_opt_state brings a saved state forward)")
  return [x for _, x in flat], treedef


def rms_factor(rms_match: str | None, rms_scale: Any, fan_in: int, fan_out: int) -> Any:
  """The update-RMS factor ``r(fan_in, fan_out)`` of ``scale_by_muon``."""
  if rms_match == "moonlight":
    return rms_scale * math.sqrt(max(fan_in, fan_out))
  if rms_match == "keller":
    return math.sqrt(max(1.0, fan_out / fan_in))
  return 1.0


def scale_by_muon(
    beta: float = 0.95,
    *,
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
) -> optax.GradientTransformation:
  """Muon's direction: orthogonalized (Nesterov) momentum with update-RMS matching.

  Apply it to hidden weight matrices only (see ``muon_adamw`` for a whole model). Each leaf
  is a matrix, or a stack of matrices given by ``matrix_axes``; stacked matrices (e.g.
  layers under ``nn.scan``, the experts of a mixture-of-experts layer) are orthogonalized
  one by one, each with its own RMS factor, never as one big matrix.

  The default orthogonalization is four ``"polar_express_4"`` steps on the input scaled by
  its Schatten-4 norm, with Gram Newton–Schulz on matrices whose longer side is at least
  twice the shorter (``ns_method="auto"``); ``ns_coeffs="muon", ns_steps=5,
  ns_method="standard"`` gives Keller Jordan's five steps (``optax.contrib.muon``'s
  default). See ``newton_schulz`` for the output bands, and ``benchmarks/RESULTS.md`` for
  both measured against ``optax.contrib.muon`` (bands, FLOPs, time, memory).

  Same-shaped matrices (rows, columns, dtype) are stacked and orthogonalized by one loop per
  stack, so that the number of Newton–Schulz bodies in the program grows with depth only past
  192 matrices of a shape: a shape with fewer than 8 matrices is not stacked; otherwise its
  matrices go, in leaf order, into stacks of ``max(8, min(96, ceil(count / 2)))``. Each loop
  iteration is one batched call of one matrix on a CPU (where batching saves nothing), and on
  an accelerator of as many
  matrices as make ``2^40`` Newton–Schulz FLOPs (about a millisecond of an H100), so that
  the loop's overhead per iteration stays small. A loop computes its matrices' new momentum
  and direction too (once per loop, not per leaf). The loops run one after another, each on
  a stacked copy of its matrices and their momentum, which its results overwrite: these
  stacks are the default's extra temporary memory, each loop's made when it runs (XLA:CPU
  kept two consecutive loops' at most, ``benchmarks/RESULTS.md``). A stacked leaf (scanned layers,
  an expert stack) is never sliced by the default: it is one batched call, and same-shaped
  stacks share a loop whose step is one whole stack, so a stack sharded on its stack axis is
  orthogonalized where it lives (its temporaries are the whole stack's, per device its
  shard). ``ns_batch`` overrides the rule;
  ``ns_batch=1`` orthogonalizes one matrix at a time, each call waiting for the previous
  one (temporaries of one matrix, the longest
  compile). Measured in ``benchmarks/RESULTS.md``.

  Args:
    beta: momentum ``mu`` (Moonlight/Kimi: 0.95). May be traced (``inject_hyperparams``).
    nesterov: use ``G_t + mu M_t`` instead of ``M_t``: a ``bool`` (static; anything else
      is a TypeError).
    ns_steps: Newton–Schulz iterations; ``None`` (default) for the number ``ns_coeffs``
      was designed for (4 for ``"polar_express_4"``, 5 for ``"muon"``/``"polar_express"``,
      10 for ``"deepseek_v4"``).
    ns_coeffs: ``"polar_express_4"`` (default), ``"muon"``, ``"polar_express"``,
      ``"deepseek_v4"`` (DeepSeek-V4's hybrid iteration; its runs pair it with
      ``rms_scale=0.18``, see docs/training.md) or an array (see ``newton_schulz``).
    ns_method: ``"auto"`` (default), ``"standard"`` or ``"gram"`` (static; see
      ``newton_schulz``).
    ns_normalize: ``"frobenius"``, ``"schatten4"`` or ``None`` for the preset's own
      (static; see ``newton_schulz``).
    ns_restarts: Gram restarts, static step indices (see ``newton_schulz``).
    ns_precision: static; the precision policy of Newton–Schulz's products (``newton_schulz``'s
      ``precision``): None (default) for the backend's, read when the update is traced: on
      the CPU every product exact float32; on GPUs every product on float16 operands with
      float32 accumulation, the Gram iteration restarted every 2 steps; on TPUs ``ns_method="auto"``
      runs the standard iteration at the one-pass bfloat16 rate, where it holds its band (exact
      float32 on matrices of at most 64 x 64 entries), and a Gram iteration keeps exact
      float32 products. ``"highest"``, ``"float16"`` or
      ``"default"`` picks one of the policies on any backend (docs/training.md, "Precision").
    ns_batch: a static int >= 1: same-shaped matrices (tall ones transposed) go, in leaf
      order, into batched Newton–Schulz calls of at most ``ns_batch``, with no stacking loop
      (a stacked leaf with more goes through ``lax.map`` in slices of ``ns_batch``). ``None``
      (default): the stacking rule above. (``None`` rather than a number as the default keeps
      it out of ``optax.inject_hyperparams``, which injects every numeric default; to pass a
      number under it, name ``static_args=("ns_batch",)``.) The blocks of one matrix
      (``muon_blocks``: its heads or parts) always go into one call together; their stacked
      layers go in slices of ``ns_batch`` (default 1).
    eps: Newton–Schulz norm epsilon (> 0); a zero gradient gives a zero update. It is a floor on
      the normalization (see ``newton_schulz``): a direction whose Frobenius norm is not
      well above ``eps`` (entries of 1e-30, say) gives an update near zero instead of an
      orthogonal one. There is no ceiling: gradients with entries up to float32's largest
      (1e19 to 1e38, whose squares overflow, and whose momentum or direction would) give the
      update of the direction scaled down. Newton–Schulz sees the direction divided by the
      leaf's ``mu_scale`` (``ScaleByMuonState``), so ``eps`` acts as ``eps * mu_scale`` on the
      true direction, which is negligible: ``mu_scale > 1`` only when entries are within a
      factor ~8 of the dtype's largest.
    compute_dtype: dtype of the Newton–Schulz iteration (default: the gradient's).
    mu_dtype: dtype of the momentum (default: the gradient's).
    rms_match: ``"moonlight"`` (``rms_scale * sqrt(max(fan_in, fan_out))``, the default),
      ``"keller"`` (``sqrt(max(1, fan_out / fan_in))``) or ``None`` (no scaling).
    rms_scale: the 0.2 of Moonlight's matching. May be traced.
    matrix_axes: which axes form each leaf's matrix: one ``MatrixAxes`` (or
      ``optax.contrib.MuonDimensionNumbers``) for all leaves, a pytree of them (``None``
      leaves) matched by path, or a callable from the params to such a pytree
      (``attention_matrix_axes(layout)``). A leaf it leaves at ``None`` is read from its
      layer's type (an Equinox ``Linear`` weight: ``(*layers, out, in)``), from its
      logical axis names when boxed, is ``(in, out)`` when 2-D, and else raises ValueError
      naming its path and shape (see ``matrix_axes_lookup``). What ``init`` reads from boxed
      params is reused by ``update`` for bare arrays of the same paths and shapes, so under
      ``nnx.Optimizer`` (boxed ``nnx.Param`` at init, bare arrays at update) names still decide.
      With a ``layout``, an entry of a ``matrix_axes`` pytree (or of a callable's result)
      still decides its leaf; one ``MatrixAxes`` for all leaves applies to the leaves the
      layout does not describe.
    layout: static. The attention layout (``module.layout``, a ``GQALayout``/``MLALayout``
      or a mapping from module-path patterns to them): the declaration of Muon's matrices
      for the kernels it describes, with no ``matrix_axes`` needed. In every module that
      holds its query/key projections, the query, key, value and output kernels get their
      matrix from it (``"layers"`` axes batched, whatever the storage: 2-D head-major,
      DenseGeneral, heads-first einsums, torch-style ``(out, in)``, fused q|k|v, declared
      ``Projection(axes=...)`` or logical names).
      ``muonclip`` passes its own.
    muon_blocks: static; how finely the layout's kernels are orthogonalized:
      ``"matrix"`` (default; Kimi K2, Moonlight): each projection one matrix.
      ``"part"``: a fused projection as its logical parts (q, k, v of a fused ``qkv``; k, v
      of Gemma's ``kv_einsum``; MLA ``wkv_b``'s k_nope columns and its v columns).
      ``"head"`` (Kimi K3, arXiv 2607.24653, section 2.5; GLM-5's "Muon Split", arXiv
      2602.15763): each head's block of every query, key and value projection on its own,
      ``in x head_dim`` (MLA: ``wq_b`` per head ``q_lora x (nope + rope)``, ``wkv_b`` per
      head ``kv_lora x (nope + v)``); the output projection and MLA's down-projections stay
      whole, as in K3. ``"head+out"``: the output projection per head too
      (``head_dim x out``). ``"group:<k>"`` (Group Muon, arXiv 2605.08933): every ``k``
      consecutive heads one block, ``in x k*head_dim`` (``k`` divides each projection's
      head count, else ValueError); ``"group:kv"``: GQA's groups, the query heads sharing a
      key/value head one block and each key/value head its own; ``"group:<k>+out"`` and
      ``"group:kv+out"`` group the output projection's heads as the query heads. A block is a view of the kernel (a 2-D head-major kernel is
      reshaped, not copied); a leaf's blocks are orthogonalized in one batched call, so a
      heads-sharded kernel stays where it lives. The RMS factor is each block's own:
      Moonlight's ``rms_scale * sqrt(max(rows, cols))`` of an ``in x head_dim`` block gives
      every head the update RMS ``rms_scale``, as a whole-matrix update has. Anything other
      than ``"matrix"`` needs ``layout``; ``"head"`` and the groups also need each attention
      module's value projection (GQA ``value=``), ``"+out"`` its output projection (``out=``),
      else ValueError naming the module. One whose sizes cannot hold the layout's heads (value
      heads of another width than ``head_dim``) is a ValueError too: ``value=None``
      (``out=None``) keeps that projection one matrix, the others per head.
    shard_orthogonalization: static. ``None`` (default): each matrix is orthogonalized in
      its parameter's layout, as XLA partitions it (on a mesh every device repeats much of
      the work). A pytree of the params' ``NamedSharding`` (``sharding.param_shardings``,
      matched by path): every matrix is orthogonalized on one device of their mesh and its
      result returned in its parameter's sharding, matrices placed by FLOPs over the
      devices (``sharding.orthogonalize_sharded``; ``ns_batch`` is not used). Blocks
      (``muon_blocks``) are matrices like any other there, except those of a kernel whose
      heads are sharded: they are orthogonalized on the devices that hold them. A
      ``jax.sharding.Mesh``: the same, but each matrix is all-gathered first. Use under ``jax.jit`` with the params on that mesh.
      A matrix too large for whole-matrix placement to balance may instead be split over
      a group of devices (its Gram matrix all-reduced, the ``m x m`` iteration split by
      rows; see ``shard_split``).
    shard_split: static, with ``shard_orthogonalization`` only. ``"auto"`` (default): the
      planner splits a matrix where its model of an H100 with NVLink (``_orthogonalize.cost``)
      estimates a shorter step, else keeps it whole; ``"always"``: split wherever that
      lowers the most loaded device's FLOPs, whatever the traffic; ``"never"``: every
      matrix whole. Not with a traced ``ns_steps`` or with ``ns_restarts`` (then whole).

  Non-float leaves (integers, booleans, with integer or ``float0`` gradients) and zero-size
  leaves get a zero update and no momentum (``_util.frozen_leaves``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state (``ScaleByMuonState``) holds
    only the momentum, as ``mu`` times a per-leaf power of two ``mu_scale``. Finite gradients
    give finite updates and a finite momentum, whatever their size; a NaN or inf gradient
    makes that leaf's momentum, and so its later updates, NaN for good (apply the update
    only where the gradients are finite: ``optax.apply_if_finite``).

  Example:
    >>> import jax, jax.numpy as jnp, muonclip_jax as mc
    >>> opt = mc.scale_by_muon()  # polar_express_4, Moonlight's RMS matching
    >>> params = {"w": jnp.zeros((4, 8))}
    >>> grads = {"w": jax.random.normal(jax.random.key(0), (4, 8))}
    >>> updates, state = opt.update(grads, opt.init(params))
    >>> s = jnp.linalg.svd(updates["w"], compute_uv=False) / (0.2 * 8 ** 0.5)  # 0.2 sqrt(max(4, 8))
    >>> bool(s.min() > 0.7 and s.max() < 1.25)  # orthogonalized: singular values near 1
    True
    >>> round(float(jnp.sqrt(jnp.mean(updates["w"] ** 2))), 1)  # so the update RMS is AdamW's ~0.2
    0.2
    >>> layout = mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=4, value=None)  # wq, wk: 2 heads of 4 columns
    >>> params = {"wq": {"kernel": jnp.zeros((6, 8))}, "wk": {"kernel": jnp.zeros((6, 8))}}
    >>> g = jax.random.normal(jax.random.key(0), (6, 8)) * jnp.array([[1.0] * 4 + [1e-3] * 4])  # head 1: tiny
    >>> grads = {"wq": {"kernel": g}, "wk": {"kernel": jax.random.normal(jax.random.key(1), (6, 8))}}
    >>> rms = lambda x: round(float(jnp.sqrt(jnp.mean(x ** 2))), 2)
    >>> for blocks in ("matrix", "head"):
    ...   opt = mc.scale_by_muon(layout=layout, muon_blocks=blocks)
    ...   updates, _ = opt.update(grads, opt.init(params))
    ...   print(blocks, [rms(updates["wq"]["kernel"][:, h * 4:(h + 1) * 4]) for h in range(2)])
    matrix [0.23, 0.02]
    head [0.2, 0.21]
  """
  check_target(shard_orthogonalization)
  check_blocks(muon_blocks, layout)
  if shard_split not in ("auto", "always", "never"):
    raise ValueError(f"shard_split must be 'auto', 'always' or 'never', got {shard_split!r}")
  try:  # their messages name newton_schulz's arguments (steps, coeffs, ...): here they are ns_*
    resolve_coeffs(ns_coeffs, ns_steps)  # validates both
    resolve_options(ns_coeffs, ns_steps, ns_method, ns_normalize, ns_restarts)
  except ValueError as e:
    raise ValueError(f"ns_{e}") from None
  if isinstance(ns_batch, jax.Array):
    raise ValueError("ns_batch is static: under optax.inject_hyperparams pass static_args=('ns_batch',), "
                     f"got {ns_batch!r}")
  if ns_batch is not None and (not is_int(ns_batch) or ns_batch < 1):
    raise ValueError(f"ns_batch must be None or an int >= 1, got {ns_batch!r}")
  batch = None if ns_batch is None else int(ns_batch)
  check_bool("nesterov", nesterov)
  check_number("beta", beta, low=0.0, high=1.0, high_open=True)
  check_number("rms_scale", rms_scale, low=0.0, high=math.inf, high_open=True)
  check_number("eps", eps, low=0.0, high=math.inf, low_open=True, high_open=True)  # 0: a zero gradient is 0 / 0
  check_float_dtype("mu_dtype", mu_dtype)
  check_float_dtype("compute_dtype", compute_dtype)
  if rms_match not in RMS_MODES:
    raise ValueError(f"rms_match must be one of {RMS_MODES}, got {rms_match!r}")
  if ns_precision is not None:
    policy(ns_precision)  # validates it (None: the backend's, read when traced)
  ns_kwargs = dict(steps=ns_steps, coeffs=ns_coeffs, eps=eps, compute_dtype=compute_dtype, method=ns_method,
                   normalize=ns_normalize, restarts=ns_restarts, precision=ns_precision)

  memo = MetadataMemo()  # axes read from boxed params at init, for the bare arrays of update (nnx.Optimizer)

  def blocks_of(tree):
    return muon_blocks_lookup(matrix_axes, layout, muon_blocks, tree, rms_match=rms_match)

  def init_fn(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [path_str(path) for path, _ in flat]
    twice = sorted(p for p, count in collections.Counter(paths).items() if count > 1)
    if twice:
      raise ValueError(f"scale_by_muon: two parameters have the path {twice[0]!r} (a flat key such as 'a.b' beside "
                       "a nested a/b: the same components): rename one, or nest the flat keys")
    lookup = blocks_of(params)
    # Resolve every leaf now, so that an ambiguous tensor fails at init with its path.
    table = {}
    for p, (_, x) in zip(paths, flat):
      if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise TypeError(f"scale_by_muon: the parameter at {p} is complex ({x.dtype}); Muon's Newton–Schulz and "
                        "its momentum scale are real: route it to another optimizer (labels=), or store it as "
                        "its real and imaginary parts")
      table[p] = lookup(p, x.shape)
      piece_dims(table[p], p, x.shape)
    memo.remember(params, table)
    mu = optax.tree.zeros_like(params, dtype=mu_dtype)
    # mu_scale is never boxed: a box's logical names are the parameter's, not a per-matrix scale's
    scales = [jnp.ones(scale_shape(table[p], p, m.shape), scale_dtype(m.dtype))
              for p, m in zip(paths, jax.tree.leaves(mu))]
    return ScaleByMuonState(mu=mu, mu_scale=jax.tree.unflatten(jax.tree.structure(unboxed(mu)), scales))

  def update_fn(updates, state, params=None):
    del params
    report_layout("muon", layout)  # for make_train_step(exact_clip=True)
    table = memo.recall(updates)
    lookup = blocks_of(updates) if table is None else (lambda p, _: table[p])
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    leaves = [g for _, g in flat]
    paths = [path_str(p) for p, _ in flat]
    # leaf by leaf by path, whatever boxes either side holds (Linen boxes at init, bare arrays
    # at update); each tree keeps its own structure
    mus, mu_def = _leaves_at(state.mu, paths, "mu")
    old_scales, scale_def = _leaves_at(state.mu_scale, paths, "mu_scale")
    for p, m, g in zip(paths, mus, leaves):
      if m.shape != g.shape:
        raise ValueError(f"scale_by_muon: the update at {p} has shape {tuple(g.shape)}, but its momentum (the "
                         f"parameter's shape at init) is {tuple(m.shape)}: pass updates of the parameters' shapes")
    for p, m, sc in zip(paths, mus, old_scales):
      if sc.dtype != scale_dtype(m.dtype):
        raise TypeError(
            f"scale_by_muon: the state's mu_scale at {p} is {sc.dtype}, but a momentum of {m.dtype} needs "
            f"{scale_dtype(m.dtype)} (its powers of two reach the dtype's largest: a cast state, e.g. "
            "optax.tree.cast, overflows it): keep mu_scale as init gives it, or pass mu_dtype= to store "
            "the momentum in another dtype")
    blocks = [lookup(p, g.shape) for p, g in zip(paths, leaves)]

    def rms(fan_in, fan_out):
      return rms_factor(rms_match, rms_scale, fan_in, fan_out)

    def direction(g, m, s):
      """The direction of Newton–Schulz in the units of ``s``, from the new momentum ``m = M_t / s``."""
      return rounded(in_units(g, s) + beta * m.astype(g.dtype) if nesterov else m.astype(g.dtype))

    def combine(m, g):
      """``M_t = beta M_{t-1} + G_t`` in the units of both, in ``m``'s dtype."""
      return rounded((beta * m + g).astype(m.dtype))

    def momentum(g, m, s):
      """``(direction, (M_t / s_t, s_t))`` of one leaf, or of matrices of one shape (``s``: per
      matrix); under the default, ``orthogonalize_leaves``'s ``step``, run in a stack's loop."""
      ((m, s),) = rescale([m], [g], [s])
      m = combine(m, in_units(g, s))
      return direction(g, m, s), (m, s)

    def finish(i, o):
      r = rms(specs[i][3], specs[i][4])
      # a Python float is weakly typed: o's dtype, as o * r gives (in lax: traced once per leaf)
      o = lax.mul(o, np.asarray(r, o.dtype)) if isinstance(r, float) else o * r
      return o.astype(flat[i][1].dtype)

    specs = [piece_dims(b, p, g.shape)[0] for b, p, g in zip(blocks, paths, leaves)]
    # each scale with its leaf's rank (size 1 on the matrix axes): it then reads as matrices do
    ranked = [s.reshape(s.shape or (1,) * g.ndim) for s, g in zip(old_scales, leaves)]
    if shard_orthogonalization is None and all(b.is_whole for b in blocks):
      # the default: each stack's loop computes its matrices' momentum, scales and directions,
      # then their Newton–Schulz (``orthogonalize_leaves``)
      new, stepped = orthogonalize_leaves(leaves, list(zip(mus, ranked)), [sp[:3] for sp in specs], momentum,
                                          finish, batch=batch, **ns_kwargs)
      flat_mu, scales = [m for m, _ in stepped], [s for _, s in stepped]
    else:
      stepped = [momentum(g, m, s)[1] for g, m, s in zip(leaves, mus, ranked)]
      flat_mu, scales = [m for m, _ in stepped], [s for _, s in stepped]
      if any(not b.is_whole for b in blocks):  # per head or per part (muon_blocks)
        new = orthogonalize_blocks(leaves, flat_mu, scales, blocks, direction, rms, paths=paths, batch=batch,
                                   target=shard_orthogonalization, split=shard_split, ns_kwargs=ns_kwargs)
      else:
        new = orthogonalize_leaves_sharded(leaves, flat_mu, [sp[:3] for sp in specs],
                                           lambda i, g, m: direction(g, m, scales[i]), finish, paths=paths,
                                           target=shard_orthogonalization, ns_kwargs=ns_kwargs, split=shard_split)
    scales = [s.reshape(old.shape) for s, old in zip(scales, old_scales)]
    state = ScaleByMuonState(mu=jax.tree.unflatten(mu_def, flat_mu), mu_scale=jax.tree.unflatten(scale_def, scales))
    return jax.tree_util.tree_unflatten(treedef, new), state

  return skip_frozen_leaves(optax.GradientTransformation(init_fn, update_fn))
