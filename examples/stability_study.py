"""The stability study: does MuonClip keep Muon's gains without Muon's logit growth?

The demo's model and data (``mla_lm.py``, ``train_mla_lm.py``), several seeds, these arms
(for a given seed: the same initialization and the same batches in every arm):

  adamw           MLA  optax.adamw
  muon            MLA  muonclip_jax.muon_adamw, no clip
  muonclip        MLA  muonclip_jax.muonclip: QK-Clip inside the optimizer with the forward
                       pass's maxima (Kimi K2, arXiv 2507.20534, Algorithm 1)
  muonclip-exact  MLA  muon_adamw + make_train_step(exact_clip=True): the clip on the maxima
                       of the updated weights on the step's batch
  muon-per-head   MLA  muon_adamw(layout=..., muon_blocks="head"), no clip: each head's block
                       of wq_b and wkv_b orthogonalized on its own (Kimi K3's per-head Muon)
  muonclip-per-head
                  MLA  muonclip(muon_blocks="head"): per-head Muon and QK-Clip
  muon-gqa        GQA  muon_adamw, no clip: the control of the next two arms
  muon-gqa-groups GQA  muon_adamw(layout=..., muon_blocks="group:kv"), no clip: Muon per GQA
                       group (the 2 query heads that share a key/value head one block, each
                       key/value head its own; Group Muon, arXiv 2605.08933)
  muon-qknorm     GQA  muon_adamw, RMSNorm on each head's queries and keys (QK-Norm); MLA has
                       no plain QK-Norm (its rotary key is one head shared by all heads)

and a tau ablation: ``muonclip`` at every further value of ``--taus`` (the arms use the
first). Every Muon run also records, per step, the spread over heads of the per-head RMS of
Muon's update of the query/key(/value) projections (``update_rms_spread``: the largest head's
RMS over the smallest's, averaged over layers and projections), Kimi K3's motivation for
per-head Muon. Writes ``<out>/<run>/seed<k>/metrics.jsonl`` per run, ``<out>/study.md`` (tables
and a reading of them) and the pictures ``study_loss.png``, ``study_heatmap.png``,
``study_clipped.png``; ``--docs DIR`` copies study.md and the pictures there.

  python examples/stability_study.py [--steps 200] [--seeds 3] [--taus 25,15,35]
      [--mesh DATA,[EXPERT,]MODEL] [--out runs/study] [--docs DIR]
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_mla_lm as demo  # noqa: E402
from train_mla_lm import UsageError  # noqa: E402

PICTURES = ("study_loss.png", "study_heatmap.png", "study_clipped.png")


class Arm(NamedTuple):
  name: str
  model: str  # "mla", "gqa" or "gqa+qknorm"
  optimizer: str  # "adamw" or "muon"
  clip: str | None  # None, "alg1" or "exact"
  tau: float
  reference: str | None  # the arm its paired validation-loss difference is taken against
  blocks: str = "matrix"  # muon_blocks: "matrix" (each projection one matrix), "head" or "group:kv"


def arms(taus: list[float]) -> list[Arm]:
  tau = taus[0]
  main = [
      Arm("adamw", "mla", "adamw", None, tau, "muon"),
      Arm("muon", "mla", "muon", None, tau, None),
      Arm("muonclip", "mla", "muon", "alg1", tau, "muon"),
      Arm("muonclip-exact", "mla", "muon", "exact", tau, "muon"),
      Arm("muon-per-head", "mla", "muon", None, tau, "muon", "head"),
      Arm("muonclip-per-head", "mla", "muon", "alg1", tau, "muonclip", "head"),
      Arm("muon-gqa", "gqa", "muon", None, tau, "muon"),
      Arm("muon-gqa-groups", "gqa", "muon", None, tau, "muon-gqa", "group:kv"),
      Arm("muon-qknorm", "gqa+qknorm", "muon", None, tau, "muon-gqa"),
  ]
  return main + [Arm(f"muonclip-tau{t:g}", "mla", "muon", "alg1", t, "muon") for t in taus[1:]]


def parse_args(argv):
  p = demo.ArgumentParser(description="MuonClip stability study: AdamW, Muon, MuonClip, QK-Norm over seeds.")
  p.add_argument("--steps", type=int, default=200, help="training steps per run")
  p.add_argument("--seeds", type=int, default=3, help="number of seeds (0, 1, ...) per arm")
  p.add_argument("--taus", default="25,15,35", help="QK-Clip thresholds: the arms use the first, the ablation all")
  p.add_argument("--mesh", default=None,
                 help="DATA,MODEL (or DATA,EXPERT,MODEL) device mesh, e.g. 2,4 (fake CPU devices if needed)")
  p.add_argument("--out", default="runs/study", help="output directory")
  p.add_argument("--docs", default=None, help="also copy study.md and the pictures to this directory")
  p.add_argument("--report-only", action="store_true", help="rebuild study.md and the pictures from --out's runs")
  p.add_argument("--arms", default=None,
                 help="comma-separated arm names: run only these, and print their table rows (no study.md)")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--eval-every", type=int, default=25)
  args = p.parse_args(argv)
  if args.steps < 1:
    raise UsageError(f"--steps must be >= 1, got {args.steps}")
  if args.seeds < 1:
    raise UsageError(f"--seeds must be >= 1, got {args.seeds}")
  try:
    taus = [float(v) for v in args.taus.split(",")]
  except ValueError:
    raise UsageError(f"--taus must be comma-separated numbers, got {args.taus!r}") from None
  bad = [t for t in taus if not t > 0 or math.isinf(t)]
  if bad:
    raise UsageError(f"--taus must be finite and > 0, got {args.taus!r}")
  if len(set(taus)) != len(taus):
    raise UsageError(f"--taus repeats a value: {args.taus!r}")
  args.taus = taus
  if args.arms is not None:
    names = [a.name for a in arms(taus)]
    args.arms = args.arms.split(",")
    unknown = [a for a in args.arms if a not in names]
    if unknown or args.report_only or args.docs:
      raise UsageError(f"--arms takes names from {names}, without --report-only or --docs; got {unknown or args.arms}")
  if args.mesh is not None:
    args.mesh = demo.parse_mesh(args.mesh)
  return args


def main(argv=None) -> int:
  try:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.report_only or os.path.isdir(args.out):  # --report-only reads --out: a missing one is reported there
      demo.prepare_dir(args.out)
    if args.docs:
      demo.prepare_dir(args.docs, "--docs")
    if args.mesh is not None:
      demo.use_devices(args.mesh)
    return run(args)
  except UsageError as e:
    print(f"stability_study.py: error: {e}", file=sys.stderr)
    return 2


def build(arm: Arm, steps: int, shardings):
  """``(LMConfig, optimizer, make_train_step keywords)`` of one arm.

  tau goes to the optimizer when it clips (``muonclip``), else to the train step (its
  metrics, and the exact clip).
  """
  import optax

  import muonclip_jax as mc
  from mla_lm import MATRIX_AXES

  cfg = model_config(arm)
  if arm.optimizer == "adamw":
    return (cfg, optax.adamw(demo.lr_schedule(demo.LR_ADAMW, steps), b1=0.9, b2=0.95, weight_decay=0.1),
            dict(qk_clip_threshold=arm.tau))
  lr = demo.lr_schedule(demo.LR_MUON, steps)
  kw = dict(matrix_axes=MATRIX_AXES, shard_orthogonalization=shardings)
  if arm.clip == "alg1":
    return cfg, mc.muonclip(lr, layout=cfg.layout, qk_clip_threshold=arm.tau, muon_blocks=arm.blocks, **kw), {}
  step_kw = dict(exact_clip=True, layout=cfg.layout) if arm.clip == "exact" else {}
  if arm.blocks != "matrix":  # the layout declares the heads for Muon alone
    kw.update(layout=cfg.layout, muon_blocks=arm.blocks)
  return cfg, mc.muon_adamw(lr, **kw), dict(qk_clip_threshold=arm.tau, **step_kw)


MUON_WEIGHT_DECAY = 0.1  # muon_adamw's default, which build() keeps


def update_rms_spread(cfg, steps: int):
  """``demo.train``'s ``extra`` for a Muon arm: the spread over heads of Muon's per-head update RMS.

  Muon's update ``O`` (orthogonalized and RMS-matched, before the learning rate) is read back
  from the step: ``new = old - lr_t (O + wd old)`` (decoupled weight decay), so ``O = (old -
  new) / lr_t - wd old``. For each projection with heads (MLA: ``wq_b``, ``wkv_b``; GQA:
  ``wq``, ``wk``, ``wv``) and each layer: the RMS of every head's columns of ``O``, and their
  largest over their smallest; recorded as the mean over layers and projections. A step with
  ``lr_t = 0`` (the first warm-up step), or whose clip scaled a head (its correction is in the
  difference too), records None. Whole-matrix Muon lets a head with small momentum get a
  small update (Kimi K3, section 2.5); per head, every block has the RMS 0.2.
  """
  import jax
  import jax.numpy as jnp

  lr = demo.lr_schedule(demo.LR_MUON, steps)
  heads = ({"wq_b": cfg.num_heads, "wkv_b": cfg.num_heads} if cfg.attention == "mla" else
           {"wq": cfg.num_heads, "wk": cfg.num_kv_heads, "wv": cfg.num_kv_heads})

  @jax.jit
  def spread(old, new, lr_t):
    out = []
    for name, h in heads.items():
      a, b = old["layers"]["attn"][name]["kernel"], new["layers"]["attn"][name]["kernel"]
      o = (a - b) / lr_t - MUON_WEIGHT_DECAY * a  # (layers, in, heads * width)
      rms = jnp.sqrt(jnp.mean(o.reshape(*o.shape[:-1], h, -1) ** 2, axis=(1, 3)))  # (layers, heads)
      out.append(jnp.max(rms, axis=-1) / jnp.min(rms, axis=-1))
    return jnp.mean(jnp.stack(out))

  def extra(old, new, step, rec):
    lr_t = float(lr(step - 1))  # the update of step t uses the schedule at count t - 1
    if lr_t == 0.0 or rec["num_clipped"]:
      return {"update_rms_spread": None}
    return {"update_rms_spread": float(spread(old, new, lr_t))}

  return extra


def model_config(arm: Arm):
  if arm.model == "mla":
    return demo.demo_config(experts=0)
  return demo.demo_config(experts=0, attention="gqa", qk_norm=arm.model == "gqa+qknorm")


def _git_commit() -> str:
  import subprocess

  try:
    head = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    return head.stdout.strip() or "unknown"
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def run(args) -> int:
  if not args.report_only:
    train_all(args)
  if args.arms is not None:  # a subset: its rows, each against its reference where that ran too
    runs = [a for a in arms(args.taus) if a.name in args.arms]
    runs = [a._replace(reference=a.reference if a.reference in args.arms else None) for a in runs]
    records, secs = _read_runs(args, runs)
    stats = {a.name: summarize(a, records, model_config(a), secs[a.name]) for a in runs}
    print("\n".join(table(runs, stats)))
    return 0
  text = write_report(args)
  print(text)
  if args.docs:
    os.makedirs(args.docs, exist_ok=True)
    for name in ("study.md",) + PICTURES:
      shutil.copy(os.path.join(args.out, name), os.path.join(args.docs, name))
  print(f"study: {args.out}/study.md, pictures {', '.join(PICTURES)}", file=sys.stderr)
  return 0


def train_all(args) -> None:
  """Every run of every arm and seed; ``<out>/<arm>/seed<k>/{metrics.jsonl,run.json}``, ``<out>/study.json``."""
  import jax

  from mla_lm import init_params, make_loss_fn
  from muonclip_jax import training

  t_start, load_start, commit = time.time(), os.getloadavg(), _git_commit()
  os.makedirs(args.out, exist_ok=True)
  built = {}  # arm name -> (cfg, placement, optimizer, step function, eval function)
  jitted = {}  # arm name -> the jitted step, compiled once for all seeds
  evals = {}  # model config -> jitted validation loss
  inits = {}  # (model config, seed) -> initial params, shared by the arms of that model
  for seed in range(args.seeds):
    batches, val_batch, info = demo.make_data(0, seed, args.steps, args.batch, args.seq)
    for arm in arms(args.taus):
      if args.arms is not None and arm.name not in args.arms:
        continue
      cfg = model_config(arm)
      if (cfg, seed) not in inits:
        inits[cfg, seed] = init_params(cfg, seed)
      if arm.name not in built:
        cfg, opt, step_kw = build(arm, args.steps, None)
        place = demo.Placement(cfg, inits[cfg, seed], args.mesh, args.batch, args.seq)
        if place.shardings is not None:  # the distributed Newton-Schulz needs the shardings
          cfg, opt, step_kw = build(arm, args.steps, place.shardings)
        loss_fn = make_loss_fn(cfg)
        step_fn = training.make_train_step(loss_fn, opt, **step_kw)
        if cfg not in evals:
          evals[cfg] = jax.jit(lambda p, b, f=loss_fn: f(p, b)[0])
        built[arm.name] = (cfg, place, opt, step_fn, evals[cfg])
      cfg, place, opt, step_fn, eval_fn = built[arm.name]
      params = place.params(inits[cfg, seed])
      state = place.init(opt, params)
      if arm.name not in jitted:
        jitted[arm.name] = place.jit(step_fn, state)
      run_dir = os.path.join(args.out, arm.name, f"seed{seed}")
      extra = update_rms_spread(cfg, args.steps) if arm.optimizer == "muon" else None
      _, sec = demo.train(f"{arm.name} s{seed}", jitted[arm.name], params, state, batches, place, eval_fn,
                          place.batch(val_batch), args.eval_every, run_dir, extra)
      with open(os.path.join(run_dir, "run.json"), "w") as f:
        json.dump({"arm": arm._asdict(), "seed": seed, "sec_per_step": sec}, f)
  with open(os.path.join(args.out, "study.json"), "w") as f:
    json.dump({"wall_s": time.time() - t_start, "load_start": load_start[0], "load_end": os.getloadavg()[0],
               "data": info, "commit": commit, "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
               "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores"}, f)


def write_report(args) -> str:
  """``<out>/study.md`` and the pictures, from the runs' files."""
  runs = arms(args.taus)
  records, secs = _read_runs(args, runs)
  with open(os.path.join(args.out, "study.json")) as f:
    meta = json.load(f)
  cfgs = {arm.name: model_config(arm) for arm in runs}
  stats = {arm.name: summarize(arm, records, cfgs[arm.name], secs[arm.name]) for arm in runs}
  plot_all(args.out, runs, records, cfgs)
  text = report(args, runs, stats, cfgs, meta)
  with open(os.path.join(args.out, "study.md"), "w") as f:
    f.write(text)
  return text


def _read_runs(args, runs):
  """``({arm: {seed: metrics records}}, {arm: [s/step per seed]})`` read from ``--out``."""
  records, secs = {}, {}
  try:
    with open(os.path.join(args.out, "study.json")):
      pass
    for arm in runs:
      records[arm.name], secs[arm.name] = {}, []
      for seed in range(args.seeds):
        run_dir = os.path.join(args.out, arm.name, f"seed{seed}")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
          records[arm.name][seed] = [json.loads(line) for line in f]
        with open(os.path.join(run_dir, "run.json")) as f:
          secs[arm.name].append(json.load(f)["sec_per_step"])
  except (FileNotFoundError, NotADirectoryError) as e:
    raise UsageError(f"--report-only: {e.filename} is missing; run the study with the same flags first") from None
  return records, secs


def _mean_std(xs):
  n = len(xs)
  mean = sum(xs) / n
  std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
  return mean, std


def _mean_or_none(xs):
  return sum(xs) / len(xs) if xs else None


def num_heads(cfg) -> int:
  return cfg.num_layers * cfg.num_heads


def summarize(arm: Arm, records, cfg, secs) -> dict:
  runs = records[arm.name]
  seeds = sorted(runs)
  vals = [runs[s][-1]["val_loss"] for s in seeds]
  out = {
      "val": _mean_std(vals),
      "highest": max(max(r["max_logit"] for r in runs[s]) for s in seeds),
      "final_logit": _mean_std([sum(r["max_logit"] for r in runs[s][-10:]) / len(runs[s][-10:]) for s in seeds]),
      "above_tau": sum(sum(r["num_above_threshold"] for r in runs[s]) for s in seeds) / (num_heads(cfg) * sum(len(runs[s]) for s in seeds)),
      "sec": sum(secs) / len(secs),
      "seeds": len(seeds),
      "last_clip": [max((r["step"] for r in runs[s] if r["num_clipped"]), default=0) for s in seeds],
      "steps": len(runs[seeds[0]]),
      "passes": _mean_or_none([r["exact_clip_passes"] for s in seeds for r in runs[s] if "exact_clip_passes" in r]),
      "first_above": [next((r["step"] for r in runs[s] if r["max_logit"] > arm.tau), None) for s in seeds],
      "spread": _mean_or_none([r["update_rms_spread"] for s in seeds for r in runs[s]
                               if r.get("update_rms_spread") is not None]),
  }
  if arm.reference is not None:
    ref = records[arm.reference]
    out["delta"] = _mean_std([runs[s][-1]["val_loss"] - ref[s][-1]["val_loss"] for s in seeds])
    out["delta_signs"] = sum(runs[s][-1]["val_loss"] < ref[s][-1]["val_loss"] for s in seeds)
  return out


MODEL_NAMES = {"mla": "MLA", "gqa": "GQA", "gqa+qknorm": "GQA + QK-Norm"}
CLIP_NAMES = {None: "none", "alg1": "Algorithm 1", "exact": "exact"}


def table(rows, stats) -> list[str]:
  lines = [
      "| arm | model | clip | tau | final val loss (mean ± std) | Δ val vs reference (paired) | highest max logit "
      "| max logit, last 10 steps | head-steps > tau | per-head update RMS, max/min | s/step |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for arm in rows:
    st = stats[arm.name]
    delta = f"{st['delta'][0]:+.3f} ± {st['delta'][1]:.3f} vs {arm.reference}" if "delta" in st else "(reference)"
    spread = "-" if st["spread"] is None else f"{st['spread']:.2f}"
    lines.append(
        f"| {arm.name} | {MODEL_NAMES[arm.model]} | {CLIP_NAMES[arm.clip]} | {arm.tau:g} "
        f"| {st['val'][0]:.3f} ± {st['val'][1]:.3f} | {delta} | {st['highest']:.1f} "
        f"| {st['final_logit'][0]:.1f} ± {st['final_logit'][1]:.1f} | {100 * st['above_tau']:.1f}% "
        f"| {spread} | {st['sec']:.3f} |"
    )
  return lines


# Two-sided 95% quantiles of Student's t with 1..10 degrees of freedom.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def _noise(delta, n) -> str:
  """The 95% t-interval of a paired mean difference, and whether it excludes 0."""
  mean, std = delta
  if n < 2:
    return "one seed: no estimate of the noise"
  half = _T95[min(n - 1, len(_T95)) - 1] * std / math.sqrt(n)
  verdict = "excludes 0" if abs(mean) > half else "includes 0: not distinguishable from noise"
  return f"95% interval [{mean - half:+.3f}, {mean + half:+.3f}] over {n} seeds, {verdict}"


def reading(runs, stats) -> list[str]:
  """Sentences computed from the figures; each names the numbers it rests on."""
  by = {a.name: a for a in runs}
  s = stats
  n = s["muon"]["seeds"]
  tau = by["muonclip"].tau
  lines = []
  a = s["adamw"]
  lines.append(
      f"- **Muon vs AdamW.** Final validation loss, Muon minus AdamW: {-a['delta'][0]:+.3f} ± {a['delta'][1]:.3f} "
      f"(paired mean ± std; {_noise((-a['delta'][0], a['delta'][1]), n)}); Muon is lower in "
      f"{n - a['delta_signs']} of {n} seeds. Highest max logit: Muon {s['muon']['highest']:.1f}, AdamW "
      f"{a['highest']:.1f}.")
  first = [f for f in s["muon"]["first_above"] if f is not None]
  lines.append(
      f"- **Logit growth without clip.** Muon's max logit crossed tau = {tau:g} in {len(first)} of {n} seeds"
      + (f" (first at step {min(first)})" if first else "")
      + f"; {100 * s['muon']['above_tau']:.1f}% of its head-steps were above tau, and its max logit over the last "
      f"10 steps averages {s['muon']['final_logit'][0]:.1f}.")
  c = s["muonclip"]
  lines.append(
      f"- **MuonClip (Algorithm 1) vs Muon.** Δ final validation loss {c['delta'][0]:+.3f} ± {c['delta'][1]:.3f} "
      f"(paired mean ± std; {_noise(c['delta'], n)}); "
      f"highest max logit {c['highest']:.1f} vs {s['muon']['highest']:.1f}, "
      f"{100 * c['above_tau']:.1f}% of head-steps clipped"
      + (f", the last one at step {max(c['last_clip'])} of {c['steps']} (latest over seeds)" if any(c["last_clip"]) else "")
      + ". The logits plotted are each step's forward pass, "
      "before that step's clip, on a new batch: a value above tau there is not a failure of the clip.")
  e = s["muonclip-exact"]
  passes = (f"its clip took {e['passes']:.2f} extra forward passes per step on average "
            "(one, and one more after each clip; at most one clip per attention layer)"
            if e["passes"] is not None else
            "this run predates the multi-layer fix of the exact clip: its exact clip made one forward pass "
            "and one clip per step, exact for the first attention layer only")
  lines.append(
      f"- **Exact clip vs Algorithm 1.** Highest max logit {e['highest']:.1f} (exact) vs {c['highest']:.1f}; "
      f"final validation loss {e['val'][0]:.3f} vs {c['val'][0]:.3f}; {e['sec']:.3f} vs {c['sec']:.3f} s/step; "
      f"{passes}.")
  if "muon-per-head" in s:
    p, pc = s["muon-per-head"], s["muonclip-per-head"]

    def spread(st):
      return "n/a" if st["spread"] is None else f"{st['spread']:.2f}"

    lines.append(
        f"- **Per-head Muon (Kimi K3) vs whole-matrix Muon.** Δ final validation loss, per head minus whole: "
        f"{p['delta'][0]:+.3f} ± {p['delta'][1]:.3f} without clip ({_noise(p['delta'], n)}), "
        f"{pc['delta'][0]:+.3f} ± {pc['delta'][1]:.3f} with MuonClip ({_noise(pc['delta'], n)}). Highest max logit "
        f"{p['highest']:.1f} (per head) vs {s['muon']['highest']:.1f} (whole) without clip, "
        f"{100 * p['above_tau']:.1f}% vs {100 * s['muon']['above_tau']:.1f}% of head-steps above tau; with MuonClip "
        f"{100 * pc['above_tau']:.1f}% vs {100 * c['above_tau']:.1f}% clipped. Spread of the per-head update RMS "
        f"(largest head over smallest): {spread(p)} per head vs {spread(s['muon'])} whole-matrix without clip, "
        f"{spread(pc)} vs {spread(c)} with MuonClip (steps without a clip only).")
  q, g = s["muon-qknorm"], s["muon-gqa"]
  lines.append(
      f"- **QK-Norm (GQA).** Against Muon on the same GQA model without norm: Δ final validation loss "
      f"{q['delta'][0]:+.3f} ± {q['delta'][1]:.3f} ({_noise(q['delta'], n)}); "
      f"highest max logit {q['highest']:.1f} vs {g['highest']:.1f}. The GQA model is another model (see the "
      "parameter counts above; no low-rank compression), so compare QK-Norm with muon-gqa, not with the MLA arms.")
  if "muon-gqa-groups" in s:
    gg = s["muon-gqa-groups"]
    lines.append(
        f"- **Muon per GQA group vs whole-matrix Muon (GQA).** Δ final validation loss, groups minus whole: "
        f"{gg['delta'][0]:+.3f} ± {gg['delta'][1]:.3f} ({_noise(gg['delta'], n)}); highest max logit "
        f"{gg['highest']:.1f} vs {g['highest']:.1f}, {100 * gg['above_tau']:.1f}% vs {100 * g['above_tau']:.1f}% of "
        f"head-steps above tau.")
  abl = [a for a in runs if a.name.startswith("muonclip-tau")]
  if abl:
    parts = [f"tau {a.tau:g}: {s[a.name]['val'][0]:.3f}, Δ vs Muon {s[a.name]['delta'][0]:+.3f} "
             f"± {s[a.name]['delta'][1]:.3f}, {100 * s[a.name]['above_tau']:.1f}% clipped, highest max logit "
             f"{s[a.name]['highest']:.1f}" for a in sorted([by["muonclip"]] + abl, key=lambda a: a.tau)]
    lines.append("- **Tau ablation** (final validation loss, paired Δ vs Muon, head-steps clipped, highest max "
                 "logit): " + "; ".join(parts) + f"; Muon without clip: {s['muon']['val'][0]:.3f}.")
  return lines


def _num_params(cfg) -> int:
  import jax

  from mla_lm import init_params

  return sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: init_params(cfg, 0))))


def report(args, runs, stats, cfgs, meta) -> str:
  mla, gqa = cfgs["muon"], cfgs["muon-qknorm"]
  main_rows = [a for a in runs if not a.name.startswith("muonclip-tau")]
  abl_rows = [a for a in runs if a.name in ("muon", "muonclip") or a.name.startswith("muonclip-tau")]
  abl_rows.sort(key=lambda a: (a.clip is not None, a.tau))
  mesh = f" --mesh {demo.mesh_text(args.mesh)}" if args.mesh else ""
  cmd = (f"python examples/stability_study.py --steps {args.steps} --seeds {args.seeds} "
         f"--taus {','.join(f'{t:g}' for t in args.taus)}{mesh}")
  out = [
      "# Stability study: AdamW, Muon, MuonClip, QK-Norm, per-head Muon",
      "",
      f"`{cmd}` (batch {args.batch} x {args.seq} bytes, validation every {args.eval_every} steps): "
      f"{args.seeds} seed(s) x {len(runs)} runs of {args.steps} steps took **{meta['wall_s'] / 60:.1f} min** "
      f"wall-clock on {meta['devices']} ({meta['machine']}; load average {meta['load_start']:.1f} at the start, "
      f"{meta['load_end']:.1f} at the end: above the core count means other work shared the machine, so times are "
      f"pessimistic and s/step is noisy). Library at commit `{meta['commit']}`.",
      "",
      f"Model: the demo's byte-level LM (dim {mla.dim}, {mla.num_layers} layers under `nn.scan`, {mla.num_heads} heads, "
      f"SwiGLU {mla.mlp_dim}). MLA: q rank {mla.q_lora_rank}, kv rank {mla.kv_lora_rank}, qk {mla.qk_nope_head_dim}+"
      f"{mla.qk_rope_head_dim}, v {mla.v_head_dim}. GQA: {gqa.num_heads} query heads, {gqa.num_kv_heads} key/value heads, "
      f"head dim {gqa.head_dim}. Parameters: MLA model {_num_params(mla):,}, GQA model {_num_params(cfgs['muon-gqa']):,}, "
      f"GQA + QK-Norm {_num_params(gqa):,}. Data: {meta['data']}; every seed uses the same file split; the seed sets the initialization "
      "and the batches, which are the same in every arm. Peak learning rates: AdamW "
      f"{demo.LR_ADAMW:g}; Muon arms {demo.LR_MUON:g}, for the AdamW half too (`muon_adamw`'s default: with "
      "Moonlight's RMS matching both halves share one learning rate); 5% warmup, cosine to 10%.",
      "",
      "Columns: final val loss = validation loss (64 x "
      f"{args.seq} bytes) after the last step, mean ± std over seeds; Δ = paired difference per seed against the "
      "reference arm (same seed), mean ± std; highest max logit = largest pre-softmax logit of any head in any step's "
      "forward pass, over all seeds; head-steps > tau = share of (head, step) pairs whose forward-pass max logit "
      "exceeded tau: for `muonclip` these are the heads Algorithm 1 clipped; for `muonclip-exact` the clip acts "
      "on the updated weights' maxima instead, which this column does not count; for arms without clip it is what "
      "a clip at that tau would have touched. Per-head update RMS, max/min = the largest over the smallest of the "
      "heads' RMS of Muon's update (before the learning rate) of the attention projections with heads (MLA: "
      "`wq_b`, `wkv_b`; GQA: `wq`, `wk`, `wv`), averaged over layers, projections, steps and seeds, leaving out "
      "steps whose clip scaled a head (Kimi K3's motivation for per-head Muon: whole matrices let large-momentum "
      "heads dominate); `-` for AdamW. The `*-per-head` arms orthogonalize each head's block of `wq_b` and `wkv_b` "
      "on its own (`muon_blocks=\"head\"`); `muon-gqa-groups` orthogonalizes each GQA group (the query heads that "
      "share a key/value head, `muon_blocks=\"group:kv\"`) of `wq` and each key/value head of `wk` and `wv` on its "
      "own. s/step leaves out the first (compiling) step.",
      "",
      f"## Arms (tau = {args.taus[0]:g})",
      "",
      *table(main_rows, stats),
      "",
  ]
  if len(args.taus) > 1:
    out += ["## Tau ablation (MuonClip, Algorithm 1)", "", *table(abl_rows, stats), ""]
  out += [
      "## Pictures",
      "",
      "Loss (train: 10-step moving average; validation) and max logit, mean over seeds with a min-max band:",
      "",
      "![loss curves](study_loss.png)",
      "",
      "Per-head max logit of each step's forward pass (seed 0), one row per layer/head, one column per step:",
      "",
      "![per-head max-logit heatmap](study_heatmap.png)",
      "",
      "Share of heads above tau per step (for MuonClip: clipped), mean over seeds, 10-step moving average:",
      "",
      "![fraction of heads clipped](study_clipped.png)",
      "",
      "## What the figures show, and what they do not",
      "",
      *reading(runs, stats),
      f"- **Noise.** {args.seeds} seed(s) per arm; the ± are sample standard deviations over seeds (0 with one "
      "seed), the intervals Student's t on the paired differences; with so few seeds both are rough, and a "
      "difference whose interval includes 0 is not a finding. One data set, one model "
      f"size ({args.steps} steps of {args.batch} x {args.seq} bytes), one learning rate per optimizer, no tuning per "
      "arm: nothing here says how the arms compare at scale, where Kimi K2 saw 12.7% of heads clipped early and "
      "then none. No GPU was available: no larger configuration was run.",
      "",
  ]
  return "\n".join(out)


def _smooth(xs, w=10):
  import numpy as np

  xs = np.asarray(xs, float)
  c = np.cumsum(np.insert(xs, 0, 0.0))
  return np.array([(c[i + 1] - c[max(0, i + 1 - w)]) / (i + 1 - max(0, i + 1 - w)) for i in range(len(xs))])


def plot_all(out, runs, records, cfgs):
  import matplotlib
  import numpy as np

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  main = [a for a in runs if not a.name.startswith("muonclip-tau")]
  colors = {a.name: f"C{i}" for i, a in enumerate(runs)}

  def band(ax, steps, per_seed, arm, **kw):
    arr = np.asarray(per_seed, float)
    ax.plot(steps, arr.mean(0), color=colors[arm.name], label=arm.name, **kw)
    ax.fill_between(steps, arr.min(0), arr.max(0), color=colors[arm.name], alpha=0.2, lw=0)

  fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
  for arm in main:
    runs_ = [records[arm.name][s] for s in sorted(records[arm.name])]
    steps = [r["step"] for r in runs_[0]]
    band(axes[0], steps, [_smooth([r["loss"] for r in rs]) for rs in runs_], arm)
    vsteps = [r["step"] for r in runs_[0] if "val_loss" in r]
    band(axes[1], vsteps, [[r["val_loss"] for r in rs if "val_loss" in r] for rs in runs_], arm, marker="o", ms=3)
    band(axes[2], steps, [[r["max_logit"] for r in rs] for rs in runs_], arm, lw=0.8)
  tau = main[0].tau
  axes[2].axhline(tau, color="k", ls="--", lw=1, label=f"tau = {tau:g}")
  axes[0].set(xlabel="step", ylabel="loss (nats/byte)", title="training loss (10-step average)")
  axes[1].set(xlabel="step", ylabel="loss (nats/byte)", title="validation loss")
  axes[2].set(xlabel="step", ylabel="max pre-softmax logit", title="max attention logit (forward pass)")
  for ax in axes:
    ax.legend(fontsize=8)
  lo = min(rs[0][-1]["val_loss"] for rs in records.values())
  axes[0].set_ylim(lo - 0.2, lo + 1.5)
  axes[1].set_ylim(lo - 0.2, lo + 1.5)
  fig.tight_layout()
  fig.savefig(os.path.join(out, PICTURES[0]), dpi=100)
  plt.close(fig)

  shown = [a for a in main if a.optimizer == "muon" and a.model != "gqa"]
  maps = {}
  for arm in shown:
    rs = records[arm.name][min(records[arm.name])]
    maps[arm.name] = np.concatenate(
        [np.asarray(r_, float).reshape(-1, 1) for r_ in ([np.concatenate([np.ravel(v) for v in r["max_logits"].values()])
                                                          for r in rs])], axis=1)
  vmax = max(m.max() for m in maps.values())
  fig, axes = plt.subplots(len(shown), 1, figsize=(12, 1.2 + 1.6 * len(shown)), sharex=True, squeeze=False)
  for ax, arm in zip(axes[:, 0], shown):
    m = maps[arm.name]
    im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="magma", vmin=0, vmax=vmax,
                   extent=(0.5, m.shape[1] + 0.5, m.shape[0] - 0.5, -0.5))
    cfg = cfgs[arm.name]
    ax.set_yticks(range(m.shape[0]), [f"L{i // cfg.num_heads} h{i % cfg.num_heads}" for i in range(m.shape[0])],
                  fontsize=7)
    ax.set_title(f"{arm.name} ({MODEL_NAMES[arm.model]}{', tau = %g' % arm.tau if arm.clip else ''})", fontsize=9)
  axes[-1, 0].set_xlabel("step")
  cb = fig.colorbar(im, ax=axes[:, 0].tolist(), shrink=0.9)
  cb.set_label("max logit")
  cb.ax.axhline(tau, color="c", lw=2)
  fig.savefig(os.path.join(out, PICTURES[1]), dpi=100, bbox_inches="tight")
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(9, 4.5))
  for arm in [a for a in runs if a.optimizer == "muon" and a.model == "mla"]:
    rs = [records[arm.name][s] for s in sorted(records[arm.name])]
    frac = [_smooth([r["num_above_threshold"] / num_heads(cfgs[arm.name]) for r in r_]) for r_ in rs]
    label = f"{arm.name} (tau = {arm.tau:g})" + ("" if arm.clip else ": above tau, not clipped")
    style = "-" if arm.clip == "alg1" else ("--" if arm.clip else ":")
    ax.plot([r["step"] for r in rs[0]], np.mean(frac, 0), style, color=colors[arm.name], label=label)
  ax.set(xlabel="step", ylabel="share of heads", title="heads above tau in the forward pass (clipped by MuonClip)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out, PICTURES[2]), dpi=100)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
