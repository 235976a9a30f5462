"""Child process of ``test_distributed_ns``: the hybrid plan compiled on ``N`` fake CPU devices.

``python tests/_split_child.py N`` prints one JSON line: the compiled per-device FLOPs, the
single-device FLOPs, the HLO's and the planner's bytes, and the largest difference from the
single-device result. Needs its own process: the parent's JAX already has 8 devices.
"""

import functools
import json
import os
import sys

import jax

N = int(sys.argv[1])
jax.config.update("jax_num_cpu_devices", N)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import hlo_collectives  # noqa: E402

from muonclip_jax._orthogonalize import distributed, newton_schulz  # noqa: E402

NS = dict(steps=None, coeffs="polar_express_4", method="auto", eps=1e-7)
MESHES = {16: ((2, 8), ("data", "model")), 64: ((8, 8), ("data", "model"))}


def main():
  shape, names = MESHES[N]
  mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
  # One (256, 4096) matrix, most of the FLOPs (far above 1/N of them), and a stack of
  # small ones: the big one is split, the stack placed whole.
  specs = {"big": ((256, 4096), P(None, "model")), "small": ((N, 32, 64), P(None, None, "model"))}
  rng = np.random.default_rng(0)
  xs = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s, _ in specs.values()]
  ss = [NamedSharding(mesh, p) for _, p in specs.values()]
  axes = [((), (0,), (1,)), ((0,), (1,), (2,))]
  flops = distributed.ns_flops_of(NS)
  ns = functools.partial(newton_schulz, **NS)
  jax.lax.fori_loop = functools.partial(jax.lax.fori_loop, unroll=True)  # cost analysis: every step
  fn = lambda *a: distributed.orthogonalize_sharded(list(a), axes, ns, mesh=mesh, shardings=ss, flops=flops,
                                                        ns_kwargs=NS, shard_split="always")
  put = [jax.device_put(x, s) for x, s in zip(xs, ss)]
  compiled = jax.jit(fn).lower(*put).compile()
  one = jax.jit(lambda *a: [ns(x) for x in a]).lower(*xs).compile()
  hplan = distributed.plan_of(distributed.describe(xs, axes, mesh, ss), mesh, flops, NS, "always")
  out = compiled(*put)
  ref = one(*xs)
  found = hlo_collectives.collectives(compiled.as_text(), N)
  print(json.dumps({
      "flops": compiled.cost_analysis()["flops"], "single": one.cost_analysis()["flops"],
      "planned_flops": hplan.max_flops, "total_planned": sum(flops(*lf.mn) * lf.count for lf in
                                                             distributed.describe(xs, axes, mesh, ss)),
      "bytes": sum(hlo_collectives.received_bytes(c) for c in found), "planned_bytes": hplan.comm,
      "err": max(float(jnp.max(jnp.abs(o - r))) for o, r in zip(out, ref)),
      "splits": [[s.m, s.n, s.g, s.q] for s in hplan.splits],
      "same_sharding": all(o.sharding.is_equivalent_to(s, o.ndim) for o, s in zip(out, ss)),
  }))


if __name__ == "__main__":
  main()
