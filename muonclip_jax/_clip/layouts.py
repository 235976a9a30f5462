"""Head layouts of attention projections, shared by QK-Clip and the attention modules.

A layout says how many heads an attention module has, how wide each head's query/key
columns are, and under which names its query/key projections live. Its head-major column
order follows DeepSeek-V3's names (see ``qk_clip``); which kernel forms a projection may
take (2-D, DenseGeneral, fused QKV) is the concern of ``_clip.kernel_forms``.

The library's attention modules report their own layout as ``module.layout``: that is the
recommended source of a layout, since two layouts with equal column totals (e.g.
``MLALayout(4, 12, 4, 4)`` and ``MLALayout(4, 8, 8, 8)``) fit the same 2-D kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import itertools
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from .._util import check_positive_int
from .equinox import attention_projections
from .projection import as_projection, check_qk_projection, Projection


def _check_name(owner: str, field: str, value: object, *, optional: bool = False,
                parts: tuple[tuple[str, ...], ...] = (), output: bool = False) -> None:
  """A projection: a ``Projection``, or a name that is one non-empty path component.

  An ``output`` projection (heads in, model dimension out) may declare several ``"in"`` axes
  (``("in", "in", "out")`` for ``(heads, head_dim, embed)``); the others take exactly one.
  """
  if optional and value is None:
    return
  if isinstance(value, Projection):
    if value.parts is not None and not parts:
      raise ValueError(f"{owner}: {field}={value} is not a fused projection; leave parts=None")
    if value.grouped and field != "qkv":
      raise ValueError(f"{owner}: {field}={value}: grouped=True orders the columns of a fused q|k|v "
                       "projection, which is declared as qkv=")
    if not output:
      check_qk_projection(owner, field, value, parts)
    return
  if not isinstance(value, str) or not value or "/" in value:
    what = "None or " if optional else ""
    raise ValueError(
        f"{owner}: {field} must be {what}a projection (sub-module) name such as 'q_proj', "
        f"a non-empty str without '/', or a muonclip_jax.Projection (whose name may be a "
        f"path), got {value!r}"
    )


def _same(a: object, b: object) -> bool:
  return a is not None and b is not None and as_projection(a).kernel == as_projection(b).kernel


def _check_distinct(owner: str, **fields: object) -> None:
  """The value and output projections may not be another field's kernel."""
  named = [(f, v) for f, v in fields.items() if v is not None]
  for i, (f, v) in enumerate(named):
    for g, w in named[i + 1:]:
      if g in ("value", "out") and _same(v, w):
        raise ValueError(f"{owner}: {f} and {g} must be different projections, both are {as_projection(v).kernel!r}")


@dataclasses.dataclass(frozen=True)
class MLALayout:
  """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2).

  Query projection (``wq_b``, or ``wq`` without query LoRA): ``num_heads`` heads of
  ``qk_nope_head_dim + qk_rope_head_dim`` columns each, its nope part (q^C) then its rope
  part (q^R). Key/value projection ``wkv_b``: ``num_heads`` heads of
  ``qk_nope_head_dim + v_head_dim`` columns, k_nope (k^C) then v. The rotary key k^R comes
  from ``wkv_a`` and is shared by all heads. Kernels may be 2-D head-major
  ``(in, heads * width)`` or DenseGeneral ``(in, heads, width)`` (MaxText), with optional
  leading stacked-layer axes.

  Prefer ``module.layout`` of the library's attention modules to writing a layout by hand:
  2-D kernels fix only the column totals, so a layout with the right totals but the wrong
  split between nope, rope and v widths cannot always be told from the shapes. ``qk_clip``
  checks what the shapes do fix: DenseGeneral kernels carry the per-head width, and where
  the module has a ``wkv_a`` kernel its columns minus the latent width (``wkv_b``'s input
  size) are the rotary width ``qk_rope_head_dim``.

  Attributes:
    num_heads: number of attention heads.
    qk_nope_head_dim: per-head width of the non-rotary query/key part.
    qk_rope_head_dim: per-head width of the rotary query part (and of the shared rotary key).
    v_head_dim: per-head value width.
    query: name of the query projection under the attention module, or a
      ``muonclip_jax.Projection`` declaring its storage; ``None`` (default) means ``wq_b``,
      or ``wq`` in a module without query LoRA.
    key_value: name (or ``Projection``) of the key/value up-projection (default ``wkv_b``).
    out: name (or ``Projection``) of the output projection ``(heads * v_head_dim, dim)``
      (default ``"out"``, MaxText's name; the library's modules: ``"wo"``), or None. QK-Clip
      never touches it; Muon reads its matrix from here, and orthogonalizes it per head with
      ``muon_blocks="head+out"``.

  Example:
    >>> import jax.numpy as jnp, muonclip_jax as mc
    >>> layout = mc.MLALayout(num_heads=2, qk_nope_head_dim=2, qk_rope_head_dim=1, v_head_dim=2)
    >>> layout.qk_head_dim
    3
    >>> params = {"attn": {"wq": {"kernel": jnp.ones((4, 6))},  # no query LoRA: wq, 2 heads of nope 2 | rope 1
    ...                    "wkv_b": {"kernel": jnp.ones((4, 8))}}}  # 2 heads of k_nope 2 | v 2
    >>> max_logits = {"attn": {"max_logits": jnp.array([400.0, 50.0])}}  # head 0 above tau
    >>> new = mc.qk_clip(params, max_logits, qk_clip_threshold=100.0, layout=layout)
    >>> new["attn"]["wq"]["kernel"][0]  # head 0: q^C by sqrt(100 / 400), q^R by 100 / 400
    Array([0.5 , 0.5 , 0.25, 1.  , 1.  , 1.  ], dtype=float32)
    >>> new["attn"]["wkv_b"]["kernel"][0]  # head 0: k^C by sqrt(100 / 400), v kept
    Array([0.5, 0.5, 1. , 1. , 1. , 1. , 1. , 1. ], dtype=float32)
  """

  num_heads: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  _: dataclasses.KW_ONLY
  query: str | Projection | None = None
  key_value: str | Projection = "wkv_b"
  out: str | Projection | None = "out"

  def __post_init__(self):
    check_positive_int("num_heads", self.num_heads)
    check_positive_int("qk_nope_head_dim", self.qk_nope_head_dim, allow_zero=True)
    check_positive_int("qk_rope_head_dim", self.qk_rope_head_dim, allow_zero=True)
    check_positive_int("v_head_dim", self.v_head_dim)
    if self.qk_nope_head_dim + self.qk_rope_head_dim == 0:
      raise ValueError("MLALayout: qk_nope_head_dim + qk_rope_head_dim must be >= 1, got 0")
    _check_name("MLALayout", "query", self.query, optional=True)
    _check_name("MLALayout", "key_value", self.key_value)
    _check_name("MLALayout", "out", self.out, optional=True, output=True)
    if _same(self.query, self.key_value):
      raise ValueError(f"MLALayout: query and key_value must differ, both are {self.query!r}")
    _check_distinct("MLALayout", query=self.query, key_value=self.key_value, out=self.out)

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class GQALayout:
  """Grouped-query attention; multi-head attention is ``num_kv_heads == num_heads``.

  Query projection ``wq``: ``num_heads`` heads of ``head_dim`` columns; key projection
  ``wk``: ``num_kv_heads`` heads. Query head ``h`` reads key head
  ``h // (num_heads // num_kv_heads)``. Each kernel may be 2-D head-major
  ``(in, heads * head_dim)``, bias ``(heads * head_dim,)``, or DenseGeneral
  ``(in, heads, head_dim)``, bias ``(heads, head_dim)`` (Flax's
  ``MultiHeadDotProductAttention``, ``nnx.MultiHeadAttention``), with optional leading
  stacked-layer axes (``nn.scan``).

  With ``qkv`` set, one fused projection holds the query, key and value columns, either
  ``(in, (num_heads + 2 * num_kv_heads) * head_dim)``: all query heads, then the key heads,
  then the value heads, each head-major (GPT-2's ``c_attn``, ``qkv_proj``/``Wqkv`` of Llama
  ports), bias ``((num_heads + 2 * num_kv_heads) * head_dim,)``; or
  ``(in, 3, num_heads, head_dim)`` (only when ``num_kv_heads == num_heads``), bias
  ``(3, num_heads, head_dim)``. Its value columns are never touched. A 2-D kernel whose
  columns run key/value head by key/value head instead (each one's query heads, then its key,
  then its value: Bloom's and GPT-NeoX's ``query_key_value``, Megatron-LM's fused QKV) has the
  same shape: declare it ``qkv=Projection(name, grouped=True)``.

  The library's ``GroupedQueryAttention`` reports its own layout as ``module.layout``. For
  other models, separate query and key kernels fix ``head_dim`` and ``num_kv_heads`` once the
  maxima fix ``num_heads``, so a wrong layout fails with a ValueError; a fused 2-D kernel
  fixes only ``(num_heads + 2 * num_kv_heads) * head_dim``, so check those two fields and its
  column order against the model's configuration and code.

  Attributes:
    num_heads: number of query heads.
    num_kv_heads: number of key/value heads; divides ``num_heads``.
    head_dim: per-head width of queries, keys and values.
    clip_mode: how QK-Clip treats a key head shared by several query heads.
      ``"split"`` (default, as Motif's and Megatron's PyTorch references): query head h by
      sqrt(gamma_h), shared key head g by sqrt(min of gamma over its group).
      ``"query"``: query head h by gamma_h and the key untouched (the principle of MLA's
      shared k^R), so every logit of head h is scaled by exactly gamma_h and no other head
      changes. For MHA both modes bound the logits; ``"split"`` gives the symmetric
      sqrt(gamma) on query and key.
    query: name of the query projection under the attention module (default ``wq``; Flax's
      attention modules: ``"query"``; Llama: ``"q_proj"``). Not used when ``qkv`` is set.
    key: name of the key projection (default ``wk``; ``"key"``, ``"k_proj"``). Not used when
      ``qkv`` is set.
    qkv: name of a fused query|key|value projection (``"c_attn"``, ``"qkv_proj"``,
      ``"Wqkv"``), or ``None`` (default) for separate query and key projections.
    value: name of the value projection (default ``"value"``, Flax's and MaxText's name;
      Llama: ``"v_proj"``; the library's modules: ``"wv"``), or None. Not used when ``qkv``
      is set or ``key`` fuses k|v. QK-Clip never touches it; Muon reads its matrix from here,
      and orthogonalizes it per head with ``muon_blocks="head"``.
    out: name of the output projection ``(heads * head_dim, dim)`` (default ``"out"``;
      Llama: ``"o_proj"``; GPT-2: ``"c_proj"``; the library's modules: ``"wo"``), or None.
      For Muon only (per head with ``muon_blocks="head+out"``).

  With QK-norm (q and k normalized per head after the projection: Gemma 3, Qwen3, OLMo 2,
  Flax's ``normalize_qk=True`` with norms ``query_ln``/``key_ln``), ``query_norm`` and
  ``key_norm`` name the norms, and the clip acts on their scales (and biases) instead of
  the kernels, per head where the scale is per head and per layer (weaker) where it is
  shared by heads; see ``docs/your-model.md`` ("QK-norm") for the reasoning. ``norm_scale_offset``:
  0.0 (default) for norms computing ``x * scale`` (Flax, Qwen3, OLMo 2, Gemma 4), 1.0 for
  ``x * (1 + scale)`` (Gemma 2 and Gemma 3's RMSNorm); the wrong one makes the clip miss
  tau (Gemma 4 with 1.0 over-clips). A module with an undeclared norm of a usual QK-norm
  name holding a gain is a ValueError (a norm-like name such as Flax's ``RMSNorm_0`` with a
  QK-norm's gain, a UserWarning), not a clip with no effect.

  Each of ``query``, ``key``, ``qkv``, ``value`` and ``out`` may be a ``muonclip_jax.Projection`` that declares
  the kernel's leaf name and axes (Gemma: ``Projection("q_einsum", leaf="w", axes=("heads",
  "in", "head_dim"))``); ``key`` may then be a fused k|v projection (``parts=("k", "v")``,
  Gemma's ``kv_einsum``) whose value part is never touched.

  Example:
    >>> import jax.numpy as jnp, muonclip_jax as mc
    >>> layout = mc.GQALayout(num_heads=4, num_kv_heads=2, head_dim=2)  # query heads 0, 1 read key head 0
    >>> layout.group_size
    2
    >>> params = {"attn": {"wq": {"kernel": jnp.ones((3, 8))}, "wk": {"kernel": jnp.ones((3, 4))}}}
    >>> max_logits = {"attn": {"max_logits": jnp.array([400.0, 50.0, 50.0, 50.0])}}  # head 0 above tau
    >>> new = mc.qk_clip(params, max_logits, qk_clip_threshold=100.0, layout=layout)
    >>> new["attn"]["wq"]["kernel"][0]  # "split": query head 0 by sqrt(100 / 400)
    Array([0.5, 0.5, 1. , 1. , 1. , 1. , 1. , 1. ], dtype=float32)
    >>> new["attn"]["wk"]["kernel"][0]  # key head 0 by sqrt(min gamma of query heads 0, 1)
    Array([0.5, 0.5, 1. , 1. ], dtype=float32)
    >>> query_only = mc.GQALayout(num_heads=4, num_kv_heads=2, head_dim=2, clip_mode="query")
    >>> new = mc.qk_clip(params, max_logits, qk_clip_threshold=100.0, layout=query_only)
    >>> new["attn"]["wq"]["kernel"][0], new["attn"]["wk"]["kernel"][0]  # query head 0 by gamma, keys kept
    (Array([0.25, 0.25, 1.  , 1.  , 1.  , 1.  , 1.  , 1.  ], dtype=float32), Array([1., 1., 1., 1.], dtype=float32))
  """

  num_heads: int
  num_kv_heads: int
  head_dim: int
  clip_mode: Literal["split", "query"] = "split"
  _: dataclasses.KW_ONLY
  query: str | Projection = "wq"
  key: str | Projection = "wk"
  qkv: str | Projection | None = None
  value: str | Projection | None = "value"
  out: str | Projection | None = "out"
  query_norm: str | None = None
  key_norm: str | None = None
  norm_scale_offset: float = 0.0

  def __post_init__(self):
    check_positive_int("num_heads", self.num_heads)
    check_positive_int("num_kv_heads", self.num_kv_heads)
    check_positive_int("head_dim", self.head_dim)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"GQALayout: num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
      )
    if self.clip_mode not in ("split", "query"):
      raise ValueError(f"GQALayout: clip_mode must be 'split' or 'query', got {self.clip_mode!r}")
    _check_name("GQALayout", "query", self.query, parts=(("q",),))
    _check_name("GQALayout", "key", self.key, parts=(("k",), ("k", "v"), ("v", "k")))
    _check_name("GQALayout", "qkv", self.qkv, optional=True,
                parts=tuple(p for p in itertools.permutations("qkv", 3)) + (("q", "k"), ("k", "q")))
    _check_name("GQALayout", "value", self.value, optional=True)
    _check_name("GQALayout", "out", self.out, optional=True, output=True)
    norms = (self.query_norm, self.key_norm)
    for field, value in zip(("query_norm", "key_norm"), norms):
      if value is not None and (not isinstance(value, str) or not value or any(not p for p in value.split("/"))):
        raise ValueError(f"GQALayout: {field} must be None or a norm's sub-module path such as 'q_norm', got {value!r}")
    if (norms[0] is None) != (norms[1] is None):
      raise ValueError(f"GQALayout: query_norm and key_norm are declared together (QK-norm), got {norms}")
    if not isinstance(self.norm_scale_offset, (int, float)) or isinstance(self.norm_scale_offset, bool):
      raise ValueError(f"GQALayout: norm_scale_offset must be a number (0 or 1), got {self.norm_scale_offset!r}")
    if self.qkv is None and _same(self.query, self.key):
      raise ValueError(
          f"GQALayout: query and key must differ, both are {self.query!r}; for a fused "
          "query|key|value projection set qkv=<its name>"
      )
    _check_distinct("GQALayout", query=None if self.qkv is not None else self.query,
                    key=None if self.qkv is not None else self.key, qkv=self.qkv, value=self.value, out=self.out)

  @property
  def group_size(self) -> int:
    return self.num_heads // self.num_kv_heads

  @classmethod
  def from_equinox(cls, mha: Any, *, clip_mode: Literal["split", "query"] = "split") -> GQALayout:
    """The layout of an ``equinox.nn.MultiheadAttention`` (or of a stack of them).

    ``num_heads`` query and key heads of ``qk_size`` columns; the projections are its
    ``query_proj``/``key_proj``/``value_proj``/``output_proj`` ``Linear`` weights, declared
    in torch's storage, ``("out", "in")`` (the output projection's ``"in"`` is its
    ``heads * head_dim`` side), with a ``"layers"`` axis in front for each axis a stack added
    (``eqx.filter_vmap``): build it from the module as the params hold it
    (``model.blocks.attn`` of a stacked model, ``model.blocks[0].attn`` of a list). The value
    and output projections are declared only when ``vo_size == qk_size`` (the layout has one
    head width); otherwise ``value`` and ``out`` are None and Muon takes them whole.

    Example:
      >>> import equinox as eqx, jax, muonclip_jax as mc
      >>> mha = eqx.nn.MultiheadAttention(num_heads=2, query_size=8, key=jax.random.key(0))
      >>> layout = mc.GQALayout.from_equinox(mha)
      >>> layout.num_heads, layout.head_dim, layout.query
      (2, 4, Projection(name='query_proj', leaf='weight', axes=('out', 'in'), parts=None, grouped=False))
      >>> make = lambda k: eqx.nn.MultiheadAttention(num_heads=2, query_size=8, key=k)
      >>> stacked = eqx.filter_vmap(make)(jax.random.split(jax.random.key(0), 3))
      >>> mc.GQALayout.from_equinox(stacked).key.axes  # 3 layers stacked by filter_vmap
      ('layers', 'out', 'in')
    """
    num_heads, head_dim, projections = attention_projections(mha)
    return cls(num_heads, num_heads, head_dim, clip_mode, **projections)


Layout = MLALayout | GQALayout
LayoutSpec = Layout | Mapping[str, Layout]  # one layout, or module-path patterns to layouts


def check_layout(layout: Any, name: str = "qk_clip") -> None:
  """Raises TypeError unless ``layout`` is a layout or a mapping from patterns to layouts."""
  if isinstance(layout, Mapping):
    if not layout:
      raise ValueError(f"{name}: layout mapping is empty; map module-path patterns to layouts")
    items = list(layout.items())
  else:
    items = [(None, layout)]
  for pattern, lay in items:
    if pattern is not None and not isinstance(pattern, str):
      raise TypeError(f"{name}: layout mapping keys must be str path patterns, got {pattern!r}")
    if not isinstance(lay, (MLALayout, GQALayout)):
      raise TypeError(
          f"{name}: layout must be an MLALayout, a GQALayout or a mapping from path patterns "
          f"to them, got {type(lay).__name__}: {lay!r}"
      )


def matching_patterns(module: str, layout: Mapping[str, Layout]) -> list[str]:
  """The glob patterns (``fnmatch``) of a layout mapping that match a module path."""
  return [pattern for pattern in layout if fnmatch.fnmatchcase(module, pattern)]


def layout_for(module: str, layout: Layout | Mapping[str, Layout]) -> Layout:
  """The layout of one module: the single layout, or the one whose glob pattern matches."""
  if not isinstance(layout, Mapping):
    return layout
  matches = matching_patterns(module, layout)
  if len(matches) != 1:
    what = "no pattern" if not matches else f"{len(matches)} patterns {matches}"
    raise ValueError(
        f"qk_clip: {what} of the layout mapping match module path {module!r}; "
        f"exactly one must (patterns: {list(layout)})"
    )
  return layout[matches[0]]


# The layouts an optimizer's transforms hold, reported while its update is traced. An
# optimizer is a pair of closures and its state holds arrays only, so no composition (chain,
# inject_hyperparams, multi_steps, MultiSteps) exposes the layout it was built with; running
# its update does, in Python, at trace time. make_train_step reads them for the exact clip.
_REPORTS: contextvars.ContextVar[list | None] = contextvars.ContextVar("muonclip_layout_reports", default=None)


def report_layout(holder: str, layout: LayoutSpec | None) -> None:
  """Tells an enclosing ``reported_layouts()`` that transform ``holder`` (``"qk_clip"`` or
  ``"muon"``) holds ``layout``; a no-op outside one and for ``None``."""
  reports = _REPORTS.get()
  if reports is not None and layout is not None:
    reports.append((holder, layout))


@contextlib.contextmanager
def reported_layouts() -> Iterator[list[tuple[str, LayoutSpec]]]:
  """The ``(holder, layout)`` pairs that the updates traced inside the ``with`` block reported."""
  reports: list = []
  token = _REPORTS.set(reports)
  try:
    yield reports
  finally:
    _REPORTS.reset(token)
