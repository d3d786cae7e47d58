"""Tests of the plain-Python oracles in ``tests/reference_models``.

Hand-worked scenarios pin the vLLM and SGLang rules the models claim (see
their module docstrings); property tests check the models' own invariants on
random workloads with heavy sharing and eviction pressure.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_models.sglang_radix import (
  OutOfPages,
  SglangRadixCache,
  page_keys_for_tokens,
)
from reference_models.vllm_apc import (
  OutOfBlocks,
  VllmPrefixCache,
  block_keys_for_tokens,
)

FREE_ORDERS = ("prepend_unhashed", "append")


def seq(start: int, n: int) -> list[int]:
  return list(range(start, start + n))


def ideal_hit(history: list[list[int]], prompt: list[int], bs: int) -> int:
  """Hit tokens with an unbounded cache: longest cached full-block prefix of
  ``prompt[:-1]`` among the blocks of earlier sequences (prompt + output - 1
  tokens each)."""
  best = 0
  for tokens in history:
    n = 0
    limit = min(len(tokens), len(prompt) - 1) // bs * bs
    while n < limit and tokens[n] == prompt[n]:
      n += 1
    best = max(best, n // bs * bs)
  return best


# ---------------------------------------------------------------- vLLM model
def test_vllm_init_pops_null_block():
  c = VllmPrefixCache(6, 4)
  assert c.free_queue_order() == [1, 2, 3, 4, 5]
  assert c.num_free == c.capacity == 5
  assert VllmPrefixCache.from_capacity(5, 4).free_queue_order() == seq(1, 5)
  c.check_invariants()


@pytest.mark.parametrize("free_order", FREE_ORDERS)
def test_vllm_tail_first_release_all_hashed(free_order):
  c = VllmPrefixCache.from_capacity(6, 4, free_order)
  # P + O - 1 = 12 tokens: three full blocks, all published.
  assert c.run_request(seq(0, 10), [100, 101, 102]) == 0
  assert [c.block_hash(b) is not None for b in (1, 2, 3)] == [True] * 3
  assert c.free_queue_order() == [4, 5, 6, 3, 2, 1]
  c.check_invariants()


def test_vllm_release_order_of_unhashed_tail_block():
  # P = 9, O = 1: blocks 1, 2 full and published, block 3 partial.
  old = VllmPrefixCache.from_capacity(6, 4, "append")
  old.run_request(seq(0, 9), [7])
  assert old.free_queue_order() == [4, 5, 6, 3, 2, 1]
  new = VllmPrefixCache.from_capacity(6, 4, "prepend_unhashed")
  new.run_request(seq(0, 9), [7])
  assert new.block_hash(3) is None
  assert new.free_queue_order() == [3, 4, 5, 6, 2, 1]


def test_vllm_free_order_as_upstream_test_prefill():
  """vLLM 0.33 tests/v1/core/test_prefix_caching.py::test_prefill, replayed:
  partial blocks are prepended (newest first), the shared chain appended."""
  c = VllmPrefixCache(11, 16)
  common = [i for i in range(3) for _ in range(16)]
  c.add_request("0", common + [3] * 7)
  assert c.allocate_slots("0", 55) == [1, 2, 3, 4]
  c.add_request("1", common + [3] * 5)
  blocks, hit = c.get_computed_blocks("1")
  assert (blocks, hit) == ([1, 2, 3], 48)
  assert c.allocate_slots("1", 5, blocks) == [5]
  assert c.num_free == 5
  c.free("0")
  c.free("1")
  assert c.free_queue_order() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
  c.add_request("2", common + [3] * 6)
  blocks, hit = c.get_computed_blocks("2")
  assert c.allocate_slots("2", 5, blocks) == [5]
  c.free("2")
  c.add_request("3", [99] * 160)
  assert c.get_computed_blocks("3") == ([], 0)
  assert c.allocate_slots("3", 160) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
  assert c.num_free == 0
  c.check_invariants()


def test_vllm_free_order_changes_hit_tokens():
  hits = {}
  for order in FREE_ORDERS:
    c = VllmPrefixCache.from_capacity(3, 2, order)
    c.run_request([1, 1, 1], [0])  # block 1 hashed, block 2 partial
    c.run_request([7], [0])  # one block: 3 (append) or 2 (prepend)
    c.run_request([9, 9, 9], [0])  # two blocks: does block 1 survive?
    hits[order] = c.run_request([1, 1, 1], [0])
  assert hits == {"append": 0, "prepend_unhashed": 2}


def test_vllm_output_tokens_fill_and_publish_blocks():
  c = VllmPrefixCache.from_capacity(8, 4)
  # P = 6, O = 7: 12 tokens get KV -> 3 published blocks; the 13th has none.
  c.run_request(seq(0, 6), seq(50, 7))
  assert c.num_cached_blocks() == 3
  full = seq(0, 6) + seq(50, 7)
  assert c.run_request(full + [1], [2]) == 12
  assert c.run_request(full, [2]) == 12  # cap (13 - 1) // 4 = 3 blocks


def test_vllm_identity_eviction_on_reuse():
  c = VllmPrefixCache.from_capacity(3, 4, "append")
  a = seq(0, 12)
  c.run_request(a, [1])  # blocks 1, 2, 3 published; queue [3, 2, 1]
  keys = block_keys_for_tokens(a, 4)
  assert c.free_queue_order() == [3, 2, 1]
  c.run_request(seq(500, 5), [1])  # pops 3 then 2, dropping their hashes
  assert c.lookup(keys[0]) == 1
  assert c.lookup(keys[1]) is None and c.lookup(keys[2]) is None
  assert c.cached_blocks()[keys[0]] == [1]
  assert c.run_request(a, [1]) == 4
  c.check_invariants()


def test_vllm_full_prompt_hit_capped_and_duplicate_hash():
  c = VllmPrefixCache.from_capacity(8, 4, "append")
  p = seq(0, 8)
  assert c.run_request(p, [9]) == 0  # blocks 1, 2
  assert c.run_request(p, [9]) == 4  # not 8: the last token is recomputed
  key2 = block_keys_for_tokens(p, 4)[1]
  # The recomputed second block is published again: one hash, two blocks.
  assert c.cached_blocks()[key2] == [2, 3]
  assert c.lookup(key2) == 2  # earliest inserted
  assert c.run_request(p + [9], [1]) == 8
  c.check_invariants()


def test_vllm_duplicate_keeps_hash_findable_after_one_copy_goes():
  c = VllmPrefixCache.from_capacity(3, 4, "append")
  p = seq(0, 8)
  c.run_request(p, [9])  # blocks 1, 2; queue [3, 2, 1]
  c.run_request(p, [9])  # hit 1, new 3 (duplicate of 2); queue [2, 3, 1]
  assert c.free_queue_order() == [2, 3, 1]
  key2 = block_keys_for_tokens(p, 4)[1]
  c.run_request(seq(100, 3), [1])  # pops block 2: its copy 3 remains
  assert c.cached_blocks()[key2] == [3]
  assert c.run_request(p + [9], [1]) == 8


def test_vllm_prompt_shorter_than_a_block():
  c = VllmPrefixCache.from_capacity(4, 4)
  assert c.run_request([1, 2, 3], [4]) == 0
  assert c.num_cached_blocks() == 0
  assert c.run_request([1, 2, 3], [4, 5]) == 0  # 4 tokens get KV
  assert c.num_cached_blocks() == 1
  assert c.run_request([1, 2, 3, 4, 9], [1]) == 4
  assert c.run_request([1, 2, 3, 4], [1]) == 0  # capped at 3 tokens


def test_vllm_touch_block_on_free_queue():
  c = VllmPrefixCache.from_capacity(6, 4, "append")
  c.run_request(seq(0, 8), [1])  # queue [3, 4, 5, 6, 2, 1]
  c.add_request("b", seq(0, 8) + [77])
  hit_blocks, hit = c.get_computed_blocks("b")
  assert (hit_blocks, hit) == ([1, 2], 8)
  new = c.allocate_slots("b", 1, hit_blocks)
  assert new == [3]
  assert c.free_queue_order() == [4, 5, 6]
  assert [c.refcount(b) for b in (1, 2, 3)] == [1, 1, 1]
  c.check_invariants()
  c.free("b")
  assert c.free_queue_order() == [4, 5, 6, 3, 2, 1]
  c.check_invariants()


def test_vllm_concurrent_requests_share_and_duplicate():
  c = VllmPrefixCache.from_capacity(8, 4, "append")
  p = seq(0, 9)
  for rid in ("a", "b"):
    c.add_request(rid, p)
    blocks, hit = c.get_computed_blocks(rid)
    assert (blocks, hit) == ([], 0)  # a has not been allocated yet
  assert c.allocate_slots("a", 9) == [1, 2, 3]
  # b looked up before a published; it computes the same blocks again.
  assert c.allocate_slots("b", 9) == [4, 5, 6]
  keys = c.block_keys("a")
  assert keys == c.block_keys("b")
  assert c.cached_blocks()[keys[0]] == [1, 4]
  c.add_request("c", p)
  blocks, hit = c.get_computed_blocks("c")
  assert (blocks, hit) == ([1, 2], 8)
  assert c.allocate_slots("c", 1, blocks) == [7]
  assert [c.refcount(b) for b in range(1, 9)] == [2, 2, 1, 1, 1, 1, 1, 0]
  c.check_invariants()
  c.free("a")
  assert c.free_queue_order() == [8, 3]
  c.free("c")
  c.free("b")
  c.check_invariants()
  assert c.num_free == c.capacity


def test_vllm_allocation_failure_is_a_status():
  c = VllmPrefixCache.from_capacity(3, 4)
  c.add_request("big", seq(0, 13))
  assert c.allocate_slots("big", 13) is None
  assert c.free_queue_order() == [1, 2, 3]
  c.free("big")
  c.run_request(seq(0, 8), [1])
  before = (c.free_queue_order(), c.cached_blocks())
  with pytest.raises(OutOfBlocks):
    c.run_request(seq(0, 12), [1, 2])  # 13 tokens need 4 blocks
  assert (c.free_queue_order(), c.cached_blocks()) == before
  # A touch of free hit blocks counts against the free blocks too.
  c.add_request("x", seq(0, 8) + [5, 6, 7, 8, 9])
  blocks, hit = c.get_computed_blocks("x")
  assert hit == 8
  assert c.allocate_slots("x", 5, blocks) is None  # 2 touches + 2 new > 3
  c.check_invariants()


def test_vllm_extra_isolates_equal_tokens():
  c = VllmPrefixCache.from_capacity(8, 4)
  p = seq(0, 9)
  c.run_request(p, [1], extra="salt-a")
  assert c.run_request(p, [1], extra="salt-b") == 0
  assert c.run_request(p, [1]) == 0
  assert c.run_request(p, [1], extra="salt-a") == 8


def test_vllm_hashed_blocks_and_fresh_output_ids():
  c = VllmPrefixCache.from_capacity(16, 4)
  assert c.run_request_hashed(["a", "b", "c"], 10, 5) == 0
  assert c.run_request_hashed(["a", "b", "c"], 10, 1) == 8
  # "c" named a partial block: it was never published as a full block.
  assert c.run_request_hashed(["a", "b", "c", "d"], 16, 1) == 8
  assert c.run_request_hashed(["a", "x"], 8, 1, extra="s") == 0
  # With ids for every full block, output-filled blocks can hit.
  c.run_request_hashed(["p"], 3, 6, all_hashes=["p", "q"])
  assert c.run_request_hashed(["p", "q", "r"], 9, 1) == 8
  c.check_invariants()


def _requests_on_shared_prefixes(rng, count=40):
  """``count`` ``(prompt, output)`` token lists: a cut of one of three shared
  prefixes plus a short tail, so requests share and diverge anywhere."""
  prefixes = [list(rng.integers(0, 50, size=int(n))) for n in (4, 7, 10)]
  for _ in range(count):
    p = prefixes[int(rng.integers(3))][: int(rng.integers(1, 11))]
    p = p + list(rng.integers(0, 3, size=int(rng.integers(0, 4))))
    yield p, list(rng.integers(0, 3, size=int(rng.integers(0, 6))))


def test_vllm_hashed_matches_token_mode_given_token_keys(rng):
  bs = 3
  tok = VllmPrefixCache.from_capacity(9, bs, "append")
  hsh = VllmPrefixCache.from_capacity(9, bs, "append")
  for p, out in _requests_on_shared_prefixes(rng):
    if not tok.fits(len(p), len(out)):
      continue
    keys = block_keys_for_tokens(p + out, bs)
    got = hsh.run_request_hashed(keys, len(p), len(out), all_hashes=keys)
    assert got == tok.run_request(p, out)
    assert hsh.free_queue_order() == tok.free_queue_order()


# -------------------------------------------------------------- SGLang model
def test_sglang_leaf_only_lru_evicts_child_before_older_parent():
  c = SglangRadixCache(10, 2)
  x, y, z = [(None, (1, 1))], [(None, (2, 2))], [(None, (3, 3))]
  c.insert(x + y)  # one node XY
  c.insert(x + z)  # split: X (new, later) -> Y (refreshed), Z (newest)
  by_pages = {n.pages: n for n in c.nodes()}
  tx, ty, tz = (by_pages[tuple(k)].last_access for k in (x, y, z))
  assert ty < tx < tz
  assert c.evict(1) == 1
  assert sorted(n.pages for n in c.nodes()) == sorted([tuple(x), tuple(z)])
  assert c.evict(1) == 1  # Z, though its parent X is older
  assert [n.pages for n in c.nodes()] == [tuple(x)]
  assert c.evict(1) == 1 and c.nodes() == []
  assert c.num_free_pages == 10
  c.check_invariants()


def test_sglang_locked_path_is_not_evicted():
  c = SglangRadixCache(10, 2)
  keys = page_keys_for_tokens(seq(0, 6), 2)
  c.insert(keys)
  c.insert(page_keys_for_tokens(seq(50, 4), 2))
  n, node = c.match_prefix(keys[:2])  # splits the 3-page node
  assert n == 2
  c.inc_lock_ref(node)
  assert c.protected_size() == 4 and c.evictable_size() == 6
  assert c.evict(10) == 3  # the tail page and the other branch only
  assert c.cached_pages() == 2
  c.dec_lock_ref(node)
  assert c.protected_size() == 0 and c.evictable_size() == 4
  c.check_invariants()


def test_sglang_full_prompt_hit_capped_and_duplicates_freed():
  c = SglangRadixCache(8, 4)
  p = seq(0, 8)
  assert c.run_request(p, [9]) == 0
  assert c.cached_pages() == 2
  assert c.run_request(p, [9]) == 4  # capped at 7 tokens
  assert c.cached_pages() == 2  # the recomputed page was a duplicate
  assert c.num_free_pages == 6
  assert c.run_request(p + [9], [1]) == 8
  c.check_invariants()


def test_sglang_prompt_shorter_than_a_page_and_salts():
  c = SglangRadixCache(8, 4)
  assert c.run_request([1, 2, 3], [4]) == 0
  assert c.cached_pages() == 0
  assert c.run_request([1, 2, 3], [4, 5]) == 0
  assert c.cached_pages() == 1
  assert c.run_request([1, 2, 3, 4, 9], [1]) == 4
  assert c.run_request([1, 2, 3, 4, 9], [1], extra="lora-1") == 0
  assert c.run_request([1, 2, 3, 4, 9], [1], extra="lora-1") == 4


def test_sglang_node_eviction_overshoots_page_eviction_does_not():
  runs = {}
  for gran in ("node", "page"):
    c = SglangRadixCache(6, 2, granularity=gran)
    c.run_request(seq(0, 8), [1])  # 4 cached pages; 2 free
    # Needs 2 pages, eviction demand (3 - 0) + 2 = 5 tokens, 4 free: one
    # more token -> node: the whole 4-page node; page: one leaf page.
    assert c.run_request(seq(100, 3), [1]) == 0
    runs[gran] = c.cached_pages()
    c.check_invariants()
  assert runs == {"node": 1, "page": 4}


def test_sglang_decode_evicts_whenever_no_page_is_free():
  for conservative, cached, hit_a in ((True, 4, 0), (False, 6, 2)):
    c = SglangRadixCache(6, 2, conservative_evict=conservative)
    c.run_request(seq(0, 4), [1])  # node A, 2 pages
    c.run_request(seq(100, 4), [1])  # node B, 2 pages; 2 free
    # P = 1, O = 4: prefill takes 1 page (1 free), decode step 2 takes the
    # last one; step 3 needs no page, yet SGLang's per-step demand of one
    # free page evicts the LRU leaf A.
    c.run_request([7], [1, 2, 3, 4])
    assert c.cached_pages() == cached
    c.check_invariants()
    assert c.run_request(seq(0, 4), [1]) == hit_a


def test_sglang_out_of_pages_leaves_state_unchanged():
  c = SglangRadixCache(3, 4)
  c.run_request(seq(0, 8), [1])
  before = (c.cached_sequences(), c.num_free_pages)
  with pytest.raises(OutOfPages):
    c.run_request(seq(0, 12), [1, 2])
  assert (c.cached_sequences(), c.num_free_pages) == before


def test_sglang_hashed_blocks_and_fresh_output_ids():
  c = SglangRadixCache(16, 4)
  assert c.run_request_hashed(["a", "b", "c"], 10, 5) == 0
  assert c.run_request_hashed(["a", "b", "c"], 10, 1) == 8
  assert c.run_request_hashed(["a", "b", "c", "d"], 16, 1) == 8
  assert c.run_request_hashed(["a", "x"], 8, 1, extra="s") == 0
  c.run_request_hashed(["p"], 3, 6, all_hashes=["p", "q"])
  assert c.run_request_hashed(["p", "q", "r"], 9, 1) == 8
  c.check_invariants()


def test_sglang_waiting_refresh_touches_uncapped_prompt():
  c = SglangRadixCache(20, 2, waiting_refresh_interval=1)
  c.run_request(seq(0, 6), [1])  # one 3-page node
  assert c.run_request(seq(0, 6), [1]) == 4
  # The uncapped touch split the node at the full prompt (3 pages); the
  # capped match then split it at 2 pages.
  assert sorted(len(n.pages) for n in c.nodes()) == [1, 2]


# ------------------------------------------------------- random workloads
def make_workload(draw_int, n_requests: int, vocab: int = 3):
  """Requests drawn from a few shared prefixes plus short random tails."""
  prefixes = [[draw_int(0, vocab) for _ in range(12)] for _ in range(3)]
  reqs = []
  history: list[list[int]] = []
  for _ in range(n_requests):
    kind = draw_int(0, 3)
    if kind == 3 and history:  # multi-turn: resend an earlier sequence
      base = history[draw_int(0, len(history) - 1)]
    else:
      base = prefixes[kind % 3]
    p = base[: draw_int(1, len(base))] + [
      draw_int(0, vocab) for _ in range(draw_int(0, 3))
    ]
    out = [draw_int(0, vocab) for _ in range(draw_int(0, 6))]
    extra = None if draw_int(0, 5) else "salt"
    reqs.append((p, out, extra))
    history.append(p + out)
  return reqs


def replay_checked(cache, requests, out_of_space, unit: int):
  """Runs ``requests`` through ``cache`` with the checks both models share.

  A request that does not fit must raise ``out_of_space``. An admitted one
  must hit whole ``unit``s (blocks or pages), leave at least one prompt
  token to compute and hit no more than the ideal unbounded cache; the
  invariants must hold after it. Yields after each admitted request, for
  the model's own checks.
  """
  seen: dict = {None: [], "salt": []}
  for p, out, extra in requests:
    if not cache.fits(len(p), len(out)):
      with pytest.raises(out_of_space):
        cache.run_request(p, out, extra)
      continue
    hit = cache.run_request(p, out, extra)
    assert 0 <= hit <= len(p) - 1 and hit % unit == 0
    assert hit <= ideal_hit(seen[extra], p, unit)
    seen[extra].append((p + out)[: len(p) + max(len(out), 1) - 1])
    cache.check_invariants()
    yield


workloads = st.data()


@settings(max_examples=60, deadline=None)
@given(
  data=workloads,
  bs=st.integers(1, 4),
  cap=st.integers(1, 14),
  free_order=st.sampled_from(FREE_ORDERS),
)
def test_vllm_replay_invariants(data, bs, cap, free_order):
  draw = lambda lo, hi: data.draw(st.integers(lo, hi))
  c = VllmPrefixCache.from_capacity(cap, bs, free_order)
  for _ in replay_checked(c, make_workload(draw, 25), OutOfBlocks, bs):
    assert c.num_free == c.capacity  # nothing runs between requests
    assert sorted(c.free_queue_order()) == list(range(1, cap + 1))
    assert all(c.refcount(b) == 0 for b in range(1, cap + 1))


@settings(max_examples=40, deadline=None)
@given(data=workloads, bs=st.integers(1, 3), cap=st.integers(2, 16))
def test_vllm_concurrent_api_invariants(data, bs, cap):
  """Random interleavings of the request verbs keep refcounts exact."""
  draw = lambda lo, hi: data.draw(st.integers(lo, hi))
  c = VllmPrefixCache.from_capacity(cap, bs)
  pending = make_workload(draw, 12)
  running: dict[int, int] = {}  # rid -> output tokens left
  rid = 0
  for _ in range(80):
    op = draw(0, 2)
    if op == 0 and pending:
      p, out, extra = pending.pop()
      c.add_request(rid, p, extra)
      blocks, hit = c.get_computed_blocks(rid)
      assert hit <= len(p) - 1 and hit % bs == 0
      if c.allocate_slots(rid, len(p) - hit, blocks) is None:
        c.free(rid)
      else:
        running[rid] = len(out)
      rid += 1
    elif op == 1 and running:
      r = sorted(running)[draw(0, len(running) - 1)]
      c.append_tokens(r, [draw(0, 3)])
      if running[r] > 1 and c.allocate_slots(r, 1) is not None:
        running[r] -= 1
    elif op == 2 and running:
      r = sorted(running)[draw(0, len(running) - 1)]
      c.free(r)
      del running[r]
    c.check_invariants()
    held = {b for r in running for b in c.request_blocks(r)}
    assert c.num_free == cap - len(held)
  for r in list(running):
    c.free(r)
  c.check_invariants()
  assert c.num_free == cap


@settings(max_examples=60, deadline=None)
@given(
  data=workloads,
  ps=st.integers(1, 4),
  cap=st.integers(1, 14),
  gran=st.sampled_from(("node", "page")),
  conservative=st.booleans(),
)
def test_sglang_replay_invariants(data, ps, cap, gran, conservative):
  draw = lambda lo, hi: data.draw(st.integers(lo, hi))
  c = SglangRadixCache(
    cap, ps, granularity=gran, conservative_evict=conservative
  )
  for _ in replay_checked(c, make_workload(draw, 25), OutOfPages, ps):
    assert c.protected_size() == 0 and c.private_pages() == 0
    assert c.evictable_size() == c.cached_pages() * ps
    assert c.cached_pages() + c.num_free_pages == cap


def test_unbounded_models_agree_with_ideal_hits(rng):
  """With room for everything, both models give the ideal hits."""
  draw = lambda lo, hi: int(rng.integers(lo, hi + 1))
  for bs in (1, 2, 4):
    reqs = make_workload(draw, 60)
    v = VllmPrefixCache.from_capacity(10_000, bs)
    s = SglangRadixCache(10_000, bs)
    seen: dict = {None: [], "salt": []}
    for p, out, extra in reqs:
      want = ideal_hit(seen[extra], p, bs)
      assert v.run_request(p, out, extra) == want
      assert s.run_request(p, out, extra) == want
      seen[extra].append((p + out)[: len(p) + max(len(out), 1) - 1])


def test_sglang_hashed_matches_token_mode_given_token_keys(rng):
  ps = 3
  tok = SglangRadixCache(9, ps)
  hsh = SglangRadixCache(9, ps)
  for p, out in _requests_on_shared_prefixes(rng):
    if not tok.fits(len(p), len(out)):
      continue
    keys = page_keys_for_tokens(p + out, ps)
    got = hsh.run_request_hashed(keys, len(p), len(out), all_hashes=keys)
    assert got == tok.run_request(p, out)
    assert hsh.cached_pages() == tok.cached_pages()


# ------------------------------------------- optional: against real code
def _import_or_skip(name: str):
  import warnings

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return pytest.importorskip(name)


def _random_requests(rng, n: int, vocab: int = 3):
  prefixes = [list(rng.integers(0, vocab, size=30)) for _ in range(3)]
  hist: list[list[int]] = []
  for _ in range(n):
    if hist and rng.random() < 0.3:
      base = hist[int(rng.integers(len(hist)))]
    else:
      base = prefixes[int(rng.integers(3))]
    p = [int(t) for t in base[: int(rng.integers(1, len(base) + 1))]]
    p += [int(t) for t in rng.integers(0, vocab, size=int(rng.integers(4)))]
    out = [int(t) for t in rng.integers(0, vocab, size=int(rng.integers(1, 9)))]
    hist.append(p + out)
    yield p, out


def test_vllm_model_matches_real_vllm(rng):
  """Runs only where vLLM (and torch) import; verified with vLLM 0.22.0 and
  0.33.0: hits, free-queue order and hashed blocks after every request."""
  import warnings

  vllm = _import_or_skip("vllm")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (
      get_request_block_hasher,
      init_none_hash,
    )
    from vllm.v1.kv_cache_interface import (
      FullAttentionSpec,
      KVCacheConfig,
      KVCacheGroupSpec,
    )
    from vllm.v1.request import Request

    init_none_hash(sha256)
    major, minor = (int(x) for x in vllm.__version__.split(".")[:2])
    order = "append" if (major, minor) < (0, 23) else "prepend_unhashed"
    for trial in range(20):
      bs = int(rng.choice([1, 2, 3, 4, 16]))
      cap = int(rng.integers(1, 25))
      spec = FullAttentionSpec(
        block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32
      )
      cfg = KVCacheConfig(
        num_blocks=cap + 1,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
      )
      kw = dict(max_model_len=8192, hash_block_size=bs, enable_caching=True)
      try:
        real = KVCacheManager(cfg, scheduler_block_size=bs, **kw)
      except TypeError:
        real = KVCacheManager(cfg, **kw)
      model = VllmPrefixCache.from_capacity(cap, bs, order)
      for i, (p, out) in enumerate(_random_requests(rng, 30)):
        if not model.fits(len(p), len(out)):
          continue
        salt = "s" if rng.random() < 0.2 else None
        sp = SamplingParams(max_tokens=100)
        sp.update_from_generation_config({}, eos_token_id=10**6)
        req = Request(
          request_id=f"{trial}-{i}",
          prompt_token_ids=p,
          mm_features=None,
          sampling_params=sp,
          pooling_params=None,
          lora_request=None,
          cache_salt=salt,
          block_hasher=get_request_block_hasher(bs, sha256),
        )
        blocks, hit = real.get_computed_blocks(req)[:2]
        assert real.allocate_slots(req, len(p) - hit, hit, blocks) is not None
        req.num_computed_tokens = len(p)
        for k, t in enumerate(out):
          req.append_output_token_ids(t)
          if k + 1 < len(out):
            assert real.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1
        real.free(req)
        assert model.run_request(p, out, salt) == hit
        pool = real.block_pool
        queue = pool.free_block_queue.get_all_free_blocks()
        assert [b.block_id for b in queue] == model.free_queue_order()
        for b in range(cap + 1):
          real_hashed = pool.blocks[b].block_hash is not None
          assert real_hashed == (model.block_hash(b) is not None)


def test_sglang_model_matches_real_sglang(rng):
  """Runs only where SGLang's radix cache imports (verified with 0.5.23):
  the real RadixCache, paged allocator and allocation functions, driven as
  the scheduler drives them, one request at a time."""
  import warnings
  from array import array
  from types import SimpleNamespace

  _import_or_skip("sglang.srt.mem_cache.radix_cache")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    from sglang.srt.mem_cache.allocation import (
      alloc_paged_token_slots_decode,
      alloc_paged_token_slots_extend,
      alloc_token_slots,
    )
    from sglang.srt.mem_cache.allocator.paged import (
      PagedTokenToKVPoolAllocator,
    )
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    T = torch.tensor
    for _ in range(20):
      ps = int(rng.integers(1, 5))
      cap = int(rng.integers(1, 17))
      alloc = PagedTokenToKVPoolAllocator(
        cap * ps, ps, torch.float16, "cpu", None, False
      )
      tree = RadixCache.create_simulated(mock_allocator=alloc, page_size=ps)
      rows = torch.zeros((1, 4096), dtype=torch.int64)

      def write(idx, vals, rows=rows):
        rows[idx] = vals

      tree.req_to_token_pool = SimpleNamespace(req_to_token=rows, write=write)
      model = SglangRadixCache(cap, ps)
      for p, out in _random_requests(rng, 30):
        if not model.fits(len(p), len(out)):
          continue
        n_p, n_o = len(p), len(out)
        key = RadixKey(array("q", p[: n_p - 1]))
        res = tree.match_prefix(MatchPrefixParams(key=key))
        h = res.device_prefix_len
        kv = SimpleNamespace(
          req_pool_idx=0,
          swa_evict_floor=0,
          cache_inserted_len=0,
          cache_protected_len=h,
          get_evicted_seqlen=lambda ct: 0,
          swa_dead_lo=lambda ps: 0,
        )
        req = SimpleNamespace(
          kv=kv,
          extra_key=None,
          cache_salt=None,
          priority=None,
          origin_input_ids=array("q", p),
          full_untruncated_fill_ids=array("q", p),
          last_node=res.last_device_node,
          lock=tree.lock(res.last_device_node),
        )
        row = rows[0]
        row[:h] = tree.path_device_indices(res.last_device_node)
        if ps == 1:
          loc = alloc_token_slots(tree, n_p - h)
        else:
          last = int(row[h - 1]) if h > 0 else -1
          loc = alloc_paged_token_slots_extend(
            tree, T([h]), T([h]), T([n_p]), T([n_p]), T([last]), n_p - h
          )
        row[h:n_p] = loc
        if n_o >= 2:
          tree.checkpoint(req, up_to=n_p)
        for k in range(1, n_o):
          pos = n_p + k - 1
          if ps == 1:
            loc = alloc_token_slots(tree, 1)
          else:
            loc = alloc_paged_token_slots_decode(
              tree, T([pos + 1]), T([pos + 1]), T([int(row[pos - 1])])
            )
          row[pos] = loc[0]
        req.full_untruncated_fill_ids = array("q", p + out)
        owned = n_p + n_o - 1
        tree.checkpoint(req, up_to=owned)
        tree.free_kv_row(req.kv, [(req.kv.cache_protected_len, owned)])
        tree.unlock(req.lock)
        assert model.run_request(p, out) == h
        assert alloc.available_size() == model.num_free_pages * ps
        assert tree.evictable_size() == model.evictable_size()
