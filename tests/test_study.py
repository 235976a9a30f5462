"""The stability study (examples/stability_study.py) at a tiny size, its bad flags, and the
demo model's GQA / QK-Norm option it relies on."""

import json
import math
import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import stability_study  # noqa: E402
from mla_lm import LMConfig, init_params, make_loss_fn  # noqa: E402

ARMS = ("adamw", "muon", "muonclip", "muonclip-exact", "muon-per-head", "muonclip-per-head", "muon-gqa",
        "muon-gqa-groups", "muon-qknorm", "muonclip-tau3")
TINY = ["--steps", "2", "--seeds", "1", "--taus", "5,3", "--batch", "4", "--seq", "32", "--eval-every", "1"]


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
  out = tmp_path_factory.mktemp("study")
  docs = tmp_path_factory.mktemp("docs")
  rc = stability_study.main(TINY + ["--out", str(out), "--docs", str(docs)])
  assert rc == 0
  return out, docs


def _rows(markdown):
  return {line.split("|")[1].strip(): line for line in markdown.splitlines() if line.startswith("| ")}


def test_tiny_run_writes_a_row_for_every_arm_and_the_pictures(tiny_study):
  out, docs = tiny_study
  text = (out / "study.md").read_text()
  rows = _rows(text)
  for name in ARMS:
    cells = [c.strip() for c in rows[name].split("|")[1:-1]]
    assert len(cells) == 11
    mean, std = (float(v) for v in cells[4].split(" ± "))
    assert math.isfinite(mean) and std == 0.0  # one seed
    assert math.isfinite(float(cells[6])) and cells[8].endswith("%") and float(cells[10]) > 0
    if name == "adamw" or "clip" not in name:  # the per-head update-RMS spread of every Muon step without a clip
      assert (cells[9] == "-") == (name == "adamw"), (name, cells[9])
  assert "| muonclip-tau3 | MLA | Algorithm 1 | 3 |" in text
  assert "| muon-qknorm | GQA + QK-Norm | none | 5 |" in text
  assert "## Tau ablation" in text
  for name in stability_study.PICTURES:
    assert (out / name).stat().st_size > 10_000
    assert f"]({name})" in text
    assert (docs / name).read_bytes() == (out / name).read_bytes()
  assert "heatmap" in stability_study.PICTURES[1]
  assert (docs / "study.md").read_text() == text


def test_every_run_logs_per_head_maxima_and_arms_share_init_and_batches(tiny_study):
  out, _ = tiny_study
  first = {}
  for name in ARMS:
    recs = [json.loads(line) for line in (out / name / "seed0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2] and all("val_loss" in r for r in recs)
    for r in recs:
      per_head = np.asarray(r["max_logits"]["layers/attn"])
      assert per_head.shape == (2, 4)  # (layers, heads)
      np.testing.assert_allclose(per_head.max(-1), r["max_logit_per_layer"]["layers/attn"])
      assert r["max_logit"] == pytest.approx(per_head.max())
    first[name] = recs[0]["loss"]
    if name != "adamw":  # step 1 has learning rate 0 (warm-up): no update to measure
      assert recs[0]["update_rms_spread"] is None
  # Per head, every block's update has the RMS 0.2 to the Newton–Schulz band: at most 1.2 / 0.78 apart.
  spread = {n: json.loads((out / n / "seed0" / "metrics.jsonl").read_text().splitlines()[1])["update_rms_spread"]
            for n in ("muon", "muon-per-head")}
  assert 1.0 <= spread["muon-per-head"] < 1.6 and spread["muon"] >= 1.0, spread
  # Step 1's loss is the forward pass of the initial params on the first batch: the same in
  # every MLA arm (same seed), different for the GQA models.
  mla = {first[n] for n in ARMS if "gqa" not in n and "qknorm" not in n}
  assert len(mla) == 1
  assert first["muon-gqa"] not in mla and first["muon-qknorm"] not in mla


def test_report_only_rebuilds_the_same_study(tiny_study, tmp_path):
  out, _ = tiny_study
  before = (out / "study.md").read_text()
  assert stability_study.main(TINY + ["--out", str(out), "--report-only"]) == 0
  assert (out / "study.md").read_text() == before


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
        (["--seeds", "0"], "--seeds must be >= 1, got 0"),
        (["--taus", "30,abc"], "--taus must be comma-separated numbers, got '30,abc'"),
        (["--taus", "30,-1"], "--taus must be finite and > 0, got '30,-1'"),
        (["--taus", "30,nan"], "--taus must be finite and > 0, got '30,nan'"),
        (["--taus", "30,20,30"], "--taus repeats a value: '30,20,30'"),
        (["--mesh", "3,1"], "--mesh 3,1 needs 3 devices, but JAX sees 8"),
        (["--mesh", "2x4"], "--mesh must be DATA,EXPERT,MODEL or DATA,MODEL (integers), got '2x4'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--report-only"], "--report-only:"),
        (["--arms", "muon,nope"], "--arms takes names from ['adamw', "),
    ],
)
def test_bad_flags_give_one_line_and_exit_status_2(argv, message, capsys, tmp_path):
  rc = stability_study.main(argv + ["--out", str(tmp_path / "none")])
  err = capsys.readouterr().err
  assert rc == 2
  assert err.count("\n") == 1 and err.startswith("stability_study.py: error: ") and message in err
  assert "Traceback" not in err


@pytest.mark.parametrize("flag", ["--out", "--docs"])
def test_an_output_path_that_cannot_be_created_gives_one_line_and_exit_status_2(flag, capsys, tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("a regular file, not a directory")
  argv = TINY + ["--out", str(tmp_path / "out"), flag, str(blocker / "sub")]
  rc = stability_study.main(argv)
  err = capsys.readouterr().err
  assert rc == 2
  assert err.count("\n") == 1 and err.startswith(f"stability_study.py: error: {flag} ") and "Traceback" not in err
  assert "cannot create or write the directory" in err
  assert not (tmp_path / "out" / "adamw").exists()  # failed before any training


def test_one_step_is_accepted_and_every_arm_builds():
  # --steps 1 used to crash every arm in optax (a cosine decay of 0 steps). A full 1-step
  # study takes minutes of compilation; the demo's test runs one step end to end.
  args = stability_study.parse_args(["--steps", "1", "--taus", "5,3"])
  assert args.steps == 1
  for arm in stability_study.arms(args.taus):
    stability_study.build(arm, 1, None)
  for peak in (stability_study.demo.LR_ADAMW, stability_study.demo.LR_MUON):
    lr = stability_study.demo.lr_schedule(peak, 1)
    assert all(math.isfinite(float(lr(t))) for t in range(3)) and float(lr(1)) == pytest.approx(peak)


def _maxima(cfg, params, tokens):
  _, inter = jax.jit(make_loss_fn(cfg))(params, tokens)
  return np.asarray(inter["layers"]["attn"]["max_logits"][0])  # layer 0


def test_qk_norm_option_makes_logits_invariant_to_the_query_and_key_kernels_scale():
  cfg = LMConfig(dim=32, num_layers=2, num_heads=4, mlp_dim=64, attention="gqa", num_kv_heads=2, head_dim=8,
                 qk_norm=True)
  params = jax.jit(lambda: init_params(cfg, 0))()
  assert params["layers"]["attn"]["q_norm"]["scale"].shape == (2, 8)
  tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
  def scaled(path):
    return "'wq'" in jax.tree_util.keystr(path) or "'wk'" in jax.tree_util.keystr(path)

  grown = jax.tree_util.tree_map_with_path(lambda path, x: x * 50.0 if scaled(path) else x, params)
  # The scaling must actually have hit the query and key kernels (else grown == params and the
  # invariance below would hold trivially).
  hit = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params) if scaled(path)]
  assert any("'wq'" in k for k in hit) and any("'wk'" in k for k in hit)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(grown)):
    if scaled(path):
      np.testing.assert_allclose(np.asarray(y), 50.0 * np.asarray(x))
      assert not np.allclose(np.asarray(y), np.asarray(x))
    else:
      np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  np.testing.assert_allclose(_maxima(cfg, grown, tokens), _maxima(cfg, params, tokens), rtol=1e-4)
  plain = LMConfig(**{**cfg.__dict__, "qk_norm": False})
  params = jax.jit(lambda: init_params(plain, 0))()
  grown = jax.tree.map(lambda x: x, params)
  grown["layers"]["attn"]["wq"]["kernel"] = params["layers"]["attn"]["wq"]["kernel"] * 2.0
  np.testing.assert_allclose(_maxima(plain, grown, tokens), 2.0 * _maxima(plain, params, tokens), rtol=1e-4)
  assert cfg.layout.num_kv_heads == 2 and LMConfig().layout.qk_rope_head_dim == 16


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(attention="mha"), "LMConfig.attention must be 'mla' or 'gqa', got 'mha'"),
        (dict(qk_norm=True), "LMConfig.qk_norm needs attention='gqa'"),
    ],
)
def test_model_option_rejects_bad_settings(kw, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    LMConfig(**kw)

