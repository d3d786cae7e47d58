"""Chained 64-bit block hashes, computed on the device with 32-bit lanes.

Representation. jax runs with 32-bit types by default, so a 64-bit block key
is an array of two uint32 lanes, ``[..., 2]``: lane 0 and lane 1 are two
independent 32-bit hashes of the same input words (below). Keys are compared
as pairs; the index (:mod:`prefixjax.cache.index`) uses lane 0 for its home
bucket.
A trace id given as int64 is split into ``(low 32 bits, high 32 bits)`` by
:func:`int64_to_lanes` (host side); an int32 id is sign-extended the same
way, so an id gets the same key whichever width it arrives in.

Construction (written for this project from the published algorithms):

* ``hash_words(words, seed)`` hashes a sequence of ``n`` uint32 words into two
  lanes. Lane 0 is MurmurHash3_x86_32 (Austin Appleby, public domain): its
  per-word body ``k *= c1; k = rotl(k, 15); k *= c2; h ^= k; h = rotl(h, 13);
  h = h * 5 + 0xe6546b64`` and its ``fmix32`` finaliser after ``h ^= 4n``.
  Lane 1 is XXH32 (Yann Collet, BSD) in its short-input form applied to every
  word: ``h = seed + PRIME5 + 4n``, per word ``h = rotl(h + w * PRIME3, 17)
  * PRIME4``, then XXH32's avalanche. Both per-word steps are bijections of
  the lane state, so two equal-length inputs that differ in exactly one word
  never collide in either lane; otherwise a key collides only when both
  independent lanes do (about ``2**-64`` per pair).
* Token block ``i`` (``K`` token ids) is digested in parallel over blocks:
  ``g_i = hash_words(tokens_i, SEED_TOKENS)``; pre-chained trace ids are
  digested as ``g_i = hash_words((lo, hi), SEED_IDS)``.
* The chain is a cheap sequential scan:
  ``h_i = hash_words((h_{i-1}, g_i), SEED_CHAIN)`` with
  ``h_{-1} = hash_words(extra, SEED_EXTRA)``. So ``h_i = H(h_{i-1},
  tokens_i)`` and ``extra`` (adapter id, cache salt, model version, any
  uint32 words) enters through the first block: equal tokens with a
  different ``extra`` never share a key (up to 64-bit collisions).
* :func:`with_version` mixes a version word into finished keys
  (``hash_words((key, version), SEED_VERSION)``); the prefix cache uses it
  so a version bump makes every earlier key unmatchable in O(1).

Different seeds separate the domains (token digests, id digests, chain,
extra, version), so a token block and a trace id never share a digest by
construction.

Collision risk: with ``n`` distinct blocks the chance that any two share a
64-bit key is about ``n**2 / 2**65``: 2.7e-8 for 10^6 blocks, 9e-10 for the
182,790 blocks of the Mooncake conversation trace. A 32-bit key would
already collide with probability ~0.98 at 182,790 blocks.

Dimensions: ``T`` tokens, ``K`` block size, ``B = T // K`` blocks, ``E``
extra words.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._host import to_device

__all__ = [
  "SEED_CHAIN",
  "SEED_EXTRA",
  "SEED_IDS",
  "SEED_TOKENS",
  "SEED_VERSION",
  "block_hashes",
  "block_hashes_batch",
  "chain_block_ids",
  "hash_words",
  "int64_to_lanes",
  "with_version",
]

# Domain seeds (arbitrary distinct odd constants).
SEED_TOKENS = 0x243F6A89
SEED_IDS = 0x85A308D3
SEED_CHAIN = 0x13198A2F
SEED_EXTRA = 0x03707345
SEED_VERSION = 0xA4093823

# MurmurHash3_x86_32 constants.
_M3_C1 = 0xCC9E2D51
_M3_C2 = 0x1B873593
_M3_N = 0xE6546B64
_M3_F1 = 0x85EBCA6B
_M3_F2 = 0xC2B2AE35
# XXH32 primes.
_XX_P2 = 0x85EBCA77
_XX_P3 = 0xC2B2AE3D
_XX_P4 = 0x27D4EB2F
_XX_P5 = 0x165667B1
# Lane 1 starts from a different seed than lane 0 so the lanes are unrelated
# even for the same domain seed.
_LANE1_SEED_XOR = 0x9E3779B9


def _u32(x) -> jax.Array:
  return jnp.asarray(np.uint32(x))


def _rotl(x: jax.Array, r: int) -> jax.Array:
  return (x << r) | (x >> (32 - r))


def _murmur_step(h: jax.Array, w: jax.Array) -> jax.Array:
  k = w * _u32(_M3_C1)
  k = _rotl(k, 15) * _u32(_M3_C2)
  h = _rotl(h ^ k, 13)
  return h * _u32(5) + _u32(_M3_N)


def _murmur_final(h: jax.Array, nbytes: int) -> jax.Array:
  h = h ^ _u32(nbytes)
  h = h ^ (h >> 16)
  h = h * _u32(_M3_F1)
  h = h ^ (h >> 13)
  h = h * _u32(_M3_F2)
  return h ^ (h >> 16)


def _xxh_step(h: jax.Array, w: jax.Array) -> jax.Array:
  return _rotl(h + w * _u32(_XX_P3), 17) * _u32(_XX_P4)


def _xxh_final(h: jax.Array) -> jax.Array:
  h = h ^ (h >> 15)
  h = h * _u32(_XX_P2)
  h = h ^ (h >> 13)
  h = h * _u32(_XX_P3)
  return h ^ (h >> 16)


def hash_words(words: jax.Array, seed: int) -> jax.Array:
  """Hashes the last axis of ``words`` (``[..., n]`` uint32) to two lanes.

  Args:
    words: ``[..., n]`` uint32 (int32 is bit-cast); ``n`` may be 0.
    seed: a Python int in ``[0, 2**32)``, the domain seed.

  Returns:
    ``[..., 2]`` uint32: MurmurHash3_x86_32 and XXH32-style lanes (see the
    module docstring).

  Example:
    >>> import jax.numpy as jnp
    >>> from prefixjax.cache import hashing
    >>> hashing.hash_words(jnp.arange(4, dtype=jnp.uint32), 1).shape
    (2,)
  """
  words = jnp.asarray(words)
  if words.dtype == jnp.int32:
    words = jax.lax.bitcast_convert_type(words, jnp.uint32)
  if words.dtype != jnp.uint32:
    raise TypeError(f"words must be uint32 or int32, got {words.dtype}")
  n = words.shape[-1]
  batch = words.shape[:-1]
  nbytes = (4 * n) & 0xFFFFFFFF
  a = jnp.full(batch, np.uint32(seed), jnp.uint32)
  b = jnp.full(
    batch,
    np.uint32((seed ^ _LANE1_SEED_XOR) + _XX_P5 + nbytes & 0xFFFFFFFF),
    jnp.uint32,
  )
  if n <= 8:
    for i in range(n):
      a = _murmur_step(a, words[..., i])
      b = _xxh_step(b, words[..., i])
  else:

    def body(carry, w):
      a, b = carry
      return (_murmur_step(a, w), _xxh_step(b, w)), None

    (a, b), _ = jax.lax.scan(body, (a, b), jnp.moveaxis(words, -1, 0))
  return jnp.stack([_murmur_final(a, nbytes), _xxh_final(b)], axis=-1)


def _as_words(x, name: str) -> jax.Array:
  """Converts ids / extra words to uint32 (int32 is bit-cast)."""
  if x is None:
    return jnp.zeros((0,), jnp.uint32)
  if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
    x = [x]
  if isinstance(x, (list, tuple)):
    vals = [int(v) for v in x]
    for v in vals:
      if not -(2**31) <= v < 2**32:
        raise ValueError(f"{name} word {v} does not fit in 32 bits")
    return jnp.asarray(
      np.asarray([v & 0xFFFFFFFF for v in vals], np.uint32).reshape(-1)
    )
  arr = jnp.asarray(x)
  if arr.dtype == jnp.int32:
    return jax.lax.bitcast_convert_type(arr, jnp.uint32)
  if arr.dtype != jnp.uint32:
    raise TypeError(f"{name} must be uint32 or int32, got {arr.dtype}")
  return arr


def _chain(digests: jax.Array, extra: jax.Array) -> jax.Array:
  """``h_i = hash_words((h_{i-1}, g_i), SEED_CHAIN)``; ``[B, 2]`` -> same."""
  root = hash_words(extra, SEED_EXTRA)  # [2]

  def step(parent, digest):
    h = hash_words(jnp.concatenate([parent, digest]), SEED_CHAIN)
    return h, h

  _, keys = jax.lax.scan(step, root, digests)
  return keys


@functools.partial(jax.jit, static_argnames=("block_size",))
def _block_hashes(token_ids, num_tokens, extra, *, block_size):
  t = token_ids.shape[0]
  num_blocks = t // block_size
  blocks = token_ids[: num_blocks * block_size].reshape(num_blocks, block_size)
  keys = _chain(hash_words(blocks, SEED_TOKENS), extra)
  valid = jnp.arange(num_blocks) < num_tokens // block_size
  return jnp.where(valid[:, None], keys, jnp.uint32(0)), valid


def block_hashes(token_ids, num_tokens, *, block_size: int, extra=None):
  """Chained keys of the full blocks of a token sequence.

  ``h_i = H(h_{i-1}, tokens of block i)`` with ``extra`` entering the first
  block (see the module docstring). Works under ``jax.jit`` and
  ``jax.vmap`` (over tokens, counts and ``extra``).

  Args:
    token_ids: ``[T]`` int32 token ids, padded past ``num_tokens``.
    num_tokens: int32 scalar, tokens that are real; only the
      ``num_tokens // K`` full blocks get keys.
    block_size: ``K``, static.
    extra: ``[E]`` uint32 / int32 words (or an int, a list, ``None``):
      adapter id, cache salt, model version.

  Returns:
    ``(keys, valid)``: ``keys`` ``[T // K, 2]`` uint32, zero past the last
    full block; ``valid`` ``[T // K]`` bool.

  Example:
    >>> import jax.numpy as jnp
    >>> from prefixjax.cache import hashing
    >>> keys, valid = hashing.block_hashes(
    ...     jnp.arange(10, dtype=jnp.int32), 9, block_size=4, extra=7)
    >>> keys.shape, valid.tolist()
    ((2, 2), [True, True])
  """
  if isinstance(block_size, bool) or not isinstance(block_size, int):
    raise TypeError(f"{block_size=} must be an int")
  if block_size < 1:
    raise ValueError(f"{block_size=} must be >= 1")
  token_ids = jnp.asarray(token_ids)
  if token_ids.ndim != 1:
    raise ValueError(f"token_ids must be 1-D [T], got shape {token_ids.shape}")
  if token_ids.dtype != jnp.int32:
    raise TypeError(f"token_ids must be int32, got {token_ids.dtype}")
  extra = _as_words(extra, "extra")
  if extra.ndim != 1:
    raise ValueError(f"extra must be 1-D [E], got shape {extra.shape}")
  num_tokens = jnp.asarray(num_tokens, jnp.int32)
  return _block_hashes(token_ids, num_tokens, extra, block_size=block_size)


def block_hashes_batch(sequences, *, block_size: int, max_blocks: int):
  """Host side: :func:`block_hashes` of many token sequences at once.

  Equal, row for row, to ``jax.vmap(block_hashes)`` over the sequences
  padded to ``max_blocks * block_size`` tokens (no ``extra``), but only the
  full blocks are digested: the sequences' tokens are gathered into one
  ``[B, K]`` array of their full blocks (``B`` rounded up to a power of two,
  so traces of similar size share a compiled program), digested in one
  pass, and chained per row. Padding a 10,000-request trace to 4,096 tokens
  each would digest about 2.5x the tokens it has.

  Args:
    sequences: ``R`` 1-D integer arrays of token ids (values must fit in
      int32).
    block_size: ``K``.
    max_blocks: ``M``; a sequence's blocks past ``M`` are cut.

  Returns:
    ``[R, M, 2]`` uint32 keys (a jax array), zero past each row's last full
    block.
  """
  k, m = int(block_size), int(max_blocks)
  if k < 1 or m < 1:
    raise ValueError(f"block_size={k} and max_blocks={m} must be >= 1")
  r = len(sequences)
  lens = np.fromiter((len(x) for x in sequences), np.int64, count=r)
  full = np.minimum(lens // k, m)
  rows = np.repeat(np.arange(r), full)
  cols = np.arange(rows.size) - np.repeat(np.cumsum(full) - full, full)
  size = 1 << max(int(rows.size) - 1, 0).bit_length()
  blocks = np.zeros((size, k), np.int32)
  if rows.size:  # the full blocks' tokens, row after row
    blocks[: rows.size] = np.concatenate(
      [np.asarray(x[: f * k]) for x, f in zip(sequences, full, strict=True)]
    ).reshape(-1, k)
  where = np.full((size,), r * m, np.int64)  # padding rows: dropped
  where[: rows.size] = rows * m + cols
  return _batch_keys(to_device(blocks), to_device(where, jnp.int32), r, m)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _batch_keys(blocks, where, r, m):
  digests = hash_words(blocks, SEED_TOKENS)  # [B, 2]
  table = jnp.zeros((r * m, 2), jnp.uint32).at[where].set(digests, mode="drop")
  valid = jnp.zeros((r * m,), jnp.bool_).at[where].set(True, mode="drop")
  extra = jnp.zeros((0,), jnp.uint32)
  keys = jax.vmap(lambda g: _chain(g, extra))(table.reshape(r, m, 2))
  return jnp.where(valid.reshape(r, m, 1), keys, jnp.uint32(0))


def int64_to_lanes(ids) -> np.ndarray:
  """Host side: int64 ids ``[...]`` -> ``[..., 2]`` uint32 ``(lo, hi)``.

  Example:
    >>> from prefixjax.cache import hashing
    >>> hashing.int64_to_lanes([2**32 + 5, -1]).tolist()
    [[5, 1], [4294967295, 4294967295]]
  """
  ids = np.asarray(ids, np.int64)
  as_u = ids.view(np.uint64) if ids.ndim else ids.reshape(1).view(np.uint64)
  lo = (as_u & np.uint64(0xFFFFFFFF)).astype(np.uint32)
  hi = (as_u >> np.uint64(32)).astype(np.uint32)
  return np.stack([lo, hi], axis=-1).reshape(ids.shape + (2,))


@jax.jit
def _chain_block_ids(ids, num_ids, extra):
  keys = _chain(hash_words(ids, SEED_IDS), extra)
  valid = jnp.arange(ids.shape[0]) < num_ids
  return jnp.where(valid[:, None], keys, jnp.uint32(0)), valid


def chain_block_ids(ids, num_ids=None, *, extra=None):
  """Chains pre-computed per-block ids (Mooncake ``hash_ids``) into keys.

  ``h_i = H(h_{i-1}, id_i)`` with ``extra`` entering the first block, so a
  key names the whole prefix even if a trace reuses an id in another
  context.

  Args:
    ids: ``[B]`` int32 ids (sign-extended to 64 bits) or ``[B, 2]`` uint32
      lanes from :func:`int64_to_lanes`.
    num_ids: int32 scalar, ids that are real (default all ``B``).
    extra: as in :func:`block_hashes`.

  Returns:
    ``(keys, valid)``: ``keys`` ``[B, 2]`` uint32, zero past ``num_ids``;
    ``valid`` ``[B]`` bool.

  Example:
    >>> from prefixjax.cache import hashing
    >>> lanes = hashing.int64_to_lanes([11, 2**40, 13])
    >>> keys, valid = hashing.chain_block_ids(lanes, 2)
    >>> valid.tolist()
    [True, True, False]
  """
  ids = jnp.asarray(ids)
  if ids.ndim == 1:
    if ids.dtype != jnp.int32:
      raise TypeError(f"1-D ids must be int32, got {ids.dtype}")
    lo = jax.lax.bitcast_convert_type(ids, jnp.uint32)
    hi = jnp.where(ids < 0, jnp.uint32(0xFFFFFFFF), jnp.uint32(0))
    ids = jnp.stack([lo, hi], axis=-1)
  elif ids.ndim != 2 or ids.shape[-1] != 2 or ids.dtype != jnp.uint32:
    raise ValueError(
      f"ids must be [B] int32 or [B, 2] uint32, got {ids.shape} {ids.dtype}"
    )
  if num_ids is None:
    num_ids = ids.shape[0]
  extra = _as_words(extra, "extra")
  return _chain_block_ids(ids, jnp.asarray(num_ids, jnp.int32), extra)


@jax.jit
def with_version(keys: jax.Array, version: jax.Array) -> jax.Array:
  """Mixes a uint32 ``version`` into keys ``[..., 2]`` -> ``[..., 2]``.

  Example:
    >>> import jax.numpy as jnp
    >>> from prefixjax.cache import hashing
    >>> k = jnp.zeros((3, 2), jnp.uint32)
    >>> hashing.with_version(k, jnp.uint32(1)).shape
    (3, 2)
  """
  version = jnp.broadcast_to(
    jnp.asarray(version).astype(jnp.uint32), keys.shape[:-1]
  )
  return hash_words(
    jnp.concatenate([keys, version[..., None]], axis=-1), SEED_VERSION
  )
