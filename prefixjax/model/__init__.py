"""A Llama-style model served through the paged prefix cache.

* :mod:`prefixjax.model.llama`: the Flax decoder (:class:`Llama`), seeded
  random weights (:func:`init_params`), orbax checkpoints
  (:func:`save_params`, :func:`restore_params`).
* :mod:`prefixjax.model.forward`: one engine step of the model over the
  paged KV pool through :mod:`pallas_kernels` (batch-invariant or batched).
* :mod:`prefixjax.model.engine`: :class:`Engine`, the serving simulator's
  scheduler and cache plus the forward pass; :class:`CacheConfig`.
"""

from prefixjax.model.engine import CacheConfig, Engine, GenerateResult
from prefixjax.model.llama import (
  Llama,
  init_params,
  num_params,
  restore_params,
  save_params,
)

__all__ = [
  "CacheConfig",
  "Engine",
  "GenerateResult",
  "Llama",
  "init_params",
  "num_params",
  "restore_params",
  "save_params",
]
