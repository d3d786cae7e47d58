"""The SGLang tree's LRU victim index (``sglang_tree.Tree.gmin``, one lower
bound per group of pages): on tree states reached by random engines, every
bound is at most its group's smallest candidate time (the verbs keep it
so), and :func:`sglang_tree.evict_for` evicts exactly the leaves a plain
numpy scan of all pages picks (smallest time, first page on ties), also
when bounds are pushed further down at random so that it must repair them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from serving_compare import sglang_engine_inputs as _prepare

from prefixjax.serving import ServingConfig
from prefixjax.serving import sglang_engine as eng
from prefixjax.serving import sglang_tree as tr
from prefixjax.workloads import default_workload

BIG = np.iinfo(np.int32).max


def _group_min(t, B: int, G: int):
  """Each group's smallest candidate time (BIG if none), from the tree's
  arrays as the numpy scan below reads them."""
  v = jnp.arange(t.cached.shape[0])
  cand = (
    t.cached & (t.nstart == v) & (v != 0) & (t.kids == 0) & (t.lock == 0)
  )  # fmt: skip
  keys = jnp.where(cand, t.ts, BIG)
  keys = jnp.full((G * B,), BIG, jnp.int32).at[v].set(keys)
  return keys.reshape(G, B).min(axis=1)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _state_after(c, cfg, kn, n):
  """The engine's state after at most ``n`` loop iterations, and the number
  of iterations after which some bound exceeded its group's minimum."""
  B, G = tr.lru_groups(c.parent.shape[0])

  def body(x):
    s = eng._step(x[0], c, cfg, kn, None)
    bad = jnp.any(s.tree.gmin > _group_min(s.tree, B, G))
    return s, x[1] + 1, x[2] + bad.astype(jnp.int32)

  return jax.lax.while_loop(
    lambda x: eng._going(x[0]) & (x[1] < n), body, (eng.init(c, cfg), 0, 0)
  )


@functools.partial(jax.jit, static_argnames=("K",))
def _evict(t, c, K, demand):
  return tr.evict_for(t, c, K, demand)


def _keys(t) -> np.ndarray:
  """Each page's eviction key: its time if it is a candidate, else BIG."""
  v = np.arange(t.cached.shape[0])
  cand = (
    np.asarray(t.cached) & (np.asarray(t.nstart) == v) & (v != 0)
    & (np.asarray(t.kids) == 0) & (np.asarray(t.lock) == 0)
  )  # fmt: skip
  return np.where(cand, np.asarray(t.ts), BIG)


def _numpy_evict(t, c, K, need):
  """``RadixCache.evict`` by a scan of every page per victim."""
  cached, kids = np.array(t.cached), np.array(t.kids)
  nstart, ts, lock = np.asarray(t.nstart), np.asarray(t.ts), np.asarray(t.lock)
  nend, rep = np.asarray(t.nend), np.asarray(t.rep)
  pages, parent, depth = (np.asarray(a) for a in (c.pages, c.parent, c.depth))
  v = np.arange(cached.shape[0])
  ev, victims = 0, []
  while ev * K < need:
    cand = cached & (nstart == v) & (v != 0) & (kids == 0) & (lock == 0)
    if not cand.any():
      break
    x = int(np.argmin(np.where(cand, ts, BIG)))
    cached[pages[rep[x], depth[x] : nend[x]]] = False
    kids[nstart[parent[x]]] -= 1
    ev += int(nend[x] - depth[x])
    victims.append(x)
  return cached, kids, ev, victims


def _random_engine(rng, pages_sizes, pool):
  """A random SGLang engine (page size from ``pages_sizes``, pool
  ``pool(pages one request may need)``) over a random built-in trace:
  ``(seed, K, consts, cfg, knobs)``."""
  seed = int(rng.integers(0, 10**6))
  K = int(rng.choice(pages_sizes))
  config = ServingConfig(
    num_gpu_blocks=pool(-(-512 // K) + 2),
    block_size=K,
    max_num_seqs=int(rng.integers(2, 9)),
    max_num_batched_tokens=1024,
    max_model_len=512,
    semantics="sglang",
    scheduler=str(rng.choice(["fcfs", "lpm"])),
  )
  print(config, seed)
  trace = default_workload(num_requests=int(rng.integers(20, 41)), seed=seed)
  return (seed, K, *_prepare(trace, config)[:3])


def _evicting_run(rng):
  """A random engine over a pool of 1-1.5x what one request needs, and a
  random trace that makes it evict (drawn again, at most 8 times, in the
  rare case that one does not): ``(seed, K, consts, cfg, knobs, final
  state, its iterations)``."""
  for _ in range(8):
    seed, K, c, cfg, kn = _random_engine(
      rng, [1, 2, 4, 8], lambda one: one + int(rng.integers(2, one // 2))
    )
    s, iters, bad = _state_after(c, cfg, kn, 1 << 30)
    assert int(bad) == 0, (seed, int(bad))
    assert int(s.status) == 0, seed
    if int(s.tree.evicted) > 0:
      return seed, K, c, cfg, kn, s, int(iters)
  raise AssertionError("8 random runs, none evicted")


def test_bounds_hold_and_victims_equal_a_full_scan(rng):
  seed, K, c, cfg, kn, _, iters = _evicting_run(rng)
  B, G = tr.lru_groups(c.parent.shape[0])
  checked = 0
  # five states inside the run, and its end (finished requests' leaves)
  for n in [*sorted(rng.integers(1, max(iters, 2), size=5)), iters]:
    t = jax.device_get(_state_after(c, cfg, kn, int(n))[0].tree)
    keys = _keys(t)
    gmin = np.asarray(t.gmin)
    if not (keys < BIG).any():
      continue
    # lower some bounds further (still bounds): the trips must repair them
    low = rng.random(G) < 0.5
    t2 = t._replace(gmin=np.where(low, gmin - rng.integers(0, 50, G), gmin))
    need = int(rng.integers(1, 4 * int(t.evictable) + 2)) * K
    cached, kids, ev, victims = _numpy_evict(t2, c, K, need)
    out = jax.device_get(_evict(t2, c, K, int(t.free) * K + need))
    np.testing.assert_array_equal(np.asarray(out.cached), cached, f"{seed}")
    np.testing.assert_array_equal(np.asarray(out.kids), kids, f"{seed}")
    assert int(out.evicted) - int(t.evicted) == ev, (seed, victims)
    assert int(out.free) - int(t.free) == ev
    keys2 = np.full((G * B,), BIG, np.int64)
    keys2[: keys.shape[0]] = _keys(out)
    assert (np.asarray(out.gmin) <= keys2.reshape(G, B).min(axis=1)).all()
    checked += len(victims)
  assert checked > 0, f"no state to evict from (seed {seed})"


@jax.jit
def _verbs_keep_bounds(t, c, r, n, lock_len):
  """Each verb that can make a candidate, on a tree whose bounds are its
  groups' true minima: do the bounds still hold after it?"""
  B, G = tr.lru_groups(c.parent.shape[0])
  t = t._replace(gmin=_group_min(t, B, G))

  def holds(t):
    return jnp.all(t.gmin <= _group_min(t, B, G))

  unlocked = tr.lock_path(t, c, r, lock_len, -1)  # a release or retraction
  return jnp.stack([
    holds(unlocked),
    holds(tr.walk(t, c, r, n)[1]),  # a match that splits a node
    holds(tr.insert(t, c, r, n)[1]),  # a new leaf
  ])  # fmt: skip


def test_each_verb_keeps_the_bounds(rng):
  """Bounds made tight first, so that a verb which makes a candidate
  without lowering its group's bound is caught (the engine's own runs
  rarely show it: a new leaf is locked by its request at once, and an
  unlock without a walk comes only with a retraction)."""
  seed, _, c, cfg, kn = _random_engine(rng, [1, 2, 4], lambda one: 2 * one - 4)
  plen = np.asarray((c.pages >= 0).sum(axis=1))
  final, iters, _ = _state_after(c, cfg, kn, 1 << 30)
  iters = int(iters)
  done_at_end = np.flatnonzero(np.asarray(final.q.finish) >= 0)
  failed, tried = np.zeros(3, int), np.zeros(3, int)
  for n_iter in sorted(rng.integers(1, iters, size=6)):
    s = _state_after(c, cfg, kn, int(n_iter))[0]
    lock_len = np.asarray(s.q.lock_len)
    done = np.flatnonzero(np.asarray(s.q.finish) >= 0)  # paths in the tree
    if not done.size:  # paths that are not in the tree yet: no splits
      done = done_at_end
    held = np.flatnonzero(lock_len > 0)  # running: their paths locked
    for _ in range(10):
      r_done = int(rng.choice(done)) if done.size else 0
      n = int(rng.integers(1, max(plen[r_done], 1) + 1))  # often splits
      ok = np.asarray(_verbs_keep_bounds(s.tree, c, r_done, n, 0))
      failed[1:] += ~ok[1:]
      tried[1:] += done.size > 0
      if held.size:
        r = int(rng.choice(held))
        ok = np.asarray(_verbs_keep_bounds(s.tree, c, r, 1, int(lock_len[r])))
        failed[0] += ~ok[0]
        tried[0] += 1
  assert (failed == 0).all(), (seed, failed, tried)
  assert (tried > 0).all(), (seed, tried)


def _one_group(v_len: int):
  """One group of more pages than the trie holds."""
  return 1 << max(4, v_len.bit_length()), 1


def _groups_of_16(v_len: int):
  """Many groups of 16 pages, the last one most often partial."""
  return 16, -(-v_len // 16)


def _two_groups(v_len: int):
  """Two groups, the second shorter (so often the one read)."""
  return v_len // 2 + 1, 2


@pytest.mark.parametrize("groups", [_one_group, _groups_of_16, _two_groups])
def test_victims_equal_a_full_scan_under_other_groupings(
  rng, monkeypatch, groups
):
  """:func:`sglang_tree._evict` reads a group's pages as one window of
  ``min(B, V)`` slices, the last group's shifted back to end at ``V``: the
  same victims as the full scan with one group larger than the trie (the
  window is the whole trie), with groups of 16 (a partial last one) and
  with two groups, the second short."""
  monkeypatch.setattr(tr, "lru_groups", groups)
  monkeypatch.setattr(eng, "lru_groups", groups)
  jax.clear_caches()
  try:
    test_bounds_hold_and_victims_equal_a_full_scan(rng)
  finally:
    jax.clear_caches()
