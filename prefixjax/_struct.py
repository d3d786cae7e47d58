"""Frozen dataclasses that are JAX pytrees (the states of every layer).

:func:`dataclass` is :func:`dataclasses.dataclass` (frozen) registered with
JAX's own :func:`jax.tree_util.register_dataclass`: fields are pytree
children unless declared with ``field(pytree_node=False)``, which makes
them static metadata (part of the tree structure, so a jitted function
specialises on them). ``.replace(**changes)`` returns a copy with fields
changed. The same contract as ``flax.struct``, without importing flax
(0.12 s of every command's start-up).
"""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["dataclass", "field"]


def field(*, pytree_node: bool = True, **kwargs):
  """A dataclass field; ``pytree_node=False`` makes it static metadata."""
  metadata = dict(kwargs.pop("metadata", None) or {})
  metadata["pytree_node"] = pytree_node
  return dataclasses.field(metadata=metadata, **kwargs)


def _replace(self, **changes):
  return dataclasses.replace(self, **changes)


def dataclass(cls):
  """Makes ``cls`` a frozen dataclass and a registered pytree."""
  cls = dataclasses.dataclass(frozen=True)(cls)
  data, meta = [], []
  for f in dataclasses.fields(cls):
    (data if f.metadata.get("pytree_node", True) else meta).append(f.name)
  jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
  cls.replace = _replace
  return cls
