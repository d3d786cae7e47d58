"""The one-block verbs against the general ones they stand for.

:func:`prefixjax.cache.prefix_cache.append_block` is ``append(state, seq,
1)`` for a sequence whose last block is full, and
:func:`prefixjax.cache.prefix_cache.publish_block` is ``publish(state, seq,
keys, (col + 1) * K)`` when every earlier column is published: on random
runs of admissions, decode tokens and releases over a small ``lru`` pool
(few token values, so prompts share prefixes, keys repeat and popped blocks
carry identities), each call of a block verb is made beside the general
verb on the same state and every array of the two results must be equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefixjax.cache import hashing, paging
from prefixjax.cache import prefix_cache as pc

K = 4
M = 8
N = 20
S = 4
OK = paging.Status.OK


def _keys(tokens):
  padded = np.zeros(M * K, np.int32)
  padded[: len(tokens)] = tokens
  keys, _ = hashing.block_hashes(jnp.asarray(padded), len(tokens), block_size=K)
  return keys


def _assert_same(a, b):
  for (path, x), y in zip(
    jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
  ):
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


@jax.jit
def _append_block(state, seq):
  return pc.append_block(state, seq)


@jax.jit
def _publish_block(state, seq, col, key):
  return pc.publish_block(state, seq, col, key)


@pytest.mark.parametrize("free_order", ["prepend_unhashed", "append"])
def test_block_verbs_equal_the_general_verbs(rng, free_order):
  state = pc.init(N, K, max_seqs=S, max_blocks_per_seq=M, free_order=free_order)
  seqs: dict[int, tuple[list[int], object]] = {}  # slot -> (tokens, keys)
  checked = {"append": 0, "publish": 0, "evicting": 0}
  for _ in range(300):
    free = [s for s in range(S) if s not in seqs]
    op = rng.integers(3)
    if op == 0 and free:  # admit a prompt, publish its full blocks
      slot = free[0]
      total = int(rng.integers(2, M * K))
      tokens = rng.integers(0, 2, total).tolist()
      keys = _keys(tokens)
      prompt = int(rng.integers(1, total + 1))
      state, r = pc.allocate_with_prefix(state, jnp.int32(slot), keys, prompt)
      if int(r.status) != OK:
        continue
      state, p = pc.publish(state, jnp.int32(slot), keys, prompt)
      assert int(p.status) == OK
      seqs[slot] = (tokens, keys, prompt)
    elif op == 1 and seqs:  # one decode token
      slot = int(rng.choice(list(seqs)))
      tokens, keys, held = seqs[slot]
      if held >= len(tokens):
        continue
      if held % K == 0 and int(state.paging.num_free) > 0:
        want, r = pc.append(state, jnp.int32(slot), 1)
        got, status = _append_block(state, jnp.int32(slot))
        assert int(status) == int(r.status) == OK
        checked["evicting"] += int(
          want.stats.evictions != state.stats.evictions
        )
        _assert_same(want, got)
        checked["append"] += 1
      else:
        got, r = pc.append(state, jnp.int32(slot), 1)
        if int(r.status) != OK:
          continue
      state, held = got, held + 1
      seqs[slot] = (tokens, keys, held)
      if held % K == 0:
        col = held // K - 1
        want, p = pc.publish(state, jnp.int32(slot), keys, held)
        got, q = _publish_block(
          state, jnp.int32(slot), jnp.int32(col), keys[col]
        )
        assert int(q.status) == int(p.status) == OK
        assert int(q.num_published) == int(p.num_published)
        _assert_same(want, got)
        checked["publish"] += 1
        state = got
    elif seqs:
      slot = int(rng.choice(list(seqs)))
      state, _ = pc.release(state, jnp.int32(slot))
      del seqs[slot]
    assert pc.check_invariants(state) == []
  assert min(checked.values()) > 0, checked


def test_block_verbs_refuse_what_they_do_not_stand_for():
  state = pc.init(N, K, max_seqs=S, max_blocks_per_seq=M)
  keys = _keys(list(range(M * K)))
  state, _ = pc.allocate_with_prefix(state, jnp.int32(0), keys, 6)
  # The last block is partly filled: no new block starts.
  same, status = _append_block(state, jnp.int32(0))
  assert int(status) == paging.Status.BAD_COUNT
  _assert_same(state, same)
  # Column 1 holds 2 of its 4 tokens: not full.
  same, r = _publish_block(state, jnp.int32(0), jnp.int32(1), keys[1])
  assert int(r.status) == paging.Status.BAD_COUNT
  _assert_same(state, same)
  with pytest.raises(ValueError, match="lru"):
    pc.append_block(
      pc.init(N, K, max_seqs=S, max_blocks_per_seq=M, policy="fifo"),
      jnp.int32(0),
    )


def _whiles(fn, *args) -> int:
  """``stablehlo.while`` ops in ``fn``'s lowered program."""
  return jax.jit(fn).lower(*args).as_text().count("stablehlo.while")


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_kernel_is_a_loop_on_cpu_and_a_plain_call_elsewhere(
  rng, monkeypatch, backend
):
  """``prefixjax._masked.kernel``: ``fn``'s value, as a one-trip while loop
  when the default backend is a CPU and without one on an accelerator
  (``jax.default_backend`` patched: the program is still lowered for this
  CPU); the block verbs that use it lose exactly those loops there."""
  from prefixjax._masked import kernel

  def fn(carry, x, flag):
    a, b = carry
    return a * x + b, jnp.where(flag, b - x, b)

  def call(c, x, f):
    return kernel(fn, c, x, f)

  a, b, x = (jnp.int32(v) for v in rng.integers(-1000, 1000, 3))
  flag = jnp.bool_(rng.integers(2))
  want = fn((a, b), x, flag)
  state = pc.init(N, K, max_seqs=S, max_blocks_per_seq=M)
  tokens = rng.integers(1, 50, 2 * K).tolist()
  state, _ = pc.allocate_with_prefix(state, 0, _keys(tokens), len(tokens))
  seq = jnp.int32(0)
  publish = (state, seq, jnp.int32(1), _keys(tokens)[1])
  counts = {}
  for name in ("cpu", backend):
    monkeypatch.setattr(jax, "default_backend", lambda name=name: name)
    jax.clear_caches()  # traces are cached per function, not per backend
    np.testing.assert_array_equal(jax.jit(call)((a, b), x, flag), want)
    counts[name] = (
      _whiles(call, (a, b), x, flag),
      _whiles(pc.append_block, state, seq),
      _whiles(pc.publish_block, *publish),
      jax.jit(pc.append_block)(state, seq),
    )
  monkeypatch.undo()
  jax.clear_caches()  # no trace made for the patched backend outlives this
  cpu, acc = counts["cpu"], counts[backend]
  assert cpu[0] == 1 and acc[0] == 0
  # append_block's own kernel call and evict_block's two; publish_block's
  # lookup, then _publish_one's insert and link.
  assert cpu[1] - acc[1] == 3, (cpu[1], acc[1])
  assert cpu[2] - acc[2] == 3, (cpu[2], acc[2])
  _assert_same(cpu[3], acc[3])
