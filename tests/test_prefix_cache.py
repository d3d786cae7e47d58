"""Prefix cache vs the vLLM v1 oracle, plus edge cases.

Random workloads run on the device as one ``lax.scan`` (one request at a
time: match + allocate, publish the prompt blocks, decode ``O - 1`` tokens,
publish again, release) and are replayed on
:class:`reference_models.vllm_apc.VllmPrefixCache` (both ``free_order``
values: vLLM <= 0.22's and >= 0.23's release order). After every request the
hit tokens, hit and fresh blocks, the exact free-queue order, refcounts,
every block's hash and the per-key block lists are compared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_models import vllm_apc

from prefixjax.cache import hashing, paging, prefix_state
from prefixjax.cache import index as index_lib
from prefixjax.cache import prefix_cache as pc

K = 4
M = 12
T = M * K


def _keys(tokens, n, salt=0, block_size=K):
  tokens = np.asarray(tokens, np.int32)
  padded = np.zeros(T, np.int32)
  padded[: len(tokens)] = tokens
  keys, _ = hashing.block_hashes(
    jnp.asarray(padded), n, block_size=block_size, extra=[salt]
  )
  return keys


# ---------------------------------------------------------------------------
# Device replay of a whole workload in one scan.


@jax.jit
def _run_workload(state, tokens, prompt_lens, output_lens, salts, bumps):
  def step(state, req):
    toks, p, o, salt, bump = req
    state = state.replace(version=state.version + bump.astype(jnp.uint32))
    total = p + o - 1
    keys, _ = hashing.block_hashes(toks, total, block_size=K, extra=salt[None])
    vkeys = prefix_state.versioned(state, keys)
    seq = jnp.int32(0)
    state, a = pc.allocate_with_prefix(state, seq, keys, p)
    state, pub1 = pc.publish(state, seq, keys, p)
    state, ap = pc.append(state, seq, o - 1)
    state, pub2 = pc.publish(state, seq, keys, total)
    held = state
    state, rel = pc.release(state, seq)
    out = dict(
      status=a.status,
      hit_tokens=a.hit_tokens,
      hit_blocks=a.hit_blocks,
      new_blocks=a.new_blocks,
      append_status=ap.status,
      append_new=ap.new_blocks,
      published=pub1.num_published + pub2.num_published,
      dropped=pub1.num_dropped + pub2.num_dropped,
      vkeys=vkeys,
      held_refcounts=held.paging.refcounts,
    )
    return state, (state, out)

  return jax.lax.scan(
    step, state, (tokens, prompt_lens, output_lens, salts, bumps)
  )


def make_workload(rng, num_requests, num_blocks, vocab=6):
  """Prompts from a few shared prefixes with random suffixes, repeats,
  salts and rare version bumps; every request fits the pool and a table."""
  max_total = min(T, (num_blocks - 1) * K)
  prefixes = [
    rng.integers(0, vocab, size=int(rng.integers(K, 7 * K))) for _ in range(3)
  ]
  reqs = []
  for _ in range(num_requests):
    roll = rng.random()
    recent = int(rng.integers(max(0, len(reqs) - 5), max(len(reqs), 1)))
    if reqs and roll < 0.2:
      # Same request again: duplicates of recomputed and output blocks.
      reqs.append(dict(reqs[recent], bump=0))
      continue
    o = int(rng.integers(1, 9))
    if reqs and roll < 0.45:
      # Next turn of a chat: the earlier prompt and outputs, then more.
      prev = reqs[recent]
      prompt = np.concatenate(
        [prev["prompt"], prev["outputs"], rng.integers(0, vocab, size=3)]
      )[: max_total - o]
      if rng.random() < 0.4 and len(prompt) >= K:
        prompt = prompt[: len(prompt) // K * K]
      outputs = rng.integers(0, vocab, size=o)
      reqs.append(
        dict(prompt=prompt, outputs=outputs, salt=prev["salt"], bump=0)
      )
      continue
    base = prefixes[int(rng.integers(3))] if rng.random() < 0.85 else []
    cut = (
      int(rng.integers(0, len(base) + 1)) if rng.random() < 0.3 else len(base)
    )
    suffix = rng.integers(0, vocab, size=int(rng.integers(0, 3 * K)))
    prompt = np.concatenate([base[:cut], suffix]).astype(np.int64)
    if len(prompt) == 0:
      prompt = np.asarray([1])
    prompt = prompt[: max_total - o]
    if rng.random() < 0.4 and len(prompt) >= K:
      prompt = prompt[: len(prompt) // K * K]  # a full last block
    outputs = rng.integers(0, vocab, size=o)
    salt = 1 if rng.random() < 0.15 else 0
    bump = 1 if rng.random() < 0.02 else 0
    reqs.append(dict(prompt=prompt, outputs=outputs, salt=salt, bump=bump))
  return reqs


def _ring(nxt, head):
  out, cur = [head], int(nxt[head])
  while cur != head and len(out) <= len(nxt):
    out.append(cur)
    cur = int(nxt[cur])
  return out


def compare_workload(reqs, num_blocks, free_order, max_seqs=2):
  n = len(reqs)
  tokens = np.zeros((n, T), np.int32)
  for i, r in enumerate(reqs):
    seq = np.concatenate([r["prompt"], r["outputs"]])
    tokens[i, : len(seq)] = seq
  p = np.asarray([len(r["prompt"]) for r in reqs], np.int32)
  o = np.asarray([len(r["outputs"]) for r in reqs], np.int32)
  salts = np.asarray([r["salt"] for r in reqs], np.uint32)
  bumps = np.asarray([r["bump"] for r in reqs], np.int32)
  state = pc.init(
    num_blocks,
    K,
    max_seqs=max_seqs,
    max_blocks_per_seq=M,
    free_order=free_order,
  )
  final, (states, outs) = _run_workload(
    state, jnp.asarray(tokens), p, o, jnp.asarray(salts), bumps
  )
  outs = jax.tree.map(np.asarray, outs)
  queue_next = np.asarray(states.paging.free_next)
  heads = np.asarray(states.paging.free_head)
  refcounts = np.asarray(states.paging.refcounts)
  block_hash = np.asarray(states.block_hash)
  dup_next = np.asarray(states.dup_next)
  published = np.asarray(states.paging.published)

  oracle = vllm_apc.VllmPrefixCache(num_blocks, K, free_order=free_order)
  to_device: dict = {}
  version = 0
  total_hits = 0
  for i, r in enumerate(reqs):
    where = f"request {i}"
    version += r["bump"]
    extra = (r["salt"], version)
    rid = ("r", i)
    prompt = [int(t) for t in r["prompt"]]
    oracle.add_request(rid, prompt, extra)
    hit_blocks, hit = oracle.get_computed_blocks(rid)
    new = oracle.allocate_slots(rid, len(prompt) - hit, hit_blocks)
    assert new is not None
    decode_new = []
    outputs = [int(t) for t in r["outputs"]]
    for k, tok in enumerate(outputs):
      oracle.append_tokens(rid, [tok])
      if k + 1 < len(outputs):
        decode_new += oracle.allocate_slots(rid, 1)
    # Map oracle keys to device (versioned) keys; must be a bijection.
    okeys = oracle.block_keys(rid)
    for j, key in enumerate(okeys[: (len(prompt) + len(outputs) - 1) // K]):
      dkey = tuple(outs["vkeys"][i, j].tolist())
      assert to_device.setdefault(key, dkey) == dkey, f"{where}: key clash"
    held = [oracle.refcount(b) for b in range(num_blocks)]
    oracle.free(rid)
    oracle.check_invariants()

    assert outs["status"][i] == 0, where
    assert outs["append_status"][i] == 0, where
    assert outs["dropped"][i] == 0, where
    assert outs["hit_tokens"][i] == hit, where
    total_hits += hit
    got_hits = outs["hit_blocks"][i]
    assert got_hits[: len(hit_blocks)].tolist() == hit_blocks, where
    got_new = outs["new_blocks"][i]
    assert got_new[: len(new)].tolist() == new, where
    got_dec = outs["append_new"][i]
    assert got_dec[: len(decode_new)].tolist() == decode_new, where
    np.testing.assert_array_equal(outs["held_refcounts"][i], held, where)
    # Whole state after release.
    order, cur = [], int(heads[i])
    while cur != -1 and len(order) < num_blocks:
      order.append(cur)
      cur = int(queue_next[i, cur])
    assert order == oracle.free_queue_order(), where
    assert refcounts[i].tolist() == [
      oracle.refcount(b) for b in range(num_blocks)
    ]
    for b in range(num_blocks):
      key = oracle.block_hash(b)
      want = (0, 0) if key is None else to_device[key]
      assert tuple(block_hash[i, b].tolist()) == want, f"{where} block {b}"
      assert published[i, b] == (key is not None), f"{where} block {b}"
    for key, blocks in oracle.cached_blocks().items():
      # The device ring from the earliest block lists the same blocks in
      # publication order.
      assert _ring(dup_next[i], blocks[0]) == blocks, f"{where} key {key}"
  # Index lookups on the final state equal the oracle's get_one_block.
  cached = oracle.cached_blocks()
  if cached:
    dkeys = np.asarray([to_device[k] for k in cached], np.uint32)
    got = index_lib.lookup(final.index, jnp.asarray(dkeys)).tolist()
    assert got == [v[0] for v in cached.values()]
  assert pc.check_invariants(final) == []
  stats = pc.stats_dict(final)
  assert stats["hit_tokens"] == total_hits
  assert stats["num_cached"] == oracle.num_cached_blocks()
  return total_hits


@pytest.mark.parametrize(
  "num_blocks, free_order",
  [
    (7, "append"),
    (24, "append"),
    (7, "prepend_unhashed"),
    (13, "prepend_unhashed"),
  ],
  ids=[
    "N7-append",
    "N24-append",
    "N7-prepend_unhashed",
    "N13-prepend_unhashed",
  ],
)
def test_random_workloads_match_vllm_oracle(rng, num_blocks, free_order):
  reqs = make_workload(rng, 400, num_blocks)
  hits = compare_workload(reqs, num_blocks, free_order=free_order)
  assert hits > 0


def test_default_release_order_is_vllm_033s():
  """vLLM 0.33.0 ``BlockPool.free_blocks``: a released request's blocks
  without a hash go to the queue head (its last block first), hashed ones
  to the tail; 0.22 appends everything at the tail."""
  keys = _keys(np.arange(10), 10)
  queues = {}
  for version in (None, "latest", "0.33", "0.23.1", "0.22", "0.8"):
    s = pc.init(8, K, max_seqs=1, max_blocks_per_seq=M, vllm_version=version)
    s, _ = pc.allocate_with_prefix(s, jnp.int32(0), keys, jnp.int32(10))
    s, _ = pc.publish(s, jnp.int32(0), keys, jnp.int32(10))  # blocks 1, 2
    s, r = pc.release(s, jnp.int32(0))
    assert r.freed_blocks[:3].tolist() == [3, 2, 1]
    queues[version] = paging.free_queue_order(s.paging)
    assert pc.check_invariants(s) == []
    assert pc.stats_dict(s)["num_cached_free"] == 2
  head_first = [3, 4, 5, 6, 7, 2, 1]
  assert queues == {
    None: head_first,
    "latest": head_first,
    "0.33": head_first,
    "0.23.1": head_first,
    "0.22": [4, 5, 6, 7, 3, 2, 1],
    "0.8": [4, 5, 6, 7, 3, 2, 1],
  }
  oracle = vllm_apc.VllmPrefixCache(8, K)  # the oracle's default: 0.33
  oracle.run_request(list(range(10)), [99])
  assert oracle.free_queue_order() == head_first


def test_vllm_version_table_and_refusals():
  assert pc.VLLM_FREE_ORDERS == {"0.33": "prepend_unhashed", "0.22": "append"}
  assert pc.DEFAULT_VLLM_VERSION == "0.33"
  for version, order in pc.VLLM_FREE_ORDERS.items():
    assert pc.vllm_free_order(version) == order
  assert pc.init(8, K, max_seqs=1, max_blocks_per_seq=M).free_order == (
    "prepend_unhashed"
  )
  s = pc.init(8, K, max_seqs=1, max_blocks_per_seq=M, free_order="append")
  assert s.free_order == "append"
  # Both given: they must agree.
  s = pc.init(
    8,
    K,
    max_seqs=1,
    max_blocks_per_seq=M,
    free_order="append",
    vllm_version="0.22",
  )
  assert s.free_order == "append"
  with pytest.raises(ValueError, match="contradicts vllm_version='0.33'"):
    pc.init(
      8,
      K,
      max_seqs=1,
      max_blocks_per_seq=M,
      free_order="append",
      vllm_version="0.33",
    )
  for bad in ("0.34", "0.7", "1.0", "0.33.x", "v0.33", "latest "):
    with pytest.raises(ValueError, match="'0.23' .. '0.33'.*'0.8' .. '0.22'"):
      pc.init(8, K, max_seqs=1, max_blocks_per_seq=M, vllm_version=bad)
  with pytest.raises(TypeError, match="vllm_version must be a string"):
    pc.init(8, K, max_seqs=1, max_blocks_per_seq=M, vllm_version=0.33)
  with pytest.raises(ValueError, match="scoring policy needs"):
    pc.init(
      8,
      K,
      max_seqs=1,
      max_blocks_per_seq=M,
      policy="fifo",
      vllm_version="0.22",
    )
  s = pc.init(8, K, max_seqs=1, max_blocks_per_seq=M, policy="fifo")
  assert s.free_order == "prepend_unhashed"
