"""The installed MaxText (0.2.5), its own NNX models in its ``nnx.Optimizer`` loop, scanned and unscanned.

MaxText's ``TrainStateNNX.apply_gradients`` (``nnx.Optimizer.update``) with MaxText's own
pre-training ``loss_fn``, on tiny configs: DeepSeek-V3-style (``deepseek3-tiny`` shrunk: MLA,
1 dense + 2 MoE layers, 4 experts top-2, a shared expert, a routing bias; the experts by
MaxText's ``ragged_dot`` path, not its megablox kernel, which runs in Pallas interpret mode off
a TPU) and Llama-style dense GQA, each with ``scan_layers`` on (MaxText 0.2.5 names the
scanned axes ``dense_layers``/``moe_layers``, on axis 1) and off.

Checks: ``mc.muon_adamw(lr)`` with nothing else trains 2 steps; each expert's (and each
layer's) update is the Newton–Schulz polar factor of that expert's own gradient alone, with
its singular values <= 1.25 and its responses along the gradient's singular pairs (NumPy's SVD,
those above 3e-3 of its norm) within [0.70, 1.25].
``mc.muonclip`` with MaxText's own ``use_qk_clip`` maxima trains 2 steps and clips; the clip
equals MaxText's ``apply_qk_clip_nnx`` (unscanned, where MaxText's rule is per layer), and
recomputing MaxText's maxima after ``qk_clip`` gives every clipped head <= tau (1 + 1e-5) and
every other head its old maximum.
"""

import functools
import sys

import pytest

if sys.version_info < (3, 12):
  pytest.skip("MaxText 0.2.5 needs Python >= 3.12 (and JAX >= 0.11); the Python 3.12 suite runs it",
              allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from maxtext.common.train_state_nnx import TrainStateNNX  # noqa: E402  (on 3.12 a missing MaxText fails)
from maxtext.utils import qk_clip_utils  # noqa: E402

import muonclip_jax as mc  # noqa: E402
import _maxtext_package as mtp  # noqa: E402

LR = 1e-2


@pytest.fixture(autouse=True)
def _maxtext_broadcasts():
  """MaxText's routing adds a bias (E,) to scores (B, T, E): rank promotion, which conftest raises on."""
  with jax.numpy_rank_promotion("allow"):
    yield
LAYOUT = mc.MLALayout(4, 8, 4, 8)  # MaxText's MLA: wq_b (q_lora, heads, 8 + 4), wkv_b (kv_lora, heads, 8 + 8)


def _params(model) -> dict:
  return jax.tree.map(np.asarray, nnx.state(model, nnx.Param).to_pure_dict())


def _at(tree, path):
  for k in path.split("/"):
    tree = tree[k]
  return tree


_NS = jax.jit(functools.partial(mc.newton_schulz, steps=None, coeffs="polar_express_4"))  # compiled once a shape


def _ns(g):
  return np.asarray(_NS(jnp.asarray(g, jnp.float32)))


def _check_matrices(before, after, grads, path, batch, fan_in, fan_out):
  """Every matrix of the leaf at ``path`` (``batch`` axes stacked): its update, divided by
  ``lr * 0.2 * sqrt(max(in, out))``, is Newton–Schulz of its own gradient, in band. Returns the
  singular-value range."""
  w0, w1, g = (np.asarray(_at(t, path), np.float64) for t in (before, after, grads))
  perm = batch + fan_in + fan_out
  shape = lambda x: np.transpose(x, perm).reshape(-1, np.prod([x.shape[a] for a in fan_in]),
                                                  np.prod([x.shape[a] for a in fan_out]))
  upd, gm = shape((w0 - w1) / LR), shape(g)
  rows, cols = upd.shape[1:]
  upd = upd / (0.2 * np.sqrt(max(rows, cols)))
  lo, hi = np.inf, 0.0
  for o, gi in zip(upd, gm):
    np.testing.assert_allclose(o, _ns(gi), atol=2e-4, err_msg=path)  # its own matrix, nothing else's
    u, sg, vt = np.linalg.svd(gi.astype(np.float64), full_matrices=False)
    keep = sg >= 3e-3 * np.linalg.norm(sg)  # Muon's band along the gradient's own singular pairs (NumPy)
    resp = np.einsum("ik,ij,kj->k", u[:, keep], o, vt[keep])  # u_k^T O v_k
    assert 0.70 <= resp.min() and resp.max() <= 1.25, (path, resp.min(), resp.max())
    s = np.linalg.svd(o, compute_uv=False)
    lo, hi = min(lo, s.min()), max(hi, s.max())
  assert hi <= 1.25, (path, lo, hi)  # small singular values of a near rank-deficient gradient stay small
  return lo, hi


def _train(cfg, model, mesh, tx, *, clip: bool):
  """2 steps of MaxText's loop: its loss_fn, TrainStateNNX.apply_gradients (nnx.Optimizer.update)."""
  grads_of = mtp.loss_and_grads(cfg)
  with mtp.context(cfg, mesh):
    state = TrainStateNNX(model, nnx.Optimizer(model, tx, wrt=nnx.Param))

    @nnx.jit
    def step(state, data):
      (loss, inter), grads = grads_of(state.model, data)
      if clip:  # MuonClip (3/3): MaxText's own maxima (use_qk_clip=True), reduced over the batch
        state.apply_gradients(grads, max_logits=mc.reduce_max_logits(inter))
      else:
        state.apply_gradients(grads)
      return loss, grads

    data, out = mtp.batch(cfg), []
    for _ in range(2):
      before = _params(model)
      loss, grads = step(state, data)
      out.append((before, jax.tree.map(np.asarray, grads.to_pure_dict()), _params(model), float(loss)))
  assert all(np.isfinite(o[3]) for o in out) and out[1][3] < out[0][3]
  return state, out


DENSE = {  # path: (batch, fan_in, fan_out) axes, unscanned; scanned inserts the layer axis at 1
    "self_attention/wq_b/kernel": ((), (0,), (1, 2)), "self_attention/wkv_b/kernel": ((), (0,), (1, 2)),
    "self_attention/out/kernel": ((), (0, 1), (2,)), "mlp/wi_0/kernel": ((), (0,), (1,))}
MOE = {"DeepSeekMoeBlock_0/MoeBlock_0/wi_0": ((0,), (1,), (2,)), "DeepSeekMoeBlock_0/MoeBlock_0/wo": ((0,), (1,), (2,)),
       "DeepSeekMoeBlock_0/shared_experts/wi_1/kernel": ((), (0,), (1,)),
       "DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel": ((), (0,), (1,))}


def _scanned(axes):
  """The same leaf with MaxText's layer axis at 1 (param_scan_axis=1): batched."""
  shift = lambda t: tuple(a + (a >= 1) for a in t)
  batch, fi, fo = axes
  return tuple(sorted(shift(batch) + (1,))), shift(fi), shift(fo)


def _expert_checks(scan: bool, *, attention: bool = True) -> dict:
  """The leaves whose every matrix is checked (``_check_matrices``): MLA's, the dense MLP's, each
  expert's, the shared expert's and the router's; ``attention=False`` leaves out ``wq_b``/``wkv_b``,
  which the clip scales after the update."""
  dense = {k: v for k, v in DENSE.items() if attention or not k.endswith(("wq_b/kernel", "wkv_b/kernel"))}
  dec = "decoder/"
  if scan:
    checks = {dec + "dense_layers/" + k: _scanned(v) for k, v in dense.items()}
    return checks | {dec + "moe_layers/" + k: _scanned(v) for k, v in MOE.items()}
  checks = {dec + "dense_layers_0/" + k: v for k, v in dense.items()}
  return checks | {dec + f"moe_layers_{i}/" + k: v for k, v in MOE.items() for i in (0, 1)}


def _check_experts(model, steps, scan: bool, *, attention: bool = True) -> None:
  before, grads, after, _ = steps[0]
  bands = {p: _check_matrices(before, after, grads, p, *axes)
           for p, axes in _expert_checks(scan, attention=attention).items()}
  expert = [v for p, v in bands.items() if p.endswith(("MoeBlock_0/wi_0", "MoeBlock_0/wo"))]
  assert len(expert) == (2 if scan else 4)
  # the routing bias is no nnx.Param (nnx.Optimizer never hands it over); embedding and head: AdamW
  labels = mc.muon_labels(nnx.state(model, nnx.Param))
  assert _at(labels, "token_embedder/embedding") == "adam" and _at(labels, "decoder/logits_dense/kernel") == "adam"


def test_deepseek_moe_muon_adamw_per_expert():
  """``mc.muon_adamw(lr)`` and nothing else, scanned (the unscanned model trains in the muonclip test)."""
  cfg = mtp.config(mtp.DEEPSEEK, scan=True)
  model, mesh = mtp.model_and_mesh(cfg)
  _, steps = _train(cfg, model, mesh, mc.muon_adamw(LR, weight_decay=0.0), clip=False)
  _check_experts(model, steps, scan=True)


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_llama_dense_muon_adamw(scan):
  cfg = mtp.config(mtp.LLAMA, scan=scan)
  model, mesh = mtp.model_and_mesh(cfg)
  _, steps = _train(cfg, model, mesh, mc.muon_adamw(LR, weight_decay=0.0), clip=False)
  before, grads, after, _ = steps[0]
  attn = {"self_attention/query/kernel": ((), (0,), (1, 2)), "self_attention/key/kernel": ((), (0,), (1, 2)),
          "self_attention/out/kernel": ((), (0, 1), (2,)), "mlp/wo/kernel": ((), (0,), (1,))}
  if scan:
    checks = {"decoder/layers/" + k: _scanned(v) for k, v in attn.items()}
  else:
    checks = {f"decoder/layers_{i}/" + k: v for k, v in attn.items() for i in (0, 1)}
  for p, axes in checks.items():
    _check_matrices(before, after, grads, p, *axes)


def _forward(cfg, mesh):
  """``model -> {attention: (heads,) maxima}``: MaxText's own (use_qk_clip), of one forward pass of its
  ``loss_fn`` on the batch, reduced over it; and the raw intermediates. Compiled once per config."""
  from maxtext.trainers.pre_train import train as mt_train

  @nnx.jit
  def forward(model, data):
    _, aux = mt_train.loss_fn(model, cfg, dict(data), None, None, is_train=True)
    return aux["intermediate_outputs"]

  def run(model):
    with mtp.context(cfg, mesh):
      inter = forward(model, mtp.batch(cfg))
    return mc.reduce_max_logits(inter), inter

  return run


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_deepseek_muonclip_with_maxtext_maxima(scan):
  cfg = mtp.config(mtp.DEEPSEEK, scan=scan, use_qk_clip=True, dtype="float32")
  model, mesh = mtp.model_and_mesh(cfg)
  forward = _forward(cfg, mesh)
  flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(forward(model)[0])])
  tau = float(np.quantile(flat, 0.6))  # some heads above tau, some below
  tx = mc.muonclip(LR, layout=LAYOUT, qk_clip_threshold=tau, weight_decay=0.0)  # MuonClip (2/3): the optimizer
  state, steps = _train(cfg, model, mesh, tx, clip=True)
  assert int(state.optimizer.opt_state[1].num_clipped[...]) > 0
  _check_experts(model, steps, scan, attention=False)  # each expert its own matrix (the clip leaves them)
  # the clip alone, on the trained model, at a tau that half the first layer's heads exceed (training has
  # clipped them to the first tau already): MaxText's rule gives the same kernels, its maxima after it
  maxima, inter = forward(model)
  first = [p for p in _paths(maxima) if "/dense_layers" in p]
  tau = float(np.median(np.concatenate([np.ravel(_at(maxima, p)) for p in first])))
  boxed = mc.qk_clip(nnx.state(model, nnx.Param), maxima, qk_clip_threshold=tau, layout=LAYOUT)  # names read
  ours = jax.tree.map(np.asarray, nnx.State(boxed).to_pure_dict())
  if not scan:  # MaxText's own rule (per layer when unscanned): the same kernels
    with_tau = mtp.config(mtp.DEEPSEEK, scan=scan, use_qk_clip=True, dtype="float32", qk_clip_threshold=tau)
    before_theirs = _params(model)
    qk_clip_utils.apply_qk_clip_nnx(state, {"intermediates": None} | inter, with_tau)
    theirs = _params(model)
    kernels = [p for p in _paths(ours) if p.endswith(("wq_b/kernel", "wkv_b/kernel"))]
    assert any(not np.allclose(_at(theirs, p), _at(before_theirs, p)) for p in kernels)  # it did clip
    for path in kernels:
      np.testing.assert_allclose(_at(ours, path), _at(theirs, path), rtol=1e-6, atol=1e-7, err_msg=path)
  nnx.update(model, boxed)
  after, _ = forward(model)
  # the first attention layer sees the same input (later layers see the clipped layers' outputs)
  hits = 0
  for path in first:
    old, new = np.asarray(_at(maxima, path)), np.asarray(_at(after, path))
    hit = old > tau
    hits += int(hit.sum())
    assert np.all(new[hit] <= tau * (1 + 1e-5)), (path, new[hit], tau)
    np.testing.assert_allclose(new[~hit], old[~hit], rtol=1e-5, err_msg=path)
  assert hits > 0  # heads above tau: the bound is tested


def _paths(tree):
  return [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
