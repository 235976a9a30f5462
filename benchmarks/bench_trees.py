"""The default Muon update of two source trees, timed in alternating processes.

A change's "speed does not regress" check: ``bench_orthogonalization.py``'s default rows
(``muonclip_jax.muon(1.0, weight_decay=0.0)`` on the GPT-2-small hidden matrices, 12 layers,
and the DeepSeek-style MLA shapes, 4 layers) timed for a tree checked out at an earlier
commit and for this one. Each round runs one process per tree, the trees' order alternating
from round to round, so that a drift of the machine falls on both; every process also times
``optax.contrib.muon`` (the same in both trees) as a control. Reported: per tree and set, the
median over all rounds of the per-process medians and their range, and the median of the
per-process ratios of the default to the control.

  git worktree add --detach .wt/base b4632f7
  PYTHONPATH=. python benchmarks/bench_trees.py --before .wt/base --rounds 3
  PYTHONPATH=. python benchmarks/bench_trees.py --grouping --repeats 7   # the grouping's own cost
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import json, statistics, sys, time
import jax, jax.numpy as jnp
import muonclip_jax as mc
sys.path.insert(0, {bench!r})
from bench_muon import contenders, gpt2_hidden_matrices, mla_hidden_matrices

shared = contenders()  # bench_muon's: the library's default Muon and optax.contrib.muon
opts = {{"default": shared["muonclip_jax.muon() defaults"], "optax": shared["optax.contrib.muon"],
        "ns_batch=1": mc.muon(1.0, weight_decay=0.0, ns_batch=1)}}
out = {{}}
for name, params in (("gpt2", gpt2_hidden_matrices({gpt_layers})), ("mla", mla_hidden_matrices({mla_layers}))):
  grads = jax.tree.map(jnp.sin, params)
  runs = {{}}
  for label in {labels!r}:
    opt = opts[label]
    state = opt.init(params)
    fn = jax.jit(opt.update).lower(grads, state, params).compile()
    jax.block_until_ready(fn(grads, state, params))
    runs[label] = (fn, state)
  times = {{label: [] for label in runs}}
  for _ in range({repeats}):
    for label, (fn, state) in runs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(grads, state, params))
      times[label].append(time.perf_counter() - t0)
  out[name] = {{label: statistics.median(t) * 1e3 for label, t in times.items()}}
print("RESULT " + json.dumps(out))
"""


def titles(args) -> dict:
  return {"gpt2": f"GPT-2-small, {args.layers} layers", "mla": f"MLA, {args.mla_layers} layers"}


def run_tree(tree: str, args, labels=("default", "optax")) -> dict:
  code = CHILD.format(bench=HERE, gpt_layers=args.layers, mla_layers=args.mla_layers, repeats=args.repeats,
                      labels=tuple(labels))
  env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
  if proc.returncode:
    raise RuntimeError(f"the process for {tree} failed:\n{proc.stderr[-4000:]}")
  result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
  return json.loads(result[len("RESULT "):])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--before", help="path of the earlier tree (a git worktree)")
  parser.add_argument("--grouping", action="store_true",
                      help="instead: the default against ns_batch=1 (one matrix per call), alternating in one "
                           "process of the later tree")
  parser.add_argument("--after", default=ROOT, help="path of the later tree (default: this checkout)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--mla-layers", type=int, default=4)
  args = parser.parse_args()
  if args.grouping:
    res = run_tree(args.after, args, ("default", "ns_batch=1"))
    print(f"\none process, {args.repeats} repeats alternating; medians, ms\n")
    print("| set | default | ns_batch=1 |\n|---|---|---|")
    for name, title in titles(args).items():
      print(f"| {title} | {res[name]['default']:.0f} | {res[name]['ns_batch=1']:.0f} |")
    return
  if args.before is None:
    parser.error("--before is required (or --grouping)")
  trees = {"before": args.before, "after": args.after}
  results = {label: [] for label in trees}
  for r in range(args.rounds):
    order = list(trees) if r % 2 == 0 else list(reversed(list(trees)))
    for label in order:
      res = run_tree(trees[label], args)
      results[label].append(res)
      print(f"round {r + 1}, {label}: {json.dumps(res)}", flush=True)

  def cell(label, name, contender):
    xs = [res[name][contender] for res in results[label]]
    return f"{statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})"

  def ratio(label, name):  # the default over the same process's optax control: the machine's drift cancels
    xs = [res[name]["default"] / res[name]["optax"] for res in results[label]]
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"

  print(f"\n{args.rounds} rounds x {args.repeats} repeats; per-process medians, ms: median (min-max)\n")
  print("| set | default, before | default, after | optax.contrib.muon, before | optax.contrib.muon, after "
        "| default / optax, before | default / optax, after |")
  print("|---|---|---|---|---|---|---|")
  for name, title in titles(args).items():
    print(f"| {title} | {cell('before', name, 'default')} | {cell('after', name, 'default')} "
          f"| {cell('before', name, 'optax')} | {cell('after', name, 'optax')} "
          f"| {ratio('before', name)} | {ratio('after', name)} |")


if __name__ == "__main__":
  main()
