"""Train a small byte-level DeepSeek-style MLA language model with AdamW, Muon and MuonClip.

The same model, from the same initialization, on the same batches, three times:

  adamw     optax.adamw
  muon      muonclip_jax.muon_adamw (Muon on hidden matrices, AdamW on the rest), no clip
  muonclip  muonclip_jax.muonclip (the same, plus QK-Clip at tau)

The text is the Python standard library's own source, found from the running interpreter
(no download), split into train and validation by file with a fixed seed. Per step the
run records the loss, the validation loss at intervals, the max logit of every layer and
the number of clipped heads to ``<out>/<optimizer>/metrics.jsonl``; at the end it writes
``<out>/report.png`` and prints a summary table.

  python examples/train_mla_lm.py [--steps N] [--optimizers adamw,muon,muonclip]
      [--tau T] [--seed S] [--mesh DATA,MODEL] [--out runs/demo]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

OPTIMIZERS = ("adamw", "muon", "muonclip")


class UsageError(Exception):
  """Bad command-line input: printed as one line, exit status 2."""


def parse_args(argv):
  p = argparse.ArgumentParser(description="Train a small MLA LM with AdamW, Muon and MuonClip.")
  p.add_argument("--steps", type=int, default=300, help="training steps per optimizer")
  p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated: adamw,muon,muonclip")
  p.add_argument("--tau", type=float, default=30.0, help="QK-Clip threshold")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--mesh", default=None, help="DATA,MODEL device mesh, e.g. 2,4 (fake CPU devices if needed)")
  p.add_argument("--out", default="runs/demo", help="output directory")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--eval-every", type=int, default=25)
  args = p.parse_args(argv)
  names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
  unknown = [n for n in names if n not in OPTIMIZERS]
  if unknown or not names:
    raise UsageError(f"--optimizers: unknown optimizer(s) {unknown or names}; choose from {','.join(OPTIMIZERS)}")
  args.optimizers = names
  if not (args.tau > 0) or math.isnan(args.tau):
    raise UsageError(f"--tau must be > 0, got {args.tau}")
  if args.steps < 1:
    raise UsageError(f"--steps must be >= 1, got {args.steps}")
  if args.mesh is not None:
    try:
      data, model = (int(v) for v in args.mesh.split(","))
    except ValueError:
      raise UsageError(f"--mesh must be DATA,MODEL (two integers), got {args.mesh!r}") from None
    if data < 1 or model < 1:
      raise UsageError(f"--mesh sizes must be >= 1, got {args.mesh!r}")
    args.mesh = (data, model)
  return args


def load_corpus(seed: int, val_fraction: float = 0.1, max_bytes: int = 8_000_000):
  """Bytes of the standard library's .py files, split into train/validation by file."""
  import numpy as np
  import sysconfig

  root = sysconfig.get_paths()["stdlib"]
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
    files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
  if not files:
    raise UsageError(f"no Python source files found under {root}")
  rng = np.random.default_rng(seed)
  rng.shuffle(files)
  n_val = max(1, int(len(files) * val_fraction))
  def read(paths, budget):
    chunks, total = [], 0
    for path in paths:
      with open(path, "rb") as f:
        data = f.read()
      chunks.append(data)
      total += len(data)
      if total >= budget:
        break
    return np.frombuffer(b"\n".join(chunks), np.uint8)
  return read(files[n_val:], max_bytes), read(files[:n_val], max_bytes // 8), len(files) - n_val, n_val


def main(argv=None) -> int:
  try:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.mesh is not None:
      want = args.mesh[0] * args.mesh[1]
      import jax

      try:  # fake CPU devices when JAX runs on the CPU; no effect on a GPU/TPU backend
        jax.config.update("jax_num_cpu_devices", want)
      except RuntimeError:
        pass  # a backend already started (e.g. under pytest): use the devices it has
      if jax.device_count() != want:
        raise UsageError(
            f"--mesh {args.mesh[0]},{args.mesh[1]} needs {want} devices, but JAX sees {jax.device_count()}"
        )
    return run(args)
  except UsageError as e:
    print(f"train_mla_lm.py: error: {e}", file=sys.stderr)
    return 2


def run(args) -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import muonclip_jax as mc
  from mla_lm import MATRIX_AXES, LMConfig, init_params, logical_axes, make_loss_fn
  from muonclip_jax import training

  cfg = LMConfig(dim=128, num_layers=2, num_heads=4, q_lora_rank=64, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, mlp_dim=384)
  train, val, n_train_files, n_val_files = load_corpus(args.seed)
  print(f"data: {n_train_files} train files ({len(train) / 1e6:.1f} MB used), {n_val_files} validation files "
        f"({len(val) / 1e6:.1f} MB used); device: {jax.devices()[0].device_kind} x {jax.device_count()}")
  rng = np.random.default_rng(args.seed)
  starts = rng.integers(0, len(train) - args.seq - 1, (args.steps, args.batch))
  batches = np.stack([np.stack([train[s:s + args.seq + 1] for s in row]) for row in starts]).astype(np.int32)
  vstarts = np.random.default_rng(args.seed + 1).integers(0, len(val) - args.seq - 1, 64)
  val_batch = jnp.asarray(np.stack([val[s:s + args.seq + 1] for s in vstarts]).astype(np.int32))

  params0 = init_params(cfg, args.seed)
  loss_fn = make_loss_fn(cfg)
  mesh = shardings = None
  if args.mesh is not None:
    from jax.sharding import Mesh

    if args.batch % args.mesh[0]:
      raise UsageError(f"--batch {args.batch} is not divisible by the data axis {args.mesh[0]}")
    mesh = Mesh(np.asarray(jax.devices()).reshape(args.mesh), ("data", "model"))
    shardings = mc.sharding.param_shardings(params0, mesh, logical_axes=logical_axes(cfg))
    params0 = jax.device_put(params0, shardings)
    batch_sharding = mc.sharding.batch_shardings(jnp.zeros((args.batch, args.seq + 1), jnp.int32), mesh)
    val_batch = jax.device_put(val_batch, mc.sharding.batch_shardings(val_batch, mesh))
  lr_muon = 0.02
  schedule = lambda peak: optax.warmup_cosine_decay_schedule(0.0, peak, max(1, args.steps // 20), args.steps, peak * 0.1)
  muon_kw = dict(matrix_axes=MATRIX_AXES, shard_orthogonalization=shardings)
  optimizers = {
      "adamw": (optax.adamw(schedule(3e-3), b1=0.9, b2=0.95, weight_decay=0.1), {}),
      "muon": (mc.muon_adamw(schedule(lr_muon), **muon_kw), {}),
      "muonclip": (
          mc.muonclip(schedule(lr_muon), layout=cfg.layout, qk_clip_threshold=args.tau, **muon_kw),
          dict(exact_clip=True, layout=cfg.layout),
      ),
  }

  eval_fn = jax.jit(lambda p, b: loss_fn(p, b)[0])
  os.makedirs(args.out, exist_ok=True)
  results = {}
  for name in args.optimizers:
    opt, step_kw = optimizers[name]
    step_fn = training.make_train_step(loss_fn, opt, qk_clip_threshold=args.tau, **step_kw)
    if mesh is None:
      step, params, state = jax.jit(step_fn), params0, jax.jit(opt.init)(params0)
    else:  # params, optimizer state and batch sharded; in = out shardings
      params, state = params0, mc.sharding.init_state(opt, params0, shardings)
      state_shardings = jax.tree.map(lambda x: x.sharding, state)
      step = mc.sharding.jit_train_step(step_fn, shardings, state_shardings, batch_sharding)
    run_dir = os.path.join(args.out, name)
    os.makedirs(run_dir, exist_ok=True)
    records, t_start, t_steps = [], None, 0.0
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as log:
      for t in range(args.steps):
        batch = jnp.asarray(batches[t])
        if mesh is not None:
          batch = jax.device_put(batch, batch_sharding)
        t0 = time.perf_counter()
        params, state, metrics = step(params, state, batch)
        metrics = jax.device_get(metrics)  # one host transfer per step, outside the step
        if t > 0:  # step 0 includes compilation
          t_steps += time.perf_counter() - t0
        rec = {
            "step": t + 1,
            "loss": float(metrics["loss"]),
            "max_logit": float(metrics["max_logit"]),
            "max_logit_per_layer": {m: np.asarray(v).tolist() for m, v in metrics["max_logit_per_layer"].items()},
            "num_clipped": int(metrics["num_clipped"]),
        }
        if (t + 1) % args.eval_every == 0 or t + 1 == args.steps:
          rec["val_loss"] = float(eval_fn(params, val_batch))
        log.write(json.dumps(rec) + "\n")
        records.append(rec)
        progress(name, t + 1, args.steps, rec)
    print(file=sys.stderr)
    results[name] = summarize(records, cfg.num_layers * cfg.num_heads, t_steps / max(1, args.steps - 1))
  table = format_table(results, args.tau)
  print("\n" + table)
  with open(os.path.join(args.out, "summary.txt"), "w") as f:
    f.write(table + "\n")
  report_path = os.path.join(args.out, "report.png")
  plot(args.out, args.optimizers, args.tau, report_path)
  print(f"metrics: {args.out}/<optimizer>/metrics.jsonl; report: {report_path}")
  return 0


def progress(name, step, total, rec, width=30):
  done = int(width * step / total)
  bar = "#" * done + "." * (width - done)
  print(f"\r{name:9s} [{bar}] {step}/{total} loss {rec['loss']:.3f} max logit {rec['max_logit']:7.2f}",
        end="", file=sys.stderr, flush=True)


def summarize(records, num_heads_total, sec_per_step):
  val = [r["val_loss"] for r in records if "val_loss" in r]
  ever = set()
  for r in records:
    if r["num_clipped"]:
      ever.add(r["step"])
  return {
      "final_train_loss": sum(r["loss"] for r in records[-10:]) / len(records[-10:]),
      "final_val_loss": val[-1],
      "highest_max_logit": max(r["max_logit"] for r in records),
      "steps_with_clipped_head": len(ever),
      "clipped_head_fraction": sum(r["num_clipped"] for r in records) / (num_heads_total * len(records)),
      "sec_per_step": sec_per_step,
  }


def format_table(results, tau):
  cols = ["optimizer", "train loss", "val loss", "highest max logit", "steps > tau", "head-steps > tau", "s/step"]
  rows = [[name, f"{r['final_train_loss']:.3f}", f"{r['final_val_loss']:.3f}", f"{r['highest_max_logit']:.1f}",
           str(r["steps_with_clipped_head"]), f"{100 * r['clipped_head_fraction']:.1f}%", f"{r['sec_per_step']:.3f}"]
          for name, r in results.items()]
  widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
  lines = [
      f"summary (tau = {tau:g}; train loss = mean of the last 10 steps; max logits are those of each "
      "step's forward pass; steps > tau = steps with a head above tau, which MuonClip then clips)",
      " | ".join(c.ljust(w) for c, w in zip(cols, widths)),
      "-+-".join("-" * w for w in widths),
  ]
  lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
  return "\n".join(lines)


def plot(out, names, tau, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  for name in names:
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
      recs = [json.loads(line) for line in f]
    steps = [r["step"] for r in recs]
    style = "--" if name == "muonclip" else "-"  # muonclip and muon overlap until tau
    (line,) = ax1.plot(steps, [r["loss"] for r in recs], style, alpha=0.5, lw=0.8)
    vs = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    ax1.plot(*zip(*vs), "o" + style, color=line.get_color(), label=f"{name} (val: dots)")
    ax2.plot(steps, [r["max_logit"] for r in recs], style, color=line.get_color(), label=name)
  ax2.axhline(tau, color="k", ls="--", lw=1, label=f"tau = {tau:g}")
  ax1.set(xlabel="step", ylabel="loss (nats/byte)", title="training and validation loss")
  ax2.set(xlabel="step", ylabel="max pre-softmax logit (all heads)", title="max attention logit")
  ax1.legend()
  ax2.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  sys.exit(main())
