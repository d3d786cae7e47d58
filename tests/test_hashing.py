"""Tests of the chained 64-bit block hashes (two uint32 lanes)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefixjax.cache import hashing

K = 4


# ---------------------------------------------------------------------------
# An independent numpy reimplementation (uint32 arrays wrap silently).


def _np_rotl(x, r):
  return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def np_hash_words(words: np.ndarray, seed: int) -> np.ndarray:
  """MurmurHash3_x86_32 lane + XXH32-style lane over the last axis."""
  with np.errstate(over="ignore"):
    return _np_hash_words(words, seed)


def _np_hash_words(words: np.ndarray, seed: int) -> np.ndarray:
  words = np.asarray(words).astype(np.uint32)
  n = words.shape[-1]
  nbytes = (4 * n) & 0xFFFFFFFF
  a = np.full(words.shape[:-1], seed, np.uint32)
  b = np.full(
    words.shape[:-1],
    ((seed ^ 0x9E3779B9) + 0x165667B1 + nbytes) & 0xFFFFFFFF,
    np.uint32,
  )
  for i in range(n):
    w = words[..., i]
    k = w * np.uint32(0xCC9E2D51)
    k = _np_rotl(k, 15) * np.uint32(0x1B873593)
    a = _np_rotl(a ^ k, 13) * np.uint32(5) + np.uint32(0xE6546B64)
    b = _np_rotl(b + w * np.uint32(0xC2B2AE3D), 17) * np.uint32(0x27D4EB2F)
  a = a ^ np.uint32(nbytes)
  a ^= a >> np.uint32(16)
  a *= np.uint32(0x85EBCA6B)
  a ^= a >> np.uint32(13)
  a *= np.uint32(0xC2B2AE35)
  a ^= a >> np.uint32(16)
  b ^= b >> np.uint32(15)
  b *= np.uint32(0x85EBCA77)
  b ^= b >> np.uint32(13)
  b *= np.uint32(0xC2B2AE3D)
  b ^= b >> np.uint32(16)
  return np.stack([a, b], axis=-1)


def np_chain(digests: np.ndarray, extra) -> np.ndarray:
  parent = np_hash_words(np.asarray(extra, np.uint32), hashing.SEED_EXTRA)
  out = []
  for g in digests:
    parent = np_hash_words(np.concatenate([parent, g]), hashing.SEED_CHAIN)
    out.append(parent)
  return np.asarray(out, np.uint32).reshape(-1, 2)


def np_block_hashes(tokens, block_size, extra=()):
  tokens = np.asarray(tokens, np.int64)
  nb = len(tokens) // block_size
  blocks = tokens[: nb * block_size].reshape(nb, block_size) & 0xFFFFFFFF
  return np_chain(np_hash_words(blocks, hashing.SEED_TOKENS), extra)


def _keys(tokens, n=None, extra=None, block_size=K):
  tokens = jnp.asarray(tokens, jnp.int32)
  n = tokens.shape[0] if n is None else n
  keys, valid = hashing.block_hashes(
    tokens, n, block_size=block_size, extra=extra
  )
  return np.asarray(keys), np.asarray(valid)


# ---------------------------------------------------------------------------


def test_numpy_reimplementation_agrees_bit_for_bit(rng):
  # A few shapes (each compiles once), random contents.
  for k, t, e in [(1, 5, 0), (4, 23, 2), (16, 80, 1)] * 3:
    tokens = rng.integers(-(2**31), 2**31, size=t)
    extra = rng.integers(0, 2**32, size=e)
    got, valid = _keys(tokens, extra=extra.astype(np.uint32), block_size=k)
    want = np_block_hashes(tokens, k, extra)
    assert valid.all()
    np.testing.assert_array_equal(got, want)
  # Words straight through hash_words, including the scan path (n > 8).
  for n in (0, 1, 3, 8, 9, 33):
    words = rng.integers(0, 2**32, size=(5, n)).astype(np.uint32)
    np.testing.assert_array_equal(
      np.asarray(hashing.hash_words(jnp.asarray(words), 12345)),
      np_hash_words(words, 12345),
    )


def test_known_values_pin_the_function():
  # Pinned so a silent change of the construction breaks this test (stored
  # traces and results would otherwise stop being comparable).
  got, _ = _keys(np.arange(10), 9, extra=7)
  assert got.tolist() == [
    [4278826032, 1078627092],
    [1511535251, 2564861836],
  ]


def test_deterministic_and_masked_past_full_blocks(rng):
  tokens = rng.integers(0, 50_000, size=6 * K)
  a, va = _keys(tokens, 4 * K + 3)
  b, vb = _keys(tokens, 4 * K + 3)
  np.testing.assert_array_equal(a, b)
  assert va.tolist() == [True] * 4 + [False] * 2
  assert (a[4:] == 0).all()
  # Padding past num_tokens does not matter.
  padded = tokens.copy()
  padded[4 * K :] = 0
  c, _ = _keys(padded, 4 * K + 3)
  np.testing.assert_array_equal(a[:4], c[:4])
  # Short prompt: no full block.
  d, vd = _keys(tokens, K - 1)
  assert not vd.any() and (d == 0).all()


def test_changing_one_token_changes_its_block_and_all_later(rng):
  tokens = rng.integers(0, 50_000, size=8 * K)
  base, _ = _keys(tokens)
  for i in range(8):
    changed = tokens.copy()
    changed[i * K + int(rng.integers(K))] += 1
    got, _ = _keys(changed)
    np.testing.assert_array_equal(got[:i], base[:i])
    assert (got[i:] != base[i:]).any(axis=-1).all(), i


def test_extra_isolates_equal_tokens(rng):
  tokens = rng.integers(0, 50_000, size=5 * K)
  plain, _ = _keys(tokens)
  seen = {tuple(map(tuple, plain))}
  for extra in ([1], [2], [1, 0], [0, 1], [2**32 - 1], [1, 2, 3]):
    got, _ = _keys(tokens, extra=np.asarray(extra, np.uint32))
    assert (got != plain).any(axis=-1).all(), extra
    seen.add(tuple(map(tuple, got)))
  assert len(seen) == 7
  # int and list spellings agree.
  a, _ = _keys(tokens, extra=5)
  b, _ = _keys(tokens, extra=[5])
  np.testing.assert_array_equal(a, b)


def test_vmap_equals_loop(rng):
  batch, t = 6, 7 * K
  tokens = rng.integers(0, 1000, size=(batch, t)).astype(np.int32)
  counts = rng.integers(0, t + 1, size=batch).astype(np.int32)
  extras = rng.integers(0, 2**32, size=(batch, 2)).astype(np.uint32)
  fn = functools.partial(hashing.block_hashes, block_size=K)
  keys, valid = jax.jit(jax.vmap(lambda a, n, e: fn(a, n, extra=e)))(
    tokens, counts, extras
  )
  for i in range(batch):
    want, want_valid = _keys(tokens[i], counts[i], extra=extras[i])
    np.testing.assert_array_equal(np.asarray(keys[i]), want)
    np.testing.assert_array_equal(np.asarray(valid[i]), want_valid)


def test_batch_equals_numpy_per_sequence(rng):
  # Random lengths around the block multiples (empty, partial, cut at M).
  m = int(rng.integers(1, 6))
  k = int(rng.choice([1, 3, K]))
  seqs = [
    rng.integers(0, 2**31 - 1, size=int(rng.integers(0, (m + 2) * k + 1)))
    for _ in range(int(rng.integers(1, 12)))
  ]
  got = np.asarray(hashing.block_hashes_batch(seqs, block_size=k, max_blocks=m))
  assert got.shape == (len(seqs), m, 2) and got.dtype == np.uint32
  for i, seq in enumerate(seqs):
    want = np_block_hashes(seq[: m * k], k).reshape(-1, 2)
    np.testing.assert_array_equal(got[i, : len(want)], want, err_msg=str(i))
    assert not got[i, len(want) :].any()


def test_chain_block_ids_int32_and_int64_agree_and_chain(rng):
  ids = rng.integers(-(2**31), 2**31, size=9)
  a, va = hashing.chain_block_ids(jnp.asarray(ids, jnp.int32))
  b, vb = hashing.chain_block_ids(hashing.int64_to_lanes(ids))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.asarray(va).all()
  # numpy reference.
  lanes = hashing.int64_to_lanes(ids)
  want = np_chain(np_hash_words(lanes, hashing.SEED_IDS), ())
  np.testing.assert_array_equal(np.asarray(a), want)
  # Changing id i changes keys i.. only; 64-bit ids use the high lane.
  big = rng.integers(0, 2**62, size=6)
  base = np.asarray(hashing.chain_block_ids(hashing.int64_to_lanes(big))[0])
  for i in range(6):
    changed = big.copy()
    changed[i] += 2**33
    got = np.asarray(
      hashing.chain_block_ids(hashing.int64_to_lanes(changed))[0]
    )
    np.testing.assert_array_equal(got[:i], base[:i])
    assert (got[i:] != base[i:]).any(axis=-1).all()
  # Salted ids differ; num_ids masks.
  salted, _ = hashing.chain_block_ids(hashing.int64_to_lanes(big), extra=3)
  assert (np.asarray(salted) != base).any(axis=-1).all()
  part, valid = hashing.chain_block_ids(hashing.int64_to_lanes(big), 4)
  np.testing.assert_array_equal(np.asarray(part)[:4], base[:4])
  assert (np.asarray(part)[4:] == 0).all()
  assert np.asarray(valid).tolist() == [True] * 4 + [False] * 2


def test_token_blocks_and_id_blocks_are_separate_domains():
  tokens = np.asarray([5, 0], np.int32)
  a, _ = _keys(tokens, block_size=2)
  b, _ = hashing.chain_block_ids(hashing.int64_to_lanes([5]))
  assert (a != np.asarray(b)).any()


def test_no_collisions_among_100k_random_distinct_blocks(rng):
  n = 100_000
  blocks = rng.integers(0, 2**31, size=(n, 16)).astype(np.int64)
  # Also many near-identical blocks: single-token and two-token changes.
  blocks[: n // 4] = 7
  rows = np.arange(n // 4)
  blocks[rows, rows % 16] = rows
  blocks[rows, (rows * 7 + 3) % 16] += rows // 16
  blocks = np.unique(blocks, axis=0)
  tokens = jnp.asarray(blocks.reshape(-1), jnp.int32)
  keys, _ = hashing.block_hashes(tokens, tokens.shape[0], block_size=16)
  keys = np.asarray(keys).astype(np.uint64)
  packed = (keys[:, 0] << np.uint64(32)) | keys[:, 1]
  assert len(np.unique(packed)) == len(blocks) > 90_000
  # Trace ids too (the chain makes each key depend on all earlier ids, so
  # chain independent single-id sequences through vmap).
  ids = rng.choice(2**62, size=n, replace=False)
  lanes = hashing.int64_to_lanes(ids)[:, None, :]
  keys = jax.vmap(lambda x: hashing.chain_block_ids(x)[0])(lanes)[:, 0]
  keys = np.asarray(keys).astype(np.uint64)
  packed = (keys[:, 0] << np.uint64(32)) | keys[:, 1]
  assert len(np.unique(packed)) == n


@pytest.mark.parametrize(
  "call, error, message",
  [
    (
      lambda: hashing.block_hashes(jnp.zeros(4, jnp.int32), 4, block_size=0),
      ValueError,
      "block_size=0 must be >= 1",
    ),
    (
      lambda: hashing.block_hashes(jnp.zeros(4), 4, block_size=2),
      TypeError,
      "token_ids must be int32",
    ),
    (
      lambda: hashing.block_hashes(
        jnp.zeros((2, 4), jnp.int32), 4, block_size=2
      ),
      ValueError,
      "token_ids must be 1-D",
    ),
    (
      lambda: hashing.block_hashes(
        jnp.zeros(4, jnp.int32), 4, block_size=2, extra=[2**33]
      ),
      ValueError,
      "does not fit in 32 bits",
    ),
    (
      lambda: hashing.chain_block_ids(jnp.zeros((3, 3), jnp.uint32)),
      ValueError,
      r"ids must be \[B\] int32 or \[B, 2\] uint32",
    ),
  ],
  ids=["block_size", "dtype", "rank", "extra", "ids"],
)
def test_boundary_errors(call, error, message):
  with pytest.raises(error, match=message):
    call()
