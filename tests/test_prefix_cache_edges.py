"""Edge cases of the prefix cache, each compared with the vLLM v1 oracle.

A :class:`Pair` drives the device cache (through the public verbs) and
:class:`reference_models.vllm_apc.VllmPrefixCache` side by side, several
sequences at once, and compares the whole block-level state after every
call.
"""

from __future__ import annotations

import chex
import hypothesis
import hypothesis.stateful
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from reference_models import vllm_apc

from prefixjax.cache import hashing, paging
from prefixjax.cache import prefix_cache as pc
from prefixjax.cache.checked import prefix_cache as checked

K = 4
M = 10
N = 16  # every test uses these shapes, so each verb compiles once
S = 4
OK = paging.Status.OK
BALLAST = S - 1


def _device_keys(tokens, salt):
  padded = np.zeros(M * K, np.int32)
  padded[: len(tokens)] = tokens
  keys, _ = hashing.block_hashes(
    jnp.asarray(padded), len(tokens), block_size=K, extra=[salt]
  )
  return keys


class Pair:
  """Device cache + oracle, driven together (request id = sequence id).

  ``capacity`` below ``N - 1`` is made by a ballast sequence
  (``BALLAST``) that holds the other blocks for the whole test.
  """

  def __init__(self, capacity=N - 1, free_order="append"):
    self.n = N
    self.state = pc.init(
      N, K, max_seqs=S, max_blocks_per_seq=M, free_order=free_order
    )
    self.oracle = vllm_apc.VllmPrefixCache(N, K, free_order=free_order)
    self.version = 0
    self.tokens: dict[int, list[int]] = {}
    self.salt: dict[int, int] = {}
    self.seq_version: dict[int, int] = {}
    self.to_device: dict = {}
    if capacity < N - 1:
      ballast = list(range(10_000, 10_000 + (N - 1 - capacity) * K))
      assert self.start(BALLAST, ballast) == 0

  def _map_keys(self, seq):
    toks = self.tokens[seq]
    vkeys = np.asarray(
      hashing.with_version(
        _device_keys(toks, self.salt[seq]),
        jnp.uint32(self.seq_version[seq]),
      )
    )
    for j, key in enumerate(self.oracle.block_keys(seq)):
      dkey = tuple(vkeys[j].tolist())
      assert self.to_device.setdefault(key, dkey) == dkey

  def start(self, seq, prompt, salt=0):
    """Match + allocate + publish the prompt; returns hit tokens or None."""
    prompt = [int(t) for t in prompt]
    keys = _device_keys(prompt, salt)
    self.oracle.add_request(seq, prompt, (salt, self.version))
    hit_blocks, hit = self.oracle.get_computed_blocks(seq)
    new = self.oracle.allocate_slots(seq, len(prompt) - hit, hit_blocks)
    before = self.state
    self.state, r = pc.allocate_with_prefix(self.state, seq, keys, len(prompt))
    if new is None:
      del self.oracle._requests[seq]
      assert int(r.status) == paging.Status.OUT_OF_BLOCKS
      chex.assert_trees_all_equal(self.state, before)
      self.compare()
      return None
    assert int(r.status) == OK
    assert int(r.hit_tokens) == hit
    assert r.hit_blocks[: len(hit_blocks)].tolist() == hit_blocks
    assert r.new_blocks[: len(new)].tolist() == new
    self.tokens[seq], self.salt[seq] = prompt, salt
    self.seq_version[seq] = self.version
    self.state, p = pc.publish(self.state, seq, keys, len(prompt))
    assert int(p.status) == OK
    self._map_keys(seq)
    self.compare()
    return hit

  def decode(self, seq, token):
    """One sampled token: its KV slot, then publish a block that filled."""
    self.oracle.append_tokens(seq, [int(token)])
    new = self.oracle.allocate_slots(seq, 1)
    assert new is not None
    self.state, r = pc.append(self.state, seq, 1)
    assert int(r.status) == OK
    assert r.new_blocks[: len(new)].tolist() == new
    self.tokens[seq].append(int(token))
    keys = _device_keys(self.tokens[seq], self.salt[seq])
    self.state, _ = pc.publish(self.state, seq, keys, len(self.tokens[seq]))
    self._map_keys(seq)
    self.compare()

  def release(self, seq):
    self.oracle.free(seq)
    self.state, r = pc.release(self.state, seq)
    assert int(r.status) == OK
    del self.tokens[seq]
    self.compare()

  def bump(self):
    self.state, v = pc.invalidate(self.state)
    self.version += 1
    assert int(v) == self.version

  def peek(self, prompt, salt=0):
    """Hit tokens of a prompt on both sides (no state change)."""
    keys = _device_keys(prompt, salt)
    got = pc.match(self.state, keys, len(prompt))
    in_order = pc.match_in_order(self.state, keys, len(prompt))
    for a, b in zip(got, in_order, strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _, want = self.oracle.peek_computed_blocks(
      [int(t) for t in prompt], extra=(salt, self.version)
    )
    assert int(got.hit_tokens) == want
    return want

  def compare(self):
    s, o = self.state, self.oracle
    o.check_invariants()
    assert paging.free_queue_order(s.paging) == o.free_queue_order()
    refs = np.asarray(s.paging.refcounts).tolist()
    assert refs == [o.refcount(b) for b in range(self.n)]
    tables = np.asarray(s.paging.block_tables)
    for seq in o.running_requests():
      blocks = o.request_blocks(seq)
      assert tables[seq, : len(blocks)].tolist() == blocks
    hashes = np.asarray(s.block_hash)
    for b in range(self.n):
      key = o.block_hash(b)
      want = (0, 0) if key is None else self.to_device[key]
      assert tuple(hashes[b].tolist()) == want, b
    assert pc.check_invariants(s) == []


def test_full_prompt_hit_is_capped_and_duplicates_the_last_block():
  pair = Pair(11)  # the ballast holds blocks 1-4
  prompt = list(range(12))  # exactly 3 full blocks
  assert pair.start(0, prompt) == 0  # blocks 5, 6, 7
  pair.release(0)
  # All 3 blocks cached, but the hit stops at prompt_len - 1 -> 2 blocks.
  assert pair.peek(prompt) == 8
  assert pair.peek(prompt + [0]) == 12
  assert pair.start(1, prompt) == 8
  # The recomputed last block (8) got the same key: the index still returns
  # the earlier block 7, block 8 waits behind it.
  longer = _device_keys(prompt + [0], 0)
  assert pair.oracle.cached_blocks()[pair.oracle.block_keys(1)[2]] == [7, 8]
  assert pc.match(pair.state, longer, 13).hit_blocks[:3].tolist() == [5, 6, 7]
  pair.release(1)
  # Reusing block 7 drops it from the key's list; block 8 takes over.
  assert pair.start(2, list(range(100, 132))) == 0  # pops 9..15 and 7
  assert pc.match(pair.state, longer, 13).hit_blocks[:3].tolist() == [5, 6, 8]
  assert pair.peek(prompt + [0]) == 12
  pair.release(2)


def test_prompt_shorter_than_a_block():
  pair = Pair(7)
  cached = pc.stats_dict(pair.state)["num_cached"]  # the ballast's
  for n in (1, 2, K - 1):
    assert pair.start(n - 1, list(range(n))) == 0
    assert pc.stats_dict(pair.state)["num_cached"] == cached
    pair.release(n - 1)
  # Exactly one block: still no hit (cap at prompt_len - 1).
  pair.start(0, [5, 6, 7, 8])
  pair.release(0)
  assert pair.peek([5, 6, 7, 8]) == 0
  assert pair.peek([5, 6, 7, 8, 9]) == 4


def test_hit_on_blocks_on_the_free_queue_unlinks_then_counts():
  pair = Pair()
  pair.start(0, list(range(20)))  # 5 blocks
  pair.start(1, list(range(50, 58)))  # 2 blocks, stay held
  pair.release(0)
  # The free queue holds 0's blocks tail-first, cached; hits come out of
  # the middle of the queue with refcount 1.
  assert pair.start(2, list(range(16)) + [99]) == 16
  refs = np.asarray(pair.state.paging.refcounts)
  assert (refs[np.asarray(pair.state.paging.block_tables[2, :4])] == 1).all()
  # A second concurrent hit on the same (now held) blocks: refcount 2.
  assert pair.start(3, list(range(12)) + [98]) == 12
  pair.release(2)
  pair.release(3)
  pair.release(1)


def test_eviction_of_a_block_another_request_is_about_to_touch():
  pair = Pair(6)
  prompt = list(range(17))  # 5 blocks, 4 full
  pair.start(0, prompt)
  pair.release(0)
  assert pair.peek(prompt) == 16
  # Another request pops blocks from the head, which holds the deepest
  # cached blocks of ``prompt`` (tail-first release): their identities go.
  pair.start(1, list(range(100, 113)))  # 4 blocks
  stats = pc.stats_dict(pair.state)
  assert stats["evictions"] == 2
  # The waiting request now hits only what is left.
  assert pair.peek(prompt) == 8
  assert pair.start(2, prompt) is None  # 2 hits + 3 new > 3 free: refused
  pair.release(1)
  assert pair.start(2, prompt) == 8


def test_out_of_blocks_counts_touched_hits_in_the_budget():
  pair = Pair(8)  # the ballast holds blocks 1-7
  pair.start(0, list(range(12)) + [1])  # blocks 8-11, 8-10 cached
  pair.release(0)  # queue: 12, 13, 14, 15, 11, 10, 9, 8
  pair.start(1, list(range(200, 216)))  # takes 12-15
  longer = list(range(12)) + [1, 2, 3, 4, 5, 6, 7]  # 19 tokens, 5 blocks
  assert pair.peek(longer) == 12
  # 3 hits at refcount 0 + 2 new = 5 > 4 free, although 2 new <= 4 free.
  assert pair.start(2, longer) is None
  # 3 hits + 1 new = 4 fits exactly.
  assert pair.start(2, list(range(12)) + [1, 2, 3]) == 12
  assert pair.oracle.num_free == 0
  pair.release(2)
  pair.release(1)


def test_version_bump_mid_run_makes_earlier_blocks_unmatchable():
  pair = Pair()
  prompt = list(range(17))
  pair.start(0, prompt)
  pair.start(1, prompt)  # concurrent: shares 4 blocks
  pair.bump()
  # Running sequences keep their blocks; nothing matches any more.
  assert pair.peek(prompt) == 0
  pair.release(0)
  pair.release(1)
  assert pair.peek(prompt) == 0
  cached_before = pc.stats_dict(pair.state)["num_cached"]
  assert cached_before == 4  # still on the free queue, old identity
  assert pair.start(2, prompt) == 0
  pair.release(2)
  assert pair.peek(prompt) == 16
  # Reuse of the old-version blocks evicts their identities.
  pair.start(3, list(range(300, 332)))
  assert pc.stats_dict(pair.state)["evictions"] >= 1
  pair.release(3)


def test_same_tokens_with_different_salt_never_share():
  pair = Pair()
  prompt = list(range(13))
  pair.start(0, prompt, salt=1)
  pair.release(0)
  assert pair.peek(prompt, salt=2) == 0
  assert pair.peek(prompt, salt=1) == 12
  assert pair.start(1, prompt, salt=2) == 0
  pair.release(1)
  assert pair.start(2, prompt, salt=1) == 12
  assert pair.start(3, prompt, salt=2) == 12
  pair.release(2)
  pair.release(3)


def test_decode_publishes_filled_blocks_and_outputs_are_hit_later(rng):
  pair = Pair()
  pair.start(0, list(range(6)))
  outs = rng.integers(0, 9, size=9).tolist()
  for tok in outs:
    pair.decode(0, tok)
  pair.release(0)
  # Next chat turn: prompt + all outputs but the last (it never got KV).
  turn = list(range(6)) + outs + [3, 3]
  assert pair.start(1, turn) == 12
  pair.release(1)


@pytest.mark.parametrize("free_order", pc.FREE_ORDERS)
def test_random_concurrent_operations_match_oracle(rng, free_order):
  pair = Pair(12, free_order)
  prefixes = [rng.integers(0, 4, size=10).tolist() for _ in range(2)]
  for _ in range(300):
    running = [s for s in pair.tokens if s != BALLAST]
    free = [s for s in range(S - 1) if s not in pair.tokens]
    roll = rng.random()
    if free and roll < 0.4:
      base = prefixes[int(rng.integers(2))]
      prompt = (
        base[: int(rng.integers(1, 11))]
        + rng.integers(0, 4, size=int(rng.integers(0, 8))).tolist()
      )
      pair.start(free[0], prompt or [1], salt=int(rng.random() < 0.2))
    elif running and roll < 0.75:
      seq = running[int(rng.integers(len(running)))]
      if len(pair.tokens[seq]) < M * K and pair.oracle.num_free > 0:
        pair.decode(seq, int(rng.integers(0, 4)))
    elif running and roll < 0.98:
      pair.release(running[int(rng.integers(len(running)))])
    else:
      pair.bump()


def test_stats_count_hits_misses_evictions_and_pins():
  s = pc.init(N, K, max_seqs=S, max_blocks_per_seq=M)
  prompt = np.arange(13, dtype=np.int32)
  keys = _device_keys(prompt, 0)
  s, _ = pc.allocate_with_prefix(s, 0, keys, 13)
  s, _ = pc.publish(s, 0, keys, 13)
  st = pc.stats_dict(s)
  assert st["miss_blocks"] == 4 and st["miss_tokens"] == 13
  assert st["num_cached"] == 3 and st["pinned_blocks"] == 4
  assert st["cached_pinned"] == 3 and st["num_cached_free"] == 0
  s, _ = pc.release(s, 0)
  st = pc.stats_dict(s)
  assert st["pinned_blocks"] == 0 and st["num_cached_free"] == 3
  s, r = pc.allocate_with_prefix(s, 1, keys, 13)
  st = pc.stats_dict(s)
  assert int(r.hit_tokens) == 12
  assert st["hit_blocks"] == 3 and st["hit_tokens"] == 12
  assert st["miss_tokens"] == 14 and st["requests"] == 2
  # The fresh block came from the head of the queue: block 5 (never used),
  # so no eviction yet. Queue now: 6..15, 4, 5, 3, 2, 1.
  assert st["evictions"] == 0
  s, _ = pc.release(s, 1)
  for seq, n in ((0, 32), (1, 28)):
    other = _device_keys(np.arange(100 * seq, 100 * seq + n, dtype=np.int32), 9)
    s, r = pc.allocate_with_prefix(s, seq, other, n)
    assert int(r.status) == OK
  # The second took 14, 15, 4, 5, 3, 2, 1: three cached identities dropped.
  assert int(r.num_evicted) == 3 == pc.stats_dict(s)["evictions"]
  assert pc.stats_dict(s)["num_cached"] == 0
  assert pc.check_invariants(s) == []


def test_fork_and_copy_on_write_evict_popped_identities():
  # The block ids below follow vLLM 0.22's release order (all at the tail).
  s = pc.init(N, K, max_seqs=S, max_blocks_per_seq=M, vllm_version="0.22")
  a = _device_keys(np.arange(13, dtype=np.int32), 0)
  s, _ = pc.allocate_with_prefix(s, 0, a, 13)  # blocks 1-4, 1-3 cached
  s, _ = pc.publish(s, 0, a, 13)
  s, _ = pc.release(s, 0)  # queue: 5..15, 4, 3, 2, 1
  b = _device_keys(np.arange(100, 140, dtype=np.int32), 0)
  s, _ = pc.allocate_with_prefix(s, 1, b, 40)  # 5..14
  s, _ = pc.allocate_with_prefix(s, 2, b, 3)  # 15, partially filled
  s, _ = pc.allocate_with_prefix(s, 0, b, 1)  # 4; queue: 3, 2, 1 (cached)
  s, status = pc.fork(s, 2, 3)
  assert int(status) == OK and int(s.paging.refcounts[15]) == 2
  assert int(s.seq_version[3]) == int(s.seq_version[2])
  s, r = pc.copy_on_write(s, 3)  # pops block 3: its identity goes
  assert (int(r.src[0]), int(r.dst[0])) == (15, 3)
  assert pc.stats_dict(s)["evictions"] == 1
  assert int(pc.num_pinned(s)) == N - 1 - 2
  assert int(pc.match(s, a, 13).num_hit_blocks) == 2
  assert pc.check_invariants(s) == []


def test_a_64_bit_key_collision_is_a_false_hit_never_a_corruption():
  """Different contents under one key (forced): the documented failure
  mode is a false hit; the state stays consistent."""
  s = pc.init(N, K, max_seqs=S, max_blocks_per_seq=M)
  keys = jnp.asarray(np.tile(np.asarray([[7, 9]], np.uint32), (M, 1)))
  keys = keys.at[:, 1].add(jnp.arange(M, dtype=jnp.uint32))
  s, _ = pc.allocate_with_prefix(s, 0, keys, 9)  # "content A"
  s, _ = pc.publish(s, 0, keys, 9)
  s, r = pc.allocate_with_prefix(s, 1, keys, 9)  # "content B", same keys
  assert int(r.hit_tokens) == 8  # the false hit
  s, _ = pc.publish(s, 1, keys, 9)
  s, _ = pc.release(s, 0)
  s, _ = pc.release(s, 1)
  assert pc.check_invariants(s) == []


@pytest.mark.parametrize(
  "vllm_version, free_order",
  [
    (None, "prepend_unhashed"),
    ("0.33", "prepend_unhashed"),
    ("0.22", "append"),
  ],
)
def test_mooncake_hash_ids_match_the_oracle(rng, vllm_version, free_order):
  """Trace ids chained on the device equal the oracle's id keys when ids
  name prefixes (as Mooncake's do); the free queue follows the release
  order of the vLLM version (default 0.33's)."""
  state = pc.init(
    N, K, max_seqs=S, max_blocks_per_seq=M, vllm_version=vllm_version
  )
  assert state.free_order == free_order
  oracle = vllm_apc.VllmPrefixCache(N, K, free_order=free_order)
  intern: dict = {}
  for _ in range(60):
    prompt = rng.integers(0, 3, size=int(rng.integers(1, 30))).tolist()
    full = len(prompt) // K
    ids = [
      intern.setdefault(tuple(prompt[: (i + 1) * K]), 2**40 + len(intern))
      for i in range(full)
    ]
    want = oracle.run_request_hashed(ids, len(prompt), 1)
    lanes = np.zeros((M, 2), np.uint32)
    lanes[:full] = hashing.int64_to_lanes(ids).reshape(-1, 2)
    keys, _ = hashing.chain_block_ids(lanes, full)
    state, r = pc.allocate_with_prefix(state, 0, keys, len(prompt))
    assert int(r.hit_tokens) == want
    state, _ = pc.publish(state, 0, keys, len(prompt))
    state, _ = pc.release(state, 0)
    assert paging.free_queue_order(state.paging) == oracle.free_queue_order()
  assert pc.check_invariants(state) == []


def test_each_verb_compiles_once(rng):
  s = pc.init(N, K, max_seqs=S, max_blocks_per_seq=M)
  traced_match = jax.jit(chex.assert_max_traces(checked.match, n=1))
  verbs = [
    pc.allocate_with_prefix,
    pc.publish,
    pc.append,
    pc.release,
    pc.invalidate,
    pc.match,
  ]
  before = [v._cache_size() for v in verbs]
  for i in range(6):
    n = int(rng.integers(1, 20))
    toks = rng.integers(0, 3, size=M * K).astype(np.int32)
    keys, _ = hashing.block_hashes(jnp.asarray(toks), n, block_size=K)
    seq = [0, np.int32(1), np.int64(2)][i % 3]
    s, _ = checked.allocate_with_prefix(s, seq, keys, n)
    # Fewer rows than M (but a key for every full block): padded to [M, 2].
    rows = max(3 + i % 2, n // K)
    s, _ = checked.publish(s, seq, keys[:rows], n)
    s, _ = checked.append(s, seq, 3)
    traced_match(s, keys, jnp.int32(n))
    s, _ = checked.release(s, seq)
    s, _ = checked.invalidate(s)
  after = [v._cache_size() for v in verbs]
  assert all(a - b <= 1 for a, b in zip(after, before, strict=True))
  assert pc.check_invariants(s) == []


def test_vmap_over_caches_equals_loop(rng):
  states, keys, lens = [], [], []
  for i in range(3):
    s = pc.init(N, K, max_seqs=S, max_blocks_per_seq=M)
    toks = rng.integers(0, 3, size=M * K).astype(np.int32)
    k, _ = hashing.block_hashes(jnp.asarray(toks), 16, block_size=K)
    s, _ = pc.allocate_with_prefix(s, 0, k, 16)
    s, _ = pc.publish(s, 0, k, 16)
    s, _ = pc.release(s, 0)
    if i == 1:
      s, _ = pc.invalidate(s)
    states.append(s)
    keys.append(k)
    lens.append(13 + i)
  batch = jax.tree.map(lambda *x: jnp.stack(x), *states)
  seqs = jnp.zeros(3, jnp.int32)
  out, res = jax.vmap(pc.allocate_with_prefix)(
    batch, seqs, jnp.stack(keys), jnp.asarray(lens, jnp.int32)
  )
  for i in range(3):
    want_s, want_r = pc.allocate_with_prefix(states[i], 0, keys[i], lens[i])
    chex.assert_trees_all_equal(jax.tree.map(lambda x, i=i: x[i], out), want_s)
    chex.assert_trees_all_equal(jax.tree.map(lambda x, i=i: x[i], res), want_r)
  assert res.hit_tokens.tolist() == [12, 0, 12]


def test_boundary_errors():
  s = pc.init(N, K, max_seqs=S, max_blocks_per_seq=M)
  with pytest.raises(ValueError, match=r"block_keys must be uint32 of shape"):
    checked.match(s, jnp.zeros((3, 2), jnp.int32), 4)
  with pytest.raises(TypeError, match="state must be a PrefixCacheState"):
    checked.release(s.paging, 0)
  with pytest.raises(ValueError, match="num_prompt_tokens=-1 must be >= 0"):
    checked.allocate_with_prefix(s, 0, jnp.zeros((2, 2), jnp.uint32), -1)
  with pytest.raises(ValueError, match=r"max_load=0.9 must be in"):
    pc.init(N, K, max_seqs=S, max_blocks_per_seq=M, index_load=0.9)
  with pytest.raises(ValueError, match="capacity=16 too small"):
    pc.init(N, K, max_seqs=S, max_blocks_per_seq=M, index_capacity=16)


def _prompt_keys(rng, num_tokens):
  tokens = jnp.asarray(rng.integers(0, 50, size=M * K), jnp.int32)
  keys, _ = hashing.block_hashes(tokens, num_tokens, block_size=K)
  return keys


def test_missing_keys_are_refused_never_padded(rng):
  """Found by a new user: 2 or 0 keys for 3 full blocks used to be padded
  with (0, 0) keys, published, and later "hit" by all-(0, 0) prompts."""
  s = pc.init(N, K, max_seqs=S, max_blocks_per_seq=M)
  full = int(rng.integers(2, M))  # room for a partial block after them
  num_tokens = full * K + int(rng.integers(0, K))
  keys = _prompt_keys(rng, num_tokens)
  short = keys[: int(rng.integers(0, full))]
  for count in (num_tokens, np.int32(num_tokens), jnp.int32(num_tokens)):
    for verb, args in (  # a jax scalar count was not checked
      (checked.match, (s, short, count)),
      (checked.allocate_with_prefix, (s, 0, short, count)),
    ):
      with pytest.raises(ValueError, match=f"{full} full blocks of {K} tok"):
        verb(*args)
  # uint64 keys would be cut to uint32 by the cast (x64 off): refused.
  with pytest.raises(ValueError, match="must be uint32 of shape"):
    checked.match(s, np.asarray(keys, np.uint64) + 2**32, num_tokens)
  s, r = checked.allocate_with_prefix(s, 0, keys, num_tokens)
  assert int(r.status) == paging.Status.OK
  with pytest.raises(ValueError, match=f"has {full} full blocks"):
    checked.publish(s, 0, short, num_tokens)
  with pytest.raises(ValueError, match=f"has {full} full blocks"):
    checked.publish(s, jnp.int32(0), short, jnp.int32(num_tokens))
  with pytest.raises(ValueError, match="only blocks it holds"):
    checked.publish(s, jnp.int32(0), keys, jnp.int32(num_tokens + K))
  s, r = checked.publish(s, 0, keys, num_tokens)
  assert int(r.status) == paging.Status.OK
  zeros = jnp.zeros((M, 2), jnp.uint32)
  assert int(checked.match(s, zeros, M * K).hit_tokens) == 0
  # The traced verbs take [M, 2] keys only: a shape error names them.
  for verb, args in (
    (pc.match, (s, short, num_tokens)),
    (pc.allocate_with_prefix, (s, jnp.int32(1), short, num_tokens)),
    (pc.publish, (s, jnp.int32(0), short, num_tokens)),
  ):
    with pytest.raises(
      ValueError, match=rf"block_keys has shape \({len(short)}, 2\)"
    ):
      jax.jit(verb)(*args)


def test_publishing_more_tokens_than_held_is_an_error(rng):
  s = pc.init(N, K, max_seqs=S, max_blocks_per_seq=M)
  held = int(rng.integers(1, M * K - K))
  keys = _prompt_keys(rng, M * K)
  s, _ = checked.allocate_with_prefix(s, 0, keys, held)
  too_many = int(rng.integers(held + 1, M * K + 1))
  with pytest.raises(ValueError, match=f"num_tokens={too_many} but sequence"):
    checked.publish(s, 0, keys, too_many)
  # Inside jit it is a status, and nothing is published.
  new, r = pc.publish(s, jnp.int32(0), keys, jnp.int32(too_many))
  assert int(r.status) == paging.Status.BAD_COUNT
  assert int(new.stats.num_cached) == int(s.stats.num_cached)
  assert pc.check_invariants(new) == []


def test_batch_view_refuses_sequence_ids_out_of_range(rng):
  from prefixjax.cache.checked import paging as checked_paging

  s = paging.init(num_blocks=8, block_size=4, max_seqs=3, max_blocks_per_seq=2)
  bad = int(rng.choice([-1, 3, 4, 100]))
  with pytest.raises(ValueError, match=rf"seq_ids\[1\]={bad} is outside"):
    checked_paging.batch_view(s, jnp.array([0, bad], jnp.int32))
  view = checked_paging.batch_view(s, jnp.array([2, 0], jnp.int32))
  assert view.lengths.tolist() == [0, 0]


class PrefixCacheMachine(hypothesis.stateful.RuleBasedStateMachine):
  """Hypothesis drives starts, decodes, releases, peeks and version bumps on
  a small pool (capacity 9 blocks, 3 sequences); :class:`Pair` compares the
  whole state with the oracle after every call."""

  def __init__(self):
    super().__init__()
    self.pair = Pair(9)
    self.prefixes = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 7, 7, 7]]

  def _prompt(self, data):
    base = self.prefixes[data.draw(st.integers(0, 1))]
    cut = data.draw(st.integers(0, len(base)))
    suffix = data.draw(st.lists(st.integers(0, 3), max_size=10))
    return (base[:cut] + suffix) or [0]

  def running(self):
    return [s for s in self.pair.tokens if s != BALLAST]

  @hypothesis.stateful.precondition(lambda self: len(self.running()) < S - 1)
  @hypothesis.stateful.rule(data=st.data())
  def start(self, data):
    seq = min(s for s in range(S - 1) if s not in self.pair.tokens)
    salt = data.draw(st.sampled_from([0, 0, 0, 1]))
    self.pair.start(seq, self._prompt(data), salt=salt)

  @hypothesis.stateful.precondition(lambda self: self.running())
  @hypothesis.stateful.rule(data=st.data())
  def decode(self, data):
    seq = data.draw(st.sampled_from(self.running()))
    if len(self.pair.tokens[seq]) < M * K and self.pair.oracle.num_free > 0:
      self.pair.decode(seq, data.draw(st.integers(0, 3)))

  @hypothesis.stateful.precondition(lambda self: self.running())
  @hypothesis.stateful.rule(data=st.data())
  def release(self, data):
    self.pair.release(data.draw(st.sampled_from(self.running())))

  @hypothesis.stateful.rule(data=st.data())
  def peek_or_bump(self, data):
    # One rule for both keeps them rarer than starts and releases.
    roll = data.draw(st.integers(0, 9))
    if roll < 3:
      self.pair.peek(self._prompt(data), salt=data.draw(st.integers(0, 1)))
    elif roll == 3:
      self.pair.bump()


PrefixCacheMachine.TestCase.settings = hypothesis.settings(
  max_examples=30, stateful_step_count=40, deadline=None
)
test_hypothesis_operation_sequences = PrefixCacheMachine.TestCase
