"""DeepSeek-V3 / Kimi K2 checkpoints: MLA modules from a Hugging Face config, weights from safetensors.

``mla_from_hf_config(config)`` / ``mla_nnx_from_hf_config(config, rngs=...)`` build the
attention of one decoder layer from a Hugging Face ``config.json`` dict (DeepseekV3
keys; Kimi K2 uses the same). ``load_hf_mla_params(checkpoint, config, layers=...)``
reads the attention weights of one layer, or of several stacked on a leading axis for
``nn.scan`` / ``nnx.vmap``, and returns the module's ``params``.

Choices, each following DeepSeek-V3's reference ``inference/model.py``:

- YaRN is on exactly when ``max_position_embeddings`` exceeds
  ``rope_scaling["original_max_position_embeddings"]`` (the reference's
  ``max_seq_len > original_seq_len``), with ``factor``, ``beta_fast`` (default 32),
  ``beta_slow`` (default 1) from ``rope_scaling``; only ``"yarn"`` scaling is accepted.
- Temperature: the reference multiplies the whole softmax scale by ``mscale^2``,
  ``mscale = 0.1 m ln(factor) + 1``. We take ``m = rope_scaling["mscale_all_dim"]``, the
  key Hugging Face's DeepseekV3 multiplies into its softmax scale. Hugging Face also scales
  the rotary cos/sin (only the rope part of each logit) by a factor the module cannot
  apply: DeepSeek's ``modeling_deepseek.py`` by ``mscale(m_mscale) / mscale(m_all_dim)``
  with a missing ``mscale`` read as 1 and a missing ``mscale_all_dim`` as 0 (``mscale(0) =
  1``); ``transformers`` by that ratio when both keys are set and nonzero, else by
  ``mscale(1)``, or by ``rope_scaling["attention_factor"]`` when given. A config for which
  either factor differs from 1 (with ``factor > 1``: the two keys differ, or one or both
  is missing or 0) is refused rather than silently loaded with another temperature;
  DeepSeek-V3 and Kimi K2 (both keys 1.0) load.
- ``rope_interleave`` defaults to True (Hugging Face's default; the released DeepSeek-V3
  and Kimi K2 weights are stored for interleaved pairs), so weights load unpermuted.
- The latent RMSNorms use epsilon 1e-6 in both the reference and Hugging Face
  (``rms_norm_eps`` belongs to the decoder's own norms), which is the module default.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from .._util import check_bool
from ._mla import MultiHeadLatentAttention
from ._nnx import MultiHeadLatentAttentionNNX
from ._rope import YarnScaling, yarn_mscale

_PREFIX = "model.layers.{}.self_attn."
_FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _get(config: Mapping, key: str, where: str = "config"):
  if key not in config:
    raise ValueError(f"{where}: missing key {key!r} (Hugging Face DeepseekV3 config.json)")
  return config[key]


def _yarn(config: Mapping) -> YarnScaling | None:
  scaling = config.get("rope_scaling")
  if scaling is None:
    return None
  if not isinstance(scaling, Mapping):
    raise ValueError(f"config['rope_scaling'] must be a dict or None, got {scaling!r}")
  kind = scaling.get("rope_type", scaling.get("type"))
  if kind != "yarn":
    raise ValueError(
        f"config['rope_scaling']: rope type {kind!r} (key 'type' or 'rope_type') is not "
        "supported; expected 'yarn' (DeepSeek-V3, Kimi K2)"
    )
  where = "config['rope_scaling']"
  factor = float(_get(scaling, "factor", where))
  original = _get(scaling, "original_max_position_embeddings", where)
  if _get(config, "max_position_embeddings") <= original:
    return None  # the reference uses YaRN only when max_seq_len > original_seq_len
  m_all, m = scaling.get("mscale_all_dim"), scaling.get("mscale")
  rotary = _hf_rotary_mscales(factor, m, m_all, scaling.get("attention_factor"))
  if any(not math.isclose(r, 1.0, rel_tol=1e-12) for r in rotary):
    raise ValueError(
        f"{where}: mscale={m!r} and mscale_all_dim={m_all!r} (factor {factor}) make Hugging "
        f"Face scale the rotary cos/sin by {rotary[0]:.6g} (DeepSeek's modeling code) / "
        f"{rotary[1]:.6g} (transformers), i.e. only the rope part of the logits; the module "
        "applies one temperature to the whole logit (DeepSeek-V3 reference), which equals "
        "Hugging Face's only when both keys are set to the same nonzero value (DeepSeek-V3, "
        "Kimi K2: 1.0 and 1.0)"
    )
  return YarnScaling(
      factor=factor, original_max_position=int(original),
      beta_fast=float(scaling.get("beta_fast") or 32.0),
      beta_slow=float(scaling.get("beta_slow") or 1.0),
      mscale=float(m_all or m or 1.0),
  )


def _hf_rotary_mscales(factor: float, mscale: float | None, mscale_all_dim: float | None,
                      attention_factor: float | None = None) -> tuple[float, float]:
  """The factors Hugging Face's DeepseekV3 multiplies its rotary cos/sin by (YaRN).

  Returns ``(deepseek, transformers)``: DeepSeek's ``modeling_deepseek.py``
  (``DeepseekV3YarnRotaryEmbedding``, defaults ``mscale=1``, ``mscale_all_dim=0``) and
  ``transformers``' ``_compute_yarn_parameters`` (``attention_factor`` if given, else the
  ratio when both keys are truthy, else ``yarn_mscale(factor)``). ``None`` = key missing.
  """
  deepseek = yarn_mscale(factor, 1.0 if mscale is None else mscale) / yarn_mscale(
      factor, 0.0 if mscale_all_dim is None else mscale_all_dim)
  if attention_factor is not None:
    transformers = float(attention_factor)
  elif mscale and mscale_all_dim:
    transformers = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
  else:
    transformers = yarn_mscale(factor)
  return float(deepseek), float(transformers)


def _config_bool(config: Mapping, key: str, default: bool) -> bool:
  """``config[key]`` (``default`` when missing), a JSON boolean: ``"false"`` is not ``False``."""
  value = config.get(key, default)
  check_bool(f"config[{key!r}]", value)
  return bool(value)


def _mla_kwargs(config: Mapping) -> dict[str, Any]:
  """The ``MultiHeadLatentAttention`` fields a Hugging Face DeepseekV3 config sets."""
  if not isinstance(config, Mapping):
    raise TypeError(f"config must be a dict (config.json), got {type(config).__name__}")
  if _config_bool(config, "attention_bias", False):
    raise ValueError("config['attention_bias'] is True; the MLA modules have no biases")
  return dict(
      num_heads=_get(config, "num_attention_heads"),
      q_lora_rank=_get(config, "q_lora_rank") or 0,  # null: a single q_proj
      kv_lora_rank=_get(config, "kv_lora_rank"),
      qk_nope_head_dim=_get(config, "qk_nope_head_dim"),
      qk_rope_head_dim=_get(config, "qk_rope_head_dim"),
      v_head_dim=_get(config, "v_head_dim"),
      rope_theta=float(_get(config, "rope_theta")),
      yarn=_yarn(config),
      rope_interleave=_config_bool(config, "rope_interleave", True),
  )


def mla_from_hf_config(config: Mapping, **overrides) -> MultiHeadLatentAttention:
  """A ``MultiHeadLatentAttention`` with the shapes, RoPE and YaRN of a DeepseekV3 config.

  Args:
    config: the parsed ``config.json`` of a DeepSeek-V3 / Kimi K2 checkpoint (keys
      ``num_attention_heads``, ``q_lora_rank`` (null: no query LoRA), ``kv_lora_rank``,
      ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``rope_theta``, and
      ``rope_scaling`` / ``max_position_embeddings`` / ``rope_interleave``; see the module
      docstring for how YaRN and its temperature are set).
    **overrides: other module fields (``impl``, ``is_causal``, ``dtype``, ...).

  Raises:
    ValueError: a needed key is missing (the message names it) or unsupported.

  Example:
    >>> from muonclip_jax.nn import mla_from_hf_config
    >>> config = {"hidden_size": 16, "num_attention_heads": 2, "q_lora_rank": None,
    ...           "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
    ...           "rope_theta": 10000.0, "max_position_embeddings": 64}  # a tiny config.json
    >>> attn = mla_from_hf_config(config, impl="dense")
    >>> attn.num_heads, attn.q_lora_rank, attn.rope_interleave, attn.yarn
    (2, 0, True, None)
  """
  return MultiHeadLatentAttention(**_mla_kwargs(config), **overrides)


def mla_nnx_from_hf_config(
    config: Mapping, *, rngs: nnx.Rngs, **overrides
) -> MultiHeadLatentAttentionNNX:
  """NNX twin of ``mla_from_hf_config`` (``in_features = config["hidden_size"]``).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from muonclip_jax.nn import mla_nnx_from_hf_config
    >>> config = {"hidden_size": 16, "num_attention_heads": 2, "q_lora_rank": None,
    ...           "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
    ...           "rope_theta": 10000.0, "max_position_embeddings": 64}  # a tiny config.json
    >>> model = mla_nnx_from_hf_config(config, impl="dense", rngs=nnx.Rngs(0))
    >>> model(jnp.ones((1, 3, 16))).shape
    (1, 3, 16)
  """
  kwargs = _mla_kwargs(config)
  return MultiHeadLatentAttentionNNX(
      _get(config, "hidden_size"), **kwargs, rngs=rngs, **overrides
  )


def _expected(config: Mapping) -> list[tuple[str, tuple[str, str], tuple[int, ...]]]:
  """(Hugging Face tensor suffix, module param path, torch shape) of one layer."""
  kw = _mla_kwargs(config)
  d = _get(config, "hidden_size")
  h, dn, dr, dv = kw["num_heads"], kw["qk_nope_head_dim"], kw["qk_rope_head_dim"], kw["v_head_dim"]
  qr, kvr = kw["q_lora_rank"], kw["kv_lora_rank"]
  if qr:
    q = [
        ("q_a_proj.weight", ("wq_a", "kernel"), (qr, d)),
        ("q_a_layernorm.weight", ("q_norm", "scale"), (qr,)),
        ("q_b_proj.weight", ("wq_b", "kernel"), (h * (dn + dr), qr)),
    ]
  else:
    q = [("q_proj.weight", ("wq", "kernel"), (h * (dn + dr), d))]
  return q + [
      ("kv_a_proj_with_mqa.weight", ("wkv_a", "kernel"), (kvr + dr, d)),
      ("kv_a_layernorm.weight", ("kv_norm", "scale"), (kvr,)),
      ("kv_b_proj.weight", ("wkv_b", "kernel"), (h * (dn + dv), kvr)),
      ("o_proj.weight", ("wo", "kernel"), (d, h * dv)),
  ]


class _Tensors:
  """name -> (dtype name, shape) and name -> array over a dict or safetensors files."""

  def __init__(self, source, stack: contextlib.ExitStack):
    self._arrays: Mapping[str, Any] = {}
    self._files: dict[str, Any] = {}
    if isinstance(source, Mapping):
      self._arrays = source
      self.description = f"the given mapping of {len(source)} tensors"
      return
    paths = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    files = []
    for p in map(Path, paths):
      files += sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files:
      raise ValueError(f"checkpoint: no .safetensors files in {paths}")
    try:
      from safetensors import safe_open
    except ImportError:  # pragma: no cover - depends on the environment
      raise ImportError(
          "reading safetensors needs the optional dependency: pip install 'muonclip_jax[hf]'"
      ) from None
    for f in files:
      if not f.is_file():
        raise ValueError(f"checkpoint: {f} is not a file")
      handle = stack.enter_context(safe_open(str(f), framework="np"))  # header only: lazy
      self._files.update(dict.fromkeys(handle.keys(), handle))
    self.description = f"{len(files)} safetensors file(s) under {files[0].parent}"

  def __contains__(self, name: str) -> bool:
    return name in self._arrays or name in self._files

  def info(self, name: str) -> tuple[str, tuple[int, ...]]:
    if name in self._files:
      sl = self._files[name].get_slice(name)
      dtype = sl.get_dtype()
      return _FLOAT_DTYPES.get(dtype, dtype.lower()), tuple(sl.get_shape())
    a = np.asarray(self._arrays[name])
    return a.dtype.name, a.shape

  def read(self, name: str) -> np.ndarray:
    if name in self._files:
      return self._files[name].get_tensor(name)
    return np.asarray(self._arrays[name])


def _read_checked(tensors: _Tensors, name: str, shape: tuple[int, ...]) -> np.ndarray:
  if name not in tensors:
    raise ValueError(f"{name}: not found in {tensors.description}; expected shape {shape}")
  dtype, got = tensors.info(name)
  if dtype.startswith(("f8", "float8")):
    raise ValueError(
        f"{name}: dtype {dtype} is FP8 (a block-quantized checkpoint with weight_scale_inv "
        "scales); dequantize it to bfloat16 first, e.g. with DeepSeek-V3's "
        "inference/fp8_cast_bf16.py"
    )
  if dtype not in _FLOAT_DTYPES.values():
    raise ValueError(f"{name}: expected a float32/bfloat16/float16 tensor, got dtype {dtype}")
  if got != shape:
    raise ValueError(f"{name}: expected shape {shape} (torch (out, in) layout), got {got}")
  return tensors.read(name)


def load_hf_mla_params(
    checkpoint, config: Mapping, *, layers: int | Sequence[int], dtype: Any = np.float32
) -> dict[str, dict[str, np.ndarray]]:
  """Attention weights of Hugging Face DeepseekV3 layers as ``MultiHeadLatentAttention`` params.

  Reads ``model.layers.{i}.self_attn.`` ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` (or
  ``q_proj`` without query LoRA), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
  ``kv_b_proj``, ``o_proj`` (``.weight``, torch ``(out, in)`` layout) and transposes each
  matrix to the module's ``(in, out)`` kernel. Column order is unchanged: Hugging Face and
  the reference lay out ``q_b_proj`` / ``kv_b_proj`` head-major (``[nope | rope]`` and
  ``[k_nope | v]`` per head) and ``kv_a_proj_with_mqa`` as ``[latent | k_rope]``, like the
  module; the rotary columns are kept in the checkpoint's pairing, so build the module
  with the config's ``rope_interleave`` (``mla_from_hf_config`` does).

  Args:
    checkpoint: a ``.safetensors`` file, a directory of them, a list of files, or a
      mapping ``name -> array`` (e.g. a state dict converted to NumPy). Files are opened
      lazily: only the headers and the tensors named above are read.
    config: the checkpoint's ``config.json`` dict (gives the expected shapes).
    layers: a layer index, giving that layer's params; or a sequence of indices, giving
      every param stacked on a leading axis in that order (for ``nn.scan`` with
      ``variable_axes={"params": 0}``, or an ``nnx.vmap``-built stack).
    dtype: dtype of the returned arrays (float32 master weights by default).

  Returns:
    ``{"wq_a": {"kernel": ...}, "q_norm": {"scale": ...}, "wq_b": ..., "wkv_a": ...,
    "kv_norm": ..., "wkv_b": ..., "wo": ...}`` (``"wq"`` instead of the first three
    without query LoRA) of host NumPy arrays: ``module.apply({"params": params}, x)``;
    ``jax.device_put(params, shardings)`` to place them; for NNX,
    ``nnx.replace_by_pure_dict(state, params)`` on ``nnx.state(model, nnx.Param)``.
    Accepted tensor dtypes: float32, bfloat16, float16, float64.

  Raises:
    ValueError: a missing config key or tensor, a tensor of the wrong shape (the message
      names it and the expected shape), or an FP8 tensor.

  Example:
    >>> import numpy as np
    >>> from muonclip_jax.nn import load_hf_mla_params
    >>> config = {"hidden_size": 16, "num_attention_heads": 2, "q_lora_rank": None,
    ...           "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
    ...           "rope_theta": 10000.0, "max_position_embeddings": 64}
    >>> shapes = {"q_proj": (16, 16), "kv_a_proj_with_mqa": (12, 16), "kv_a_layernorm": (8,),
    ...           "kv_b_proj": (16, 8), "o_proj": (16, 8)}  # torch (out, in)
    >>> checkpoint = {f"model.layers.{i}.self_attn.{name}.weight": np.zeros(shape, np.float32)
    ...               for i in range(2) for name, shape in shapes.items()}
    >>> params = load_hf_mla_params(checkpoint, config, layers=[0, 1])  # stacked for nn.scan
    >>> sorted(params), params["wq"]["kernel"].shape  # (layers, in, out)
    (['kv_norm', 'wkv_a', 'wkv_b', 'wo', 'wq'], (2, 16, 16))
  """
  stacked = not isinstance(layers, int)
  indices = list(layers) if stacked else [layers]
  if not indices or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                            for i in indices):
    raise ValueError(f"layers must be an int >= 0 or a non-empty sequence of them, got {layers!r}")
  dtype = np.dtype(dtype)
  expected = _expected(config)
  params: dict[str, dict[str, np.ndarray]] = {}
  with contextlib.ExitStack() as stack:
    tensors = _Tensors(checkpoint, stack)
    for suffix, (module, leaf), shape in expected:
      out = np.empty((len(indices), *shape[::-1]), dtype)
      for j, i in enumerate(indices):
        out[j] = _read_checked(tensors, _PREFIX.format(i) + suffix, shape).T.astype(dtype)
      params.setdefault(module, {})[leaf] = out if stacked else out[0]
  return params
