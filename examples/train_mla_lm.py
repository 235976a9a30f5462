"""Train a small byte-level Kimi K2 / DeepSeek-V3-shaped language model with AdamW, Muon and MuonClip.

The model (``mla_lm.py``): MLA attention, and in every layer a mixture of experts (a shared
expert plus 2 of 8 routed experts, sigmoid gate scores, DeepSeek-V3's auxiliary-loss-free
balancing: after each step the routing bias moves by +/- ``--bias-speed``). The experts are
stacks with logical names; Muon reads its matrices from the names (each expert of each layer
orthogonalized on its own), nothing is declared by hand. The same model, from the same
initialization, on the same batches, three times:

  adamw     optax.adamw
  muon      muonclip_jax.muon_adamw (Muon on hidden matrices, AdamW on the rest), no clip
  muonclip  muonclip_jax.muonclip (the same, plus QK-Clip at tau)

The text is the Python standard library's own source, found from the running interpreter
(no download), split into train and validation by file with a fixed seed. Per step the
run records the loss, the validation loss at intervals, the max logit of every layer and
the number of clipped heads to ``<out>/<optimizer>/metrics.jsonl``; at the end it writes
``<out>/report.png`` and prints a summary table.

  python examples/train_mla_lm.py [--steps N] [--optimizers adamw,muon,muonclip]
      [--tau T] [--seed S] [--experts E] [--bias-speed G] [--mesh DATA,EXPERT,MODEL] [--out runs/demo]

``--mesh DATA,EXPERT,MODEL`` runs it on that device mesh (fake CPU devices if needed):
expert parallel over ``EXPERT`` (each device holds whole experts), tensor parallel over
``MODEL``, the batch split over ``DATA`` x ``EXPERT``. ``--mesh DATA,MODEL`` is
``DATA,1,MODEL``.
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


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose errors (unknown flag, bad type) raise ``UsageError`` instead of exiting."""

  def error(self, message):
    raise UsageError(message)


def parse_args(argv):
  p = ArgumentParser(description="Train a small MLA LM with AdamW, Muon and MuonClip.")
  p.add_argument("--steps", type=int, default=300, help="training steps per optimizer")
  p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated: adamw,muon,muonclip")
  p.add_argument("--tau", type=float, default=30.0, help="QK-Clip threshold")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--mesh", default=None,
                 help="DATA,EXPERT,MODEL device mesh, e.g. 2,4,1 (DATA,MODEL = DATA,1,MODEL; fake CPU devices if needed)")
  p.add_argument("--out", default="runs/demo", help="output directory")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--eval-every", type=int, default=25)
  p.add_argument("--experts", type=int, default=8,
                 help="routed experts per layer (top-2 and a shared expert); 0: a dense SwiGLU MLP instead")
  p.add_argument("--bias-speed", type=float, default=BIAS_SPEED,
                 help="routing-bias update speed (DeepSeek-V3's gamma, aux-loss-free balancing); 0 turns it off")
  args = p.parse_args(argv)
  names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
  unknown = [n for n in names if n not in OPTIMIZERS]
  if unknown or not names:
    raise UsageError(f"--optimizers: unknown optimizer(s) {unknown or names}; choose from {','.join(OPTIMIZERS)}")
  args.optimizers = names
  if not (args.tau > 0) or math.isnan(args.tau):
    raise UsageError(f"--tau must be > 0, got {args.tau}")
  if not (args.bias_speed >= 0) or math.isinf(args.bias_speed):
    raise UsageError(f"--bias-speed must be a finite number >= 0, got {args.bias_speed}")
  if args.experts < 0 or args.experts == 1:
    raise UsageError(f"--experts must be 0 (dense MLP) or >= 2 (top-2 routing), got {args.experts}")
  if args.steps < 1:
    raise UsageError(f"--steps must be >= 1, got {args.steps}")
  if args.mesh is not None:
    args.mesh = parse_mesh(args.mesh)
  return args


MESH_AXES = ("data", "expert", "model")


def parse_mesh(text: str) -> tuple[int, int, int]:
  """``"DATA,EXPERT,MODEL"`` -> ``(data, expert, model)``, ``"DATA,MODEL"`` -> ``(data, 1, model)``;
  UsageError otherwise."""
  try:
    sizes = tuple(int(v) for v in text.split(","))
  except ValueError:
    sizes = ()
  if len(sizes) not in (2, 3):
    raise UsageError(f"--mesh must be DATA,EXPERT,MODEL or DATA,MODEL (integers), got {text!r}")
  if min(sizes) < 1:
    raise UsageError(f"--mesh sizes must be >= 1, got {text!r}")
  return sizes if len(sizes) == 3 else (sizes[0], 1, sizes[1])


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


def prepare_dir(path: str, flag: str = "--out") -> None:
  """Creates directory ``path`` (and its parents) and checks that a file can be written there;
  UsageError otherwise, so that a bad output path fails before training, not after it."""
  import tempfile

  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    raise UsageError(f"{flag} {path!r}: cannot create or write the directory ({e.strerror or e})") from None


def main(argv=None) -> int:
  try:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    prepare_dir(args.out)
    if args.mesh is not None:
      use_devices(args.mesh)
    return run(args)
  except UsageError as e:
    print(f"train_mla_lm.py: error: {e}", file=sys.stderr)
    return 2


def mesh_text(mesh: tuple[int, int, int]) -> str:
  """``--mesh``'s text for ``mesh``: ``DATA,MODEL`` when there is no expert axis (``DATA,1,MODEL``)."""
  return ",".join(map(str, mesh if mesh[1] > 1 else (mesh[0], mesh[2])))


def use_devices(mesh: tuple[int, int, int]) -> None:
  """Asks JAX for DATA*EXPERT*MODEL devices (fake CPU devices on a CPU backend); UsageError if fewer."""
  import jax

  want = math.prod(mesh)
  try:  # fake CPU devices when JAX runs on the CPU; no effect on a GPU/TPU backend
    jax.config.update("jax_num_cpu_devices", want)
  except RuntimeError:
    pass  # a backend already started (e.g. under pytest): use the devices it has
  if jax.device_count() != want:
    raise UsageError(f"--mesh {mesh_text(mesh)} needs {want} devices, but JAX sees {jax.device_count()}")


# The demo's model: 2 scanned layers, 4 heads, MLA, and in each layer a mixture of experts
# (a shared expert and 2 of 8 routed experts, Kimi K2 / DeepSeek-V3 style; see mla_lm.py).
# The stability study keeps the dense MLP (experts=0).
def demo_config(experts: int = 8, **changes):
  from mla_lm import LMConfig

  moe = dict(num_experts=experts, top_k=2, expert_dim=48) if experts else {}
  return LMConfig(dim=128, num_layers=2, num_heads=4, q_lora_rank=64, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, mlp_dim=384, **moe, **changes)


def make_data(split_seed: int, sample_seed: int, steps: int, batch: int, seq: int):
  """``(train batches (steps, batch, seq+1) int32, validation batch (64, seq+1), description)``.

  The corpus is split by file with ``split_seed``; batch positions are drawn with
  ``sample_seed`` (validation positions with ``sample_seed + 1``).
  """
  import numpy as np

  train, val, n_train_files, n_val_files = load_corpus(split_seed)
  rng = np.random.default_rng(sample_seed)
  starts = rng.integers(0, len(train) - seq - 1, (steps, batch))
  batches = np.stack([np.stack([train[s:s + seq + 1] for s in row]) for row in starts]).astype(np.int32)
  vstarts = np.random.default_rng(sample_seed + 1).integers(0, len(val) - seq - 1, 64)
  val_batch = np.stack([val[s:s + seq + 1] for s in vstarts]).astype(np.int32)
  info = (f"{n_train_files} train files ({len(train) / 1e6:.1f} MB used), {n_val_files} validation files "
          f"({len(val) / 1e6:.1f} MB used)")
  return batches, val_batch, info


def lr_schedule(peak: float, steps: int):
  """Linear warmup over 5% of the steps (at least 1), cosine decay to 10% of ``peak``.

  The decay lasts at least one step, so that any ``steps >= 1`` gives a valid schedule
  (optax rejects a decay of 0 steps); for ``steps >= 2`` it ends at ``steps``.
  """
  import optax

  warmup = max(1, steps // 20)
  return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(steps, warmup + 1), peak * 0.1)


LR_ADAMW, LR_MUON = 3e-3, 0.02
BIAS_SPEED = 0.01  # DeepSeek-V3 uses 0.001 over 14.8T tokens; a 300-step run needs a faster rule


class Placement:
  """Where params, optimizer state and batches live: one device, or a DATA x EXPERT x MODEL mesh."""

  def __init__(self, cfg, params, mesh: tuple[int, int, int] | None, batch: int, seq: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import muonclip_jax as mc
    from mla_lm import logical_axes

    self.mesh = self.shardings = None
    if mesh is not None:
      from jax.sharding import Mesh

      if batch % mesh[0]:
        raise UsageError(f"--batch {batch} is not divisible by the data axis {mesh[0]}")
      if cfg.num_experts % mesh[1]:
        raise UsageError(f"--mesh: the expert axis {mesh[1]} does not divide the {cfg.num_experts} experts")
      self.mesh = Mesh(np.asarray(jax.devices()).reshape(mesh), MESH_AXES)
      self.shardings = mc.sharding.param_shardings(params, self.mesh, logical_axes=logical_axes(cfg))
      self.batch_sharding = mc.sharding.batch_shardings(jnp.zeros((batch, seq + 1), jnp.int32), self.mesh)

  def params(self, params):
    import jax

    return params if self.mesh is None else jax.device_put(params, self.shardings)

  def batch(self, batch):
    import jax
    import jax.numpy as jnp

    import muonclip_jax as mc

    batch = jnp.asarray(batch)
    if self.mesh is None:
      return batch
    return jax.device_put(batch, mc.sharding.batch_shardings(batch, self.mesh))

  def init(self, opt, params):
    """The optimizer state, sharded like the params on a mesh."""
    import jax

    import muonclip_jax as mc

    if self.mesh is None:
      return jax.jit(opt.init)(params)
    return mc.sharding.init_state(opt, params, self.shardings)

  def jit(self, step_fn, state):
    """The jitted step; on a mesh, in = out shardings."""
    import jax

    import muonclip_jax as mc

    if self.mesh is None:
      return jax.jit(step_fn)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    return mc.sharding.jit_train_step(step_fn, self.shardings, state_shardings, self.batch_sharding)


def train(name, step, params, state, batches, place, eval_fn, val_batch, eval_every, run_dir, extra=None):
  """Runs ``step`` over ``batches``; writes ``run_dir/metrics.jsonl``; returns (records, s/step).

  A record per step: loss, the forward pass's max logit (overall, per layer, per head),
  heads above tau, the exact clip's forward passes (if any), and the validation loss every ``eval_every`` steps and at the end.
  ``extra(params before, params after, step, record)``, if given, returns more fields for the
  record (computed outside the timed step). The time per step leaves out step 1 (compilation).
  """
  import jax
  import numpy as np

  os.makedirs(run_dir, exist_ok=True)
  records, t_steps = [], 0.0
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as log:
    for t in range(len(batches)):
      batch = place.batch(batches[t])
      t0 = time.perf_counter()
      before = params
      params, state, metrics = step(params, state, batch)
      metrics = jax.device_get(metrics)  # one host transfer per step, outside the step
      if t > 0:  # step 1 includes compilation
        t_steps += time.perf_counter() - t0
      rec = {
          "step": t + 1,
          "loss": float(metrics["loss"]),
          "max_logit": float(metrics["max_logit"]),
          "max_logit_per_layer": {m: np.asarray(v).tolist() for m, v in metrics["max_logit_per_layer"].items()},
          "max_logits": {m: np.asarray(v).tolist() for m, v in metrics["max_logits"].items()},
          "num_clipped": int(metrics["num_clipped"]),  # heads the step scaled
          "num_above_threshold": int(metrics.get("num_above_threshold", 0)),  # forward pass above tau
      }
      if "aux" in metrics:  # the fraction of tokens routed to each expert, per layer
        rec["expert_load"] = np.asarray(metrics["aux"]["expert_load"]).tolist()
      if "exact_clip_passes" in metrics:
        rec["exact_clip_passes"] = int(metrics["exact_clip_passes"])
      if extra is not None:
        rec.update(extra(before, params, t + 1, rec))
      if (t + 1) % eval_every == 0 or t + 1 == len(batches):
        rec["val_loss"] = float(eval_fn(params, val_batch))
      log.write(json.dumps(rec) + "\n")
      records.append(rec)
      progress(name, t + 1, len(batches), rec)
  return records, t_steps / max(1, len(batches) - 1)


def run(args) -> int:
  import jax
  import optax

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import muonclip_jax as mc
  from mla_lm import adamw_keeping_frozen, init_params, logical_matrix_axes, make_loss_fn, with_balancing
  from muonclip_jax import training

  cfg = demo_config(args.experts)
  batches, val_batch, info = make_data(args.seed, args.seed, args.steps, args.batch, args.seq)
  print(f"data: {info}; device: {jax.devices()[0].device_kind} x {jax.device_count()}")
  params0 = init_params(cfg, args.seed)
  place = Placement(cfg, params0, args.mesh, args.batch, args.seq)
  params0, val_batch = place.params(params0), place.batch(val_batch)
  loss_fn = make_loss_fn(cfg)
  # Muon's matrices come from the logical names: layers and experts batched, one matrix each.
  muon_kw = dict(matrix_axes=logical_matrix_axes(cfg), shard_orthogonalization=place.shardings)
  optimizers = {
      # tau goes to the optimizer that clips, else to the train step (for its metrics)
      "adamw": (adamw_keeping_frozen(lr_schedule(LR_ADAMW, args.steps), params0), dict(qk_clip_threshold=args.tau)),
      "muon": (mc.muon_adamw(lr_schedule(LR_MUON, args.steps), **muon_kw), dict(qk_clip_threshold=args.tau)),
      "muonclip": (
          mc.muonclip(lr_schedule(LR_MUON, args.steps), layout=cfg.layout, qk_clip_threshold=args.tau, **muon_kw),
          dict(exact_clip=True, layout=cfg.layout),
      ),
  }

  eval_fn = jax.jit(lambda p, b: loss_fn(p, b)[0])
  os.makedirs(args.out, exist_ok=True)
  results = {}
  for name in args.optimizers:
    opt, step_kw = optimizers[name]
    step_fn = training.make_train_step(loss_fn, opt, **step_kw)
    if cfg.num_experts:
      step_fn = with_balancing(step_fn, args.bias_speed)
    state = place.init(opt, params0)
    step = place.jit(step_fn, state)
    records, sec = train(name, step, params0, state, batches, place, eval_fn, val_batch, args.eval_every,
                         os.path.join(args.out, name))
    results[name] = summarize(records, cfg.num_layers * cfg.num_heads, sec)
  table = format_table(results, args.tau)
  print("\n" + table)
  with open(os.path.join(args.out, "summary.txt"), "w") as f:
    f.write(table + "\n" + MACHINE_NOTE + "\n")
  report_path = os.path.join(args.out, "report.png")
  plot(args.out, args.optimizers, args.tau, report_path)
  print(f"metrics: {args.out}/<optimizer>/metrics.jsonl; report: {report_path}")
  return 0


def progress(name, step, total, rec, width=30, stream=None):
  """A progress bar redrawn in place on a terminal; plain lines (every tenth of the run) in a log."""
  stream = sys.stderr if stream is None else stream
  status = f"{step}/{total} loss {rec['loss']:.3f} max logit {rec['max_logit']:7.2f}"
  if stream.isatty():
    done = int(width * step / total)
    bar = "#" * done + "." * (width - done)
    print(f"\r{name:9s} [{bar}] {status}", end="\n" if step == total else "", file=stream, flush=True)
  elif step == total or step % max(1, total // 10) == 0:
    print(f"{name:9s} {status}", file=stream, flush=True)


def summarize(records, num_heads_total, sec_per_step):
  val = [r["val_loss"] for r in records if "val_loss" in r]
  ever = set()
  for r in records:
    if r["num_above_threshold"]:
      ever.add(r["step"])
  return {
      "final_train_loss": sum(r["loss"] for r in records[-10:]) / len(records[-10:]),
      "final_val_loss": val[-1],
      "highest_max_logit": max(r["max_logit"] for r in records),
      "steps_with_clipped_head": len(ever),
      "clipped_head_fraction": sum(r["num_above_threshold"] for r in records) / (num_heads_total * len(records)),
      "sec_per_step": sec_per_step,
      # the most loaded expert's load over the mean load (1.0 = balanced), worst layer, last 10 steps
      "expert_load_max_over_mean": (None if "expert_load" not in records[-1] else sum(
          max(max(layer) / (sum(layer) / len(layer)) for layer in r["expert_load"]) for r in records[-10:])
          / len(records[-10:])),
  }


# Written under the table: its digits are this machine's (docs/results.md gives the spread
# measured across CPUs and XLA flags, and tests/test_demo.py checks the claims below).
MACHINE_NOTE = (
    "These digits are this machine's: another CPU, or other XLA flags, rounds float32 sums "
    "differently, and 300 steps (with top-2 routing) amplify that. What holds on any machine: Muon "
    "alone takes the highest max logit well above tau, MuonClip holds it near tau with far fewer "
    "steps above it, both end well below AdamW's loss and within about 0.04 of each other, and the "
    "balancing rule keeps every layer's experts near even.")


def format_table(results, tau):
  cols = ["optimizer", "train loss", "val loss", "highest max logit", "steps > tau", "head-steps > tau", "s/step"]
  moe = all(r["expert_load_max_over_mean"] is not None for r in results.values())
  cols += ["expert load max/mean"] if moe else []
  rows = [[name, f"{r['final_train_loss']:.3f}", f"{r['final_val_loss']:.3f}", f"{r['highest_max_logit']:.1f}",
           str(r["steps_with_clipped_head"]), f"{100 * r['clipped_head_fraction']:.1f}%", f"{r['sec_per_step']:.3f}"]
          + ([f"{r['expert_load_max_over_mean']:.2f}"] if moe else [])
          for name, r in results.items()]
  widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
  lines = [
      f"summary (tau = {tau:g}; train loss = mean of the last 10 steps; max logits are those of each "
      "step's forward pass; steps > tau = steps with a head above tau, which MuonClip then clips"
      + ("; expert load max/mean = the most loaded expert's share of the tokens over the mean share, "
         "worst layer, mean of the last 10 steps, 1.00 = balanced)" if moe else ")"),
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
