"""Two processes x 4 CPU devices on localhost: the sharded MuonClip train step across processes.

The test starts this file twice as a worker (``python tests/test_multihost.py WORKER_ID PORT
OUT_DIR``). Each worker sets up 4 CPU devices with gloo collectives, joins
``jax.distributed.initialize`` on 127.0.0.1, builds a 2 x 4 ``("fsdp", "model")`` mesh
whose ``fsdp`` axis spans the two processes (so the batch, the FSDP weight gathers, the
gradient reduction and the distributed Newton–Schulz's all-to-all cross processes), runs
STEPS steps of muonclip and writes the losses and the gathered params. The test compares
them with a single-device run in its own process.

Only 127.0.0.1 is bound: the coordinator (``coordinator_bind_address``) and gloo's TCP
transport (its ``hostname``, which JAX does not expose, set on the factory). Every wait is
bounded; the workers run in their own process groups and are killed when the test ends.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from _child_env import child_env

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LR, TAU, STEPS = 0.02, 3.0, 3
TIMEOUT_S = 300


def _batches():
  text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 4, np.uint8)
  return [np.stack([text[i:i + 17] for i in range(o, o + 8)]).astype(np.int32) for o in (0, 9)]


def _optimizer(mc, cfg, matrix_axes, **kw):
  return mc.muonclip(LR, layout=cfg.layout, matrix_axes=matrix_axes, qk_clip_threshold=TAU, **kw)


def _worker(process_id: int, port: int, out_dir: str) -> None:
  import functools

  import jax

  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 4)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  from jax._src.lib import _jax  # gloo binds to `hostname`; JAX's CPU client passes none

  _jax.make_gloo_tcp_collectives = functools.partial(_jax.make_gloo_tcp_collectives, hostname="127.0.0.1")
  address = f"127.0.0.1:{port}"
  jax.distributed.initialize(address, num_processes=2, process_id=process_id, coordinator_bind_address=address,
                             initialization_timeout=60, heartbeat_timeout_seconds=30, shutdown_timeout_seconds=30)
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh

  import muonclip_jax as mc
  from muonclip_jax import sharding, training
  from _tiny_lm import CFG, init_params, make_loss_fn, matrix_axes
  from mla_lm import logical_axes

  assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "model"))  # fsdp across the processes
  assert {d.process_index for d in mesh.devices[0]} != {d.process_index for d in mesh.devices[1]}

  def global_array(x, s):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda index: x[index])

  host_params = jax.device_get(jax.jit(lambda: init_params(CFG, 0))())
  ps = sharding.param_shardings(host_params, mesh, logical_axes=logical_axes(CFG))
  params = jax.tree.map(global_array, host_params, ps)
  opt = _optimizer(mc, CFG, matrix_axes, shard_orthogonalization=ps)
  state = sharding.init_state(opt, params, ps)
  batches = _batches()
  bs = sharding.batch_shardings(batches[0], mesh)
  step = sharding.jit_train_step(training.make_train_step(make_loss_fn(CFG), opt), ps,
                                 jax.tree.map(lambda x: x.sharding, state), bs)
  losses, clipped = [], []
  for t in range(STEPS):
    params, state, metrics = step(params, state, global_array(batches[t % 2], bs))
    losses.append(float(np.asarray(metrics["loss"].addressable_data(0))))
    clipped.append(int(np.asarray(metrics["num_clipped"].addressable_data(0))))
  full = multihost_utils.process_allgather(params, tiled=True)
  if process_id == 0:
    flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(full)[0]}
    np.savez(os.path.join(out_dir, "params.npz"), **flat)
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
      json.dump({"losses": losses, "num_clipped": clipped}, f)
  jax.distributed.shutdown()


def _gloo_available() -> bool:
  import jax

  try:
    from jax._src.lib import _jax

    jax.config.jax_cpu_collectives_implementation  # noqa: B018 (the option exists)
    return hasattr(_jax, "make_gloo_tcp_collectives")
  except (ImportError, AttributeError):
    return False


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _reference():
  import jax

  import muonclip_jax as mc
  from muonclip_jax import training
  from _tiny_lm import CFG, init_params, make_loss_fn, matrix_axes

  opt = _optimizer(mc, CFG, matrix_axes)
  params = jax.device_get(jax.jit(lambda: init_params(CFG, 0))())
  state = opt.init(params)
  step = jax.jit(training.make_train_step(make_loss_fn(CFG), opt))
  losses, clipped = [], []
  for t in range(STEPS):
    params, state, metrics = step(params, state, _batches()[t % 2])
    losses.append(float(metrics["loss"]))
    clipped.append(int(metrics["num_clipped"]))
  flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  return losses, clipped, flat


@pytest.mark.skipif(not _gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_two_processes_match_single_device(tmp_path):
  port = _free_port()
  env = child_env(PYTHONPATH=os.pathsep.join([ROOT, HERE, os.path.join(ROOT, "examples")]), JAX_PLATFORMS="cpu")
  procs = []
  try:
    for i in range(2):
      log = open(tmp_path / f"worker{i}.log", "w")
      procs.append(subprocess.Popen([sys.executable, __file__, str(i), str(port), str(tmp_path)], env=env, cwd=ROOT,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
      log.close()
    losses, clipped, ref = _reference()  # while the workers run
    for i, p in enumerate(procs):
      try:
        rc = p.wait(timeout=TIMEOUT_S)
      except subprocess.TimeoutExpired:
        pytest.fail(f"worker {i} did not finish in {TIMEOUT_S} s:\n{(tmp_path / f'worker{i}.log').read_text()[-3000:]}")
      assert rc == 0, f"worker {i} exited with {rc}:\n{(tmp_path / f'worker{i}.log').read_text()[-3000:]}"
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
  got = json.loads((tmp_path / "metrics.json").read_text())
  assert sum(clipped) > 0 and got["num_clipped"] == clipped
  np.testing.assert_allclose(got["losses"], losses, rtol=2e-5)
  params = np.load(tmp_path / "params.npz")
  assert set(params.files) == set(ref)
  for k in ref:
    np.testing.assert_allclose(params[k], ref[k], atol=2e-5, err_msg=k)


if __name__ == "__main__":
  _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
