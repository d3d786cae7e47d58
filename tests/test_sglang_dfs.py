"""``sglang_tree.dfs_order_key`` against a plain-Python walk of SGLang's
DFS-weight order (``mem_cache/base_prefix_cache.py _dfs_weight_order``,
SGLang 0.5.23): from the root, each node's children by decreasing weight
(the waiting requests whose match ends in the child's subtree), ties by
``born`` then page id, a child's whole subtree before the next child, a
node's own requests after its children. A request's key is the number of
waiting requests placed before its node's own ones.

The page trie comes from a random trace drawn fresh per case; ``born``,
the waiting set and the pages the matches end at are random. The bound
``DFS_PAGES`` is set so that some draws sort only the pages that weigh and
others every page (both ways are counted), and both must equal the walk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax.serving import sglang_tree as st


def _trie(rng):
  vocab = int(rng.integers(2, 5))
  base = rng.integers(0, vocab, 40)
  prompts, outputs = [], []
  for _ in range(int(rng.integers(3, 30))):
    shared = base[: int(rng.integers(0, 40))]
    own = rng.integers(0, vocab, int(rng.integers(1, 30)))
    p = np.concatenate([shared, own])
    prompts.append(p.astype(np.int64))
    outputs.append(rng.integers(0, vocab, 8).astype(np.int64))
  r = len(prompts)
  k = int(rng.choice([1, 2, 4]))
  return st.prepare(
    prompts, outputs, np.full(r, 8), np.zeros(r), np.zeros(r, bool), k
  )


def _tree(c, rng):
  v = c.parent.shape[0]
  z = jnp.zeros((v,), jnp.int32)
  return st.Tree(
    cached=jnp.ones((v,), bool), nstart=z, ts=z, lock=z, nend=z, rep=z,
    kids=z, born=jnp.asarray(rng.integers(0, 6, v), jnp.int32),
    evictable=z[0], clock=z[0], free=z[0], private=z[0], evicted=z[0],
    gmin=jnp.zeros((st.lru_groups(v)[1],), jnp.int32),
  )  # fmt: skip


def _walk(parent, born, waiting, node):
  """The keys by an explicit depth-first walk (plain Python)."""
  v = parent.shape[0]
  own = np.zeros(v, np.int64)
  for r in np.flatnonzero(waiting):
    own[node[r]] += 1
  kids = [[] for _ in range(v)]
  for p in range(1, v):
    kids[parent[p]].append(p)
  w = own.copy()
  for p in sorted(range(1, v), key=lambda p: -_depth(parent, p)):
    w[parent[p]] += w[p]
  key = np.zeros(v, np.int64)
  stack = [(0, 0)]  # (page, requests placed before its subtree)
  while stack:
    p, start = stack.pop()
    key[p] = start + w[p] - own[p]
    for q in sorted(kids[p], key=lambda q: (-w[q], born[q], q)):
      stack.append((q, start))
      start += w[q]
  return [int(key[node[r]]) for r in np.flatnonzero(waiting)], w


def _depth(parent, p):
  d = 0
  while p:
    p, d = parent[p], d + 1
  return d


def test_keys_equal_the_walk(rng, monkeypatch):
  ways = {"few": 0, "all": 0}
  for i in range(12):
    c = _trie(rng)
    t = _tree(c, rng)
    parent = np.asarray(c.parent)
    v, r_len = parent.shape[0], c.prompt.shape[0]
    waiting = rng.random(r_len) < rng.uniform(0.2, 1.0)
    # matches end anywhere on the trie (page 0: nothing matched)
    node = rng.integers(0, v, r_len) * (rng.random(r_len) < 0.8)
    want, w = _walk(parent, np.asarray(t.born), waiting, node)
    weighing = int((w > 0).sum())
    # in turn at the edge (just too few, just enough) and anywhere
    edge = [weighing - 1, weighing, int(rng.integers(1, 2 * weighing + 2))]
    bound = max(1, edge[i % 3])
    monkeypatch.setattr(st, "DFS_PAGES", bound)
    got = jax.jit(lambda t, c, a, b: st.dfs_order_key(t, c, a, b))(
      t, c, jnp.asarray(waiting), jnp.asarray(node, jnp.int32)
    )
    got = np.asarray(got)[waiting].tolist()
    assert got == want, (bound, weighing, v)
    ways["few" if weighing <= bound < v else "all"] += 1
  assert ways["few"] and ways["all"], ways
