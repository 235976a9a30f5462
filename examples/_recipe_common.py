"""What the recipes (``examples/recipe_*.py``) share and MuonClip does not touch: toy
data and the printed training loop. Each recipe keeps its own model, optimizer and step,
where its ``# MuonClip`` lines are."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp


def batches(cfg: Any, batch_size: int, seed: int = 0) -> Iterator[jax.Array]:
  """Token sequences ``(batch_size, cfg.seq_len + 1)`` counting up from a random start
  (mod ``cfg.vocab``): learnable in a few steps."""
  key = jax.random.key(seed)
  while True:
    key, sub = jax.random.split(key)
    start = jax.random.randint(sub, (batch_size, 1), 0, cfg.vocab)
    yield (start + jnp.arange(cfg.seq_len + 1)[None, :]) % cfg.vocab


def train(step: Callable[[jax.Array], tuple[jax.Array, Any]], data: Iterator[jax.Array], steps: int) -> None:
  """Runs ``step(tokens) -> (loss, intermediates)`` ``steps`` times, printing the loss and
  the largest sown max logit every 10 steps and at the last."""
  for i in range(steps):
    loss, intermediates = step(next(data))
    if i % 10 == 0 or i == steps - 1:
      top = max(float(jnp.max(x)) for x in jax.tree.leaves(intermediates))
      print(f"step {i:3d}  loss {float(loss):.3f}  max logit {top:.2f}")


def train_linen(model: Any, opt: Any, make_step: Callable, cfg: Any, steps: int) -> None:
  """``train`` for a Linen recipe: init on the first batch, then its jitted
  ``step(params, opt_state, tokens) -> (params, opt_state, loss, intermediates)``."""
  data = batches(cfg, batch_size=8)
  params = model.init(jax.random.key(0), next(data)[:, :-1])["params"]
  opt_state, jitted = opt.init(params), make_step(model, opt)

  def step(tokens):
    nonlocal params, opt_state
    params, opt_state, loss, intermediates = jitted(params, opt_state, tokens)
    return loss, intermediates

  train(step, data, steps)
