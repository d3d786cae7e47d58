"""Trace replay with vLLM v1 semantics through the on-device prefix cache.

Each request, one at a time and in order, runs through
:mod:`prefixjax.cache.prefix_cache` exactly as vLLM v1's ``KVCacheManager`` with
prefix caching on serves a request alone: match its prompt (hits capped at
``prompt_len - 1`` tokens, whole blocks), touch the hits and allocate the
rest (popping the free-queue head and dropping popped blocks' old hashes),
publish the full prompt blocks, decode ``output_len - 1`` more tokens (the
last sampled token has no KV) and publish the blocks they fill, then release
the request's blocks tail first. The pool holds ``capacity`` usable blocks
plus the null block. The eviction policy is vLLM's ``lru`` (the free-queue
order) by default, or any other policy of :mod:`prefixjax.cache.policies`
(``fifo``, ``lfu``, ``lru_leaf``, ``belady``, ``belady_leaf``, user-defined
ones): with those, the cache takes free blocks without a hash first and
the rest are the policy's victims (see
:mod:`prefixjax.cache.prefix_cache`), which needs vLLM >= 0.23's release
order. Every block's hooks receive its next-use step (the next request
whose lookup may hit its key, :func:`next_use_steps`), computed on the host
from the trace's exact block identities: ``belady`` and ``belady_leaf``
evict by it.

The release order follows the vLLM release named by ``vllm_version``
(:data:`prefixjax.cache.prefix_state.VLLM_FREE_ORDERS`): from 0.23 on (the
default, ``"0.33"``) a released request's blocks without a hash (its partly
filled last block) go to the free-queue head and are reused first, the
hashed ones to the tail (``vllm/v1/core/block_pool.py
BlockPool.free_blocks``, lines 816-847 of 0.33.0); up to 0.22 (``"0.22"``)
all go to the tail.

Token-id traces give exact block contents; when a request's output token ids
are not known, its outputs are given ids no prompt uses (``-1 - request``),
so output-filled blocks are cached but never hit.

Hash-id traces (Mooncake ``hash_ids``: one pre-chained id per block of the
trace's fixed block size) give block identities instead: block ``j`` of a
prompt is cached under its trace id when it is full (``j < P // K``); the id
of a partial last prompt block describes a partial block and is dropped, so
that block, and every block filled during decode, gets a fresh key that no
other block ever carries (it is cached but never hit). This is the oracle's
``VllmPrefixCache.run_request_hashed`` without ``all_hashes``. Content keys
(``[2]`` uint32 lanes, before the cache mixes in its version word) are:

* trace id ``v`` (``0 <= v < 2**63``): ``(v & 0xFFFFFFFF, v >> 32)``, the
  :func:`prefixjax.cache.hashing.int64_to_lanes` split; bit 31 of lane 1 is 0;
* fresh key of request ``r``, table column ``j``: ``(r, FRESH_TAG | j)``
  with ``FRESH_TAG = 0x80000000``; bit 31 of lane 1 is 1.

So ids never equal fresh keys, fresh keys are distinct across the whole
replay, and equal ids are equal keys. A trace is replayed from its token ids
if it has them and from its hash ids otherwise, so token-hash keys and id
keys never meet in one cache. The cache's version mix is a 64-bit hash that
keeps keys differing in one lane apart (see :mod:`prefixjax.cache.hashing`), so
ids below ``2**32`` (all of Mooncake's) never collide in the index; other
distinct keys collide with probability about ``2**-64`` per pair.

The key matrix ``[R, M, 2]`` is built on the host (the ids are given); the
whole replay is one jitted ``lax.scan`` over requests per capacity either
way.

Two engines give these hits. For ``lru``, :func:`replay_vllm` runs the
specialised engine of :mod:`prefixjax.replay.vllm_engine` (a few
``[M]``-wide steps per request, keys numbered exactly on the host, the free
queue as an ordered set of release counters); for every other policy it
runs :data:`GENERAL_ENGINE`, the general-verb path described above, which
:func:`general_hits` runs for any policy (``lru`` included: the reference
the specialised engine is tested against). The general engine sizes its
pool for the largest capacity and, per capacity, takes the blocks past it
off the free queue before the first request, so one compiled program
serves every capacity (a run-time scalar, vmappable). The policy's state
is an input of that program, so points of policies that differ only in
their state (``lfu`` of several decays) share it.

Dimensions: ``R`` requests, ``T`` padded tokens per request, ``K`` block
size, ``M = T // K`` blocks per request (table columns).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._checks import check_block_size
from prefixjax._host import to_device
from prefixjax.cache import hashing, paging, policies
from prefixjax.cache import prefix_cache as pc
from prefixjax.cache.prefix_state import DEFAULT_VLLM_VERSION, vllm_free_order
from prefixjax.replay import frame, vllm_engine
from prefixjax.replay.frame import (
  Batching,
  Prepared,
  ReplayEngine,
  ReplayResult,
)
from prefixjax.workloads import Trace

__all__ = [
  "FRESH_TAG",
  "GENERAL_ENGINE",
  "PUBLISH_MODES",
  "general_hits",
  "next_use_steps",
  "replay_vllm",
]

FRESH_TAG = 0x80000000
"""Bit 31 of lane 1: set in fresh (never-hit) keys, clear in trace-id keys."""

PUBLISH_MODES = ("early", "late")


def _token_matrix(trace: Trace, block_size: int, totals: np.ndarray):
  """``[R, T]`` int32 prompt + output tokens, ``T`` a multiple of ``K``."""
  prompts = trace.input_token_ids
  outputs = trace.output_token_ids
  width = int(-(-max(int(totals.max()), 1) // block_size) * block_size)
  tokens = np.zeros((len(trace), width), np.int32)
  for r in range(len(trace)):
    prompt = np.asarray(prompts[r], np.int32)
    out_len = int(totals[r]) - len(prompt)
    if outputs is not None and len(outputs[r]) >= out_len:
      out = np.asarray(outputs[r][:out_len], np.int32)
    else:
      out = np.full(out_len, -1 - r, np.int32)
    tokens[r, : len(prompt)] = prompt
    tokens[r, len(prompt) : len(prompt) + out_len] = out
  return tokens


def _key_matrix(trace: Trace, block_size: int, totals: np.ndarray):
  """``[R, M, 2]`` uint32 content keys of a hash-id trace (module docstring):
  trace ids for the full prompt blocks, fresh keys everywhere else."""
  num_requests = len(trace)
  max_blocks = -(-max(int(totals.max()), 1) // block_size)
  if num_requests >= FRESH_TAG or max_blocks >= FRESH_TAG:
    raise ValueError(
      f"{num_requests} requests of up to {max_blocks} blocks do not fit the "
      "fresh-key encoding (at most 2**31 - 1 each)"
    )
  full = (np.asarray(trace.input_lengths) // block_size).astype(np.int64)
  ids = np.concatenate(
    [row[:n] for row, n in zip(trace.hash_ids, full, strict=True)]
    + [np.zeros(0, np.int64)]
  )
  keys = np.empty((num_requests, max_blocks, 2), np.uint32)
  keys[:, :, 0] = np.arange(num_requests, dtype=np.uint32)[:, None]
  keys[:, :, 1] = np.uint32(FRESH_TAG) | np.arange(max_blocks, dtype=np.uint32)
  rows = np.repeat(np.arange(num_requests), full)
  starts = np.cumsum(full) - full
  cols = np.arange(ids.size) - np.repeat(starts, full)
  keys[rows, cols] = hashing.int64_to_lanes(ids)
  return keys


def _check_hash_ids(trace: Trace, block_size: int) -> None:
  """Refuses hash ids outside ``[0, 2**63)`` and ids repeated within one
  request's full prompt blocks (chained ids name whole prefixes, so they
  never repeat in a row; vLLM would hit one block twice)."""
  full = np.asarray(trace.input_lengths, np.int64) // block_size
  ids = np.concatenate(
    [row[:n] for row, n in zip(trace.hash_ids, full, strict=True)]
    + [np.zeros(0, np.int64)]
  )
  rows = np.repeat(np.arange(len(trace)), full)
  if ids.size and ids.min() < 0:
    at = int(np.argmax(ids < 0))
    raise ValueError(
      f"hash_ids[{int(rows[at])}] holds {int(ids[at])}: hash ids must be in "
      "[0, 2**63) (bit 63 would overlap the fresh-key tag)"
    )
  order = np.lexsort((ids, rows))
  rows, ids = rows[order], ids[order]
  repeated = (rows[1:] == rows[:-1]) & (ids[1:] == ids[:-1])
  if repeated.any():
    at = int(np.argmax(repeated))
    raise ValueError(
      f"hash_ids[{int(rows[at])}] repeats id {int(ids[at])} within its full "
      "prompt blocks: chained hash ids name whole prefixes, so one cannot "
      "repeat within a request"
    )


def _dense_token_keys(tokens: np.ndarray, totals: np.ndarray, block_size):
  """``[R, M]`` int64 dense ids of the full blocks of ``tokens`` ``[R, T]``
  (the first ``totals[r]`` tokens of row ``r``), -1 past them. A block's
  id is its whole prefix, numbered exactly column by column (the relation
  the device's chained 64-bit hashes stand for)."""
  num_requests, width = tokens.shape
  num_columns = width // block_size
  blocks = tokens.reshape(num_requests, num_columns, block_size)
  full = np.asarray(totals, np.int64) // block_size
  keys = np.full((num_requests, num_columns), -1, np.int64)
  parent = np.full(num_requests, -1, np.int64)
  first = 0
  for col in range(num_columns):
    rows = np.flatnonzero(full > col)
    if not rows.size:
      break
    table = np.concatenate(
      [parent[rows, None], blocks[rows, col].astype(np.int64)], axis=1
    )
    _, inverse = np.unique(table, axis=0, return_inverse=True)
    ids = first + inverse.reshape(-1)
    first = int(ids.max()) + 1
    keys[rows, col] = ids
    parent[rows] = ids
  return keys


def _dense_hash_keys(trace: Trace, block_size: int, num_columns: int):
  """``[R, M]`` int64 dense ids of a hash-id trace's full prompt blocks
  (their trace ids), -1 for every other block (fresh keys, never hit)."""
  full = np.asarray(trace.input_lengths, np.int64) // block_size
  ids = np.concatenate(
    [row[:n] for row, n in zip(trace.hash_ids, full, strict=True)]
    + [np.zeros(0, np.int64)]
  )
  _, dense = np.unique(ids, return_inverse=True)
  keys = np.full((len(trace), num_columns), -1, np.int64)
  rows = np.repeat(np.arange(len(trace)), full)
  cols = np.arange(ids.size) - np.repeat(np.cumsum(full) - full, full)
  keys[rows, cols] = dense.reshape(-1)
  return keys


def next_use_steps(keys, num_usable) -> np.ndarray:
  """Next-use steps of every block of a replay, from dense block ids.

  :func:`prefixjax.cache.policies.next_use_from_keys` for integer keys,
  vectorised: request ``r`` is step ``r + 1`` (the prefix cache's clock),
  and block ``(r, j)`` gets the step of the first later request whose
  first ``num_usable`` blocks hold its key.

  Args:
    keys: ``[R, M]`` integer block ids (equal ids: the same prefix), ``-1``
      for a block no request can hit (a fresh key, or past the request's
      blocks).
    num_usable: ``[R]`` blocks a lookup of each request may hit (``(P - 1)
      // K`` for a serving cache).

  Returns:
    ``[R, M]`` int32 steps, :data:`prefixjax.cache.policies.NEVER` where no
    later request uses the key.

  Example:
    >>> from prefixjax.replay.vllm import next_use_steps
    >>> next_use_steps([[0, 1], [0, -1], [1, -1]], [2, 1, 1]).tolist()
    [[2, 3], [2147483647, 2147483647], [2147483647, 2147483647]]
  """
  keys = np.asarray(keys, np.int64)
  num_requests, num_columns = keys.shape
  usable = np.asarray(num_usable, np.int64).reshape(num_requests, 1)
  real = keys >= 0
  can_hit = real & (np.arange(num_columns) < usable)
  out = np.full(keys.shape, policies.NEVER, np.int32)
  if not can_hit.any():
    return out
  # (key, request) as one sortable code: the first use of a key after
  # request r is the first code at or above key * stride + r + 1.
  stride = num_requests + 1
  hit_rows, hit_cols = np.nonzero(can_hit)
  codes = np.unique(keys[hit_rows, hit_cols] * stride + hit_rows)
  rows, cols = np.nonzero(real)
  key = keys[rows, cols]
  at = np.minimum(
    np.searchsorted(codes, key * stride + rows + 1), codes.size - 1
  )
  found = codes[at] // stride == key
  found &= codes[at] > key * stride + rows
  out[rows[found], cols[found]] = codes[at[found]] % stride + 1
  return out


def _serve(state: pc.PrefixCacheState, keys, prompt_len, total, publish, use):
  """One request alone on sequence slot 0; ``keys`` ``[M, 2]`` uint32,
  ``use`` ``[M]`` int32 next-use steps (for the policy's hooks)."""
  seq = jnp.int32(0)
  state, alloc = pc.allocate_with_prefix(state, seq, keys, prompt_len, use)
  if publish == "early":  # as the prompt's blocks fill
    state, _ = pc.publish(state, seq, keys, prompt_len, use)
  state, _ = pc.append(state, seq, total - prompt_len)
  state, _ = pc.publish(state, seq, keys, total, use)
  state, _ = pc.release(state, seq)
  ok = alloc.status == paging.Status.OK
  return state, (jnp.where(ok, alloc.hit_tokens, 0), alloc.status)


def _limit_pool(state: pc.PrefixCacheState, capacity) -> pc.PrefixCacheState:
  """``state`` (fresh from :func:`prefixjax.cache.prefix_cache.init`) with
  only blocks ``1 .. capacity`` on its free queue: the blocks past them
  are never handed out, so the cache behaves as a pool of ``capacity + 1``
  blocks (same ids, same queue order), and one program serves every
  capacity up to the pool's (a run-time ``[]`` int32). A fresh pool's
  queue is ``1, 2, .., N - 1`` in id order
  (:func:`prefixjax.cache.paging.init`): cutting it after ``capacity``
  leaves exactly the smaller pool's queue."""
  pstate = state.paging
  ids = jnp.arange(state.num_blocks, dtype=jnp.int32)
  none = jnp.int32(paging.NO_BLOCK)
  capacity = jnp.asarray(capacity, jnp.int32)
  return state.replace(
    paging=pstate.replace(
      free_next=jnp.where(ids < capacity, pstate.free_next, none),
      free_prev=jnp.where(ids <= capacity, pstate.free_prev, none),
      free_tail=jnp.where(capacity >= 1, capacity, none),
      free_head=jnp.where(capacity >= 1, pstate.free_head, none),
      num_free=capacity,
    )
  )


def _same_function(f, g) -> bool:
  """Whether ``f`` and ``g`` compute the same thing: the same object, or
  the same code with the same globals, defaults and closure values."""
  if f is g:
    return True
  code = getattr(f, "__code__", None)
  if code is None or code is not getattr(g, "__code__", None):
    return False
  cells = [c.cell_contents for c in f.__closure__ or ()]
  others = [c.cell_contents for c in g.__closure__ or ()]
  return (
    f.__globals__ is g.__globals__
    and f.__defaults__ == g.__defaults__
    and f.__kwdefaults__ == g.__kwdefaults__
    and len(cells) == len(others)
    and all(a is b for a, b in zip(cells, others, strict=True))
  )


def _compiled_rules(
  policy: policies.EvictionPolicy, name: str
) -> policies.EvictionPolicy:
  """The policy a program is compiled with: the default policy of ``name``
  (of any registered name, for a ``"custom"`` one) when ``policy`` differs
  from it in ``init`` alone (its parameters live in its state as arrays,
  as ``lfu``'s ``decay``: the program takes the state as an input), so
  replays of such parameters share one compiled program; else ``policy``
  itself."""
  names = policies.policy_names() if name == "custom" else (name,)
  for candidate in names:
    try:
      base = policies.get_policy(candidate)
    except (TypeError, ValueError):  # a factory without defaults
      continue
    same = (
      base.leaf_only == policy.leaf_only
      and base.static_score == policy.static_score
      and all(
        _same_function(getattr(base, hook), getattr(policy, hook))
        for hook in ("score", "on_touch", "on_publish")
      )
    )
    if same:
      return base
  return policy


def _general_prepare(
  trace: Trace,
  capacities,
  *,
  block_size: int,
  policy: policies.EvictionPolicy,
  policy_name: str = "custom",
  warmup_fraction: float = 0.5,
  publish: str = "early",
  free_order: str = "prepend_unhashed",
  bucketed: bool = False,
) -> Prepared:
  """Scan inputs of :data:`GENERAL_ENGINE` for arguments
  :func:`replay_vllm` has validated.

  Arrays: per request its tokens ``[R, T]`` int32 (a token-id trace) or
  content keys ``[R, M, 2]`` uint32 (a hash-id trace), ``P``, the tokens
  with KV, and ``[R, M]`` int32 next-use steps (:func:`next_use_steps` of
  the trace's exact block identities; every policy's hooks receive them,
  ``belady`` and ``belady_leaf`` read them). ``bucketed``: requests and
  table columns padded to powers of two, the pool to the power of two at
  or above the largest capacity plus the null block (padded requests never
  run; padded columns are past every request's blocks)."""
  totals = trace.kv_tokens.astype(np.int64)
  prompt_lens = np.asarray(trace.input_lengths, np.int32)
  from_tokens = trace.has_token_ids
  if from_tokens:
    tokens = _token_matrix(trace, block_size, totals)
    keys = _dense_token_keys(tokens, totals, block_size)
    columns = tokens.shape[1] // block_size
    wide = frame.padded(columns, bucketed)
    blocks = np.zeros((len(trace), wide * block_size), np.int32)
    blocks[:, : tokens.shape[1]] = tokens
  else:
    matrix = _key_matrix(trace, block_size, totals)
    columns = matrix.shape[1]
    keys = _dense_hash_keys(trace, block_size, columns)
    wide = frame.padded(columns, bucketed)
    blocks = np.zeros((len(trace), wide, 2), np.uint32)
    blocks[:, :columns] = matrix
  usable = np.maximum((prompt_lens.astype(np.int64) - 1) // block_size, 0)
  use = np.full((len(trace), wide), policies.NEVER, np.int32)
  use[:, :columns] = next_use_steps(keys, usable)
  rows = frame.padded(len(trace), bucketed)
  xs = (
    frame.pad_rows(blocks, rows, 0),
    frame.pad_rows(prompt_lens, rows, 0),
    frame.pad_rows(totals.astype(np.int32), rows, 0),
    frame.pad_rows(use, rows, policies.NEVER),
  )
  num_blocks = frame.padded(max(capacities) + 1, bucketed)
  return Prepared(
    arrays=(
      tuple(map(to_device, xs)),
      to_device(np.int32(len(trace))),
      policy.init(num_blocks),
    ),
    capacities=np.asarray(capacities, np.int32),
    static=dict(
      block_size=block_size,
      num_blocks=num_blocks,
      max_blocks=wide,
      policy=_compiled_rules(policy, policy_name),
      publish=publish,
      free_order=free_order,
      from_tokens=from_tokens,
    ),
    context=(trace, warmup_fraction, policy_name),
  )


def _general_run(
  arrays,
  capacity,
  *,
  block_size: int,
  num_blocks: int,
  max_blocks: int,
  policy: policies.EvictionPolicy,
  publish: str,
  free_order: str,
  from_tokens: bool,
):
  """``([R] hit tokens, [R] status)`` int32 of one capacity: the requests
  in order through the prefix-cache verbs (module docstring)."""
  xs, num_requests, policy_state = arrays
  state = pc.init(
    num_blocks,
    block_size,
    max_seqs=1,
    max_blocks_per_seq=max_blocks,
    free_order=free_order,
    policy=policy,
  )
  state = _limit_pool(state.replace(policy_state=policy_state), capacity)

  def step(state, request):
    blocks, prompt_len, total, use = request
    keys = blocks
    if from_tokens:
      keys, _ = hashing.block_hashes(blocks, total, block_size=block_size)
    return _serve(state, keys, prompt_len, total, publish, use)

  like = (
    jax.ShapeDtypeStruct((), jnp.int32),
    jax.ShapeDtypeStruct((), jnp.int32),
  )
  _, out = frame.scan_prefix(step, state, xs, num_requests, like)
  return out


def _general_hits(capacities, outputs, num_requests) -> np.ndarray:
  """``[C, R]`` int64 hit tokens of the real requests, after checking that
  every request ran (a capacity the caller checked always holds it)."""
  hits, status = (np.asarray(x)[:, :num_requests] for x in outputs)
  for capacity, row in zip(capacities, status, strict=True):
    refused = row != paging.Status.OK
    if refused.any():
      bad = int(np.flatnonzero(refused)[0])
      raise RuntimeError(
        f"request {bad} was refused ({paging.status_name(row[bad])}) "
        f"with capacity {capacity}"
      )
  return hits.astype(np.int64)


def _general_points(prepared: Prepared, capacities, outputs):
  trace, warmup_fraction, policy_name = prepared.context
  return frame.points_of_requests(
    policy_name,
    capacities,
    prepared.static["block_size"],
    _general_hits(capacities, outputs, len(trace)),
    trace.input_lengths,
    warmup_fraction,
  )


GENERAL_ENGINE = ReplayEngine(
  name="vllm.general",
  semantics="vllm",
  policies=policies.policy_names(),
  batching=Batching.PER_CAPACITY,
  prepare=_general_prepare,
  run=_general_run,
  points=_general_points,
)
"""vLLM v1 semantics through the general prefix-cache verbs, with any
eviction policy (the built-in ones listed, and any
:class:`~prefixjax.cache.policies.EvictionPolicy`), one capacity per run:
what :func:`replay_vllm` runs for every policy but ``lru``."""


def replay_vllm(
  trace: Trace,
  *,
  block_size: int,
  capacities: Sequence[int],
  warmup_fraction: float = 0.5,
  publish: str = "early",
  vllm_version: str = DEFAULT_VLLM_VERSION,
  policy: str | policies.EvictionPolicy = "lru",
  policy_params: Mapping[str, Any] | None = None,
  devices=None,
) -> ReplayResult:
  """Replays a trace with vLLM v1 prefix-caching semantics.

  Args:
    trace: a trace with ``input_token_ids`` (token-id JSONL or generated)
      or ``hash_ids`` (Mooncake JSONL); token ids are used when it has both.
    block_size: tokens per block; for a hash-id trace it must equal the
      trace's ``hash_block_size``.
    capacities: usable blocks in the pool (the null block is extra); each
      must hold the largest request (``ceil((P + O - 1) / K)`` blocks).
    warmup_fraction: share of requests before hits are counted.
    publish: ``"early"`` gives blocks their hashes as they fill (after
      prefill, then after decode), ``"late"`` only when the request
      finishes. With one request at a time both give the same hits; the
      switch matters once requests overlap.
    vllm_version: the vLLM release whose release order to follow
      (:func:`prefixjax.cache.prefix_state.vllm_free_order`): ``"0.33"``
      (default; also ``"latest"`` and ``"0.23"`` .. ``"0.33"``: unhashed
      freed blocks at the queue head) or ``"0.22"`` (``"0.8"`` ..
      ``"0.22"``: all at the tail).
    policy: the eviction policy, as
      :func:`~prefixjax.replay.frame.resolve_policy` takes it: ``"lru"``
      (vLLM's own free-queue order, the default) or any other policy the
      prefix cache runs, by registered name or as an
      :class:`~prefixjax.cache.policies.EvictionPolicy`. A policy other
      than ``lru`` needs vLLM >= 0.23's release order (free blocks without
      a hash at the queue head: they are used first, the rest are the
      policy's victims). ``belady`` and ``belady_leaf`` get their next-use
      steps from the trace (:func:`next_use_steps`).
    policy_params: keyword parameters of a named policy's factory (``lfu``:
      ``decay``).
    devices: as :func:`prefixjax.replay.frame.execute`.

  Returns:
    A :class:`~prefixjax.replay.frame.ReplayResult`: one point per
    capacity (its ``policy`` the name
    :func:`~prefixjax.replay.frame.resolve_policy` gives) and the timing.
    ``lru`` runs :data:`prefixjax.replay.vllm_engine.ENGINE`, every other
    policy :data:`GENERAL_ENGINE`, each compiled once for all capacities
    (see the module docstring); policies that differ from a registered
    name's default in their state alone (``lfu``'s ``decay``) share the
    name's program.

  Raises:
    ValueError: no token ids and no hash ids, a block size other than a
      hash-id trace's, a negative hash id or one repeated within a
      request, a bad size, a capacity too small for the largest request,
      a ``vllm_version`` not listed above, one before 0.23 with a policy
      other than ``lru``, or a policy
      :func:`~prefixjax.replay.frame.resolve_policy` refuses.
    TypeError: as :func:`~prefixjax.replay.frame.resolve_policy`.

  Example:
    >>> import numpy as np
    >>> from prefixjax.replay.vllm import replay_vllm
    >>> from prefixjax.workloads import Trace
    >>> trace = Trace(
    ...   [0.0, 1.0], [8, 9], [1, 1],
    ...   hash_ids=[np.array([5, 6]), np.array([5, 6, 7])], hash_block_size=4)
    >>> (point,) = replay_vllm(
    ...   trace, block_size=4, capacities=[4], warmup_fraction=0.0)
    >>> point.per_request_hit_tokens.tolist()
    [0, 8]
    >>> (point,) = replay_vllm(
    ...   trace, block_size=4, capacities=[4], warmup_fraction=0.0,
    ...   policy="lfu", policy_params={"decay": 0.5})
    >>> point.policy, point.per_request_hit_tokens.tolist()
    ('lfu', [0, 8])
  """
  name, _, chosen = frame.resolve_policy(policy, policy_params)
  free_order = _check(
    trace, block_size, capacities, warmup_fraction, publish, vllm_version
  )
  if chosen is not policies.lru() and free_order != "prepend_unhashed":
    raise ValueError(
      f"policy={name!r} with vllm_version={vllm_version!r}: a policy other "
      "than lru needs vLLM >= 0.23's release order (free blocks without a "
      "hash at the queue head, used before any victim); that release puts "
      f"them at the tail ({free_order!r})"
    )
  block_size = int(block_size)
  capacities = [int(c) for c in capacities]
  if chosen is policies.lru():
    prepared = vllm_engine.ENGINE.prepare(
      trace,
      capacities,
      block_size=block_size,
      warmup_fraction=warmup_fraction,
      free_order=free_order,
      bucketed=True,
    )
    return frame.execute(vllm_engine.ENGINE, prepared, capacities, devices)
  prepared = GENERAL_ENGINE.prepare(
    trace,
    capacities,
    block_size=block_size,
    policy=chosen,
    policy_name=name,
    warmup_fraction=warmup_fraction,
    publish=publish,
    free_order=free_order,
    bucketed=True,
  )
  return frame.execute(GENERAL_ENGINE, prepared, capacities, devices)


def _check(trace, block_size, capacities, warmup_fraction, publish, version):
  """:func:`replay_vllm`'s argument rules; returns the cache's
  ``free_order`` for ``version``."""
  block_size = check_block_size(block_size)
  from_tokens = trace.has_token_ids
  if not from_tokens and not trace.has_hash_ids:
    raise ValueError(
      f"trace {trace.name!r} has no token ids and no hash ids: vLLM-semantics "
      "replay needs block contents (use a token-id trace, a Mooncake "
      "hash-id trace or a generated workload)"
    )
  if not from_tokens and block_size != trace.hash_block_size:
    raise ValueError(
      f"block_size={block_size} differs from the hash block size "
      f"{trace.hash_block_size} of trace {trace.name!r}: hash ids name "
      "blocks of that size only"
    )
  frame.check_warmup_fraction(warmup_fraction)
  if publish not in PUBLISH_MODES:
    raise ValueError(f"publish={publish!r} is not one of {PUBLISH_MODES}")
  free_order = vllm_free_order(version)
  if len(trace) == 0:
    raise ValueError(f"trace {trace.name!r} has no requests")
  capacities = frame.check_capacities(capacities)
  need, _ = frame.largest_request_blocks(trace, block_size)
  for capacity in capacities:
    if capacity < need:
      raise ValueError(
        f"capacity={capacity} blocks cannot hold the largest request "
        f"({need} blocks of {block_size} tokens)"
      )
  if not from_tokens:
    _check_hash_ids(trace, block_size)
  return free_order


def general_hits(
  trace: Trace,
  block_size: int,
  capacities: Sequence[int],
  publish: str = "early",
  vllm_version: str = DEFAULT_VLLM_VERSION,
  policy: str | policies.EvictionPolicy = "lru",
  bucketed: bool = False,
) -> list[np.ndarray]:
  """``[R]`` int64 hit tokens per capacity through the general
  prefix-cache verbs (:data:`GENERAL_ENGINE`), for arguments
  :func:`replay_vllm` accepts, with any ``policy`` (``lru`` by default:
  the reference for :mod:`prefixjax.replay.vllm_engine`); ``vllm_version``
  picks the cache's ``free_order`` as in :func:`replay_vllm`, ``bucketed``
  as :data:`GENERAL_ENGINE`'s ``prepare`` (default: the trace's own
  shapes)."""
  free_order = vllm_free_order(vllm_version)
  name, _, chosen = frame.resolve_policy(policy)
  capacities = [int(c) for c in capacities]
  if not capacities:
    return []
  prepared = GENERAL_ENGINE.prepare(
    trace,
    capacities,
    block_size=block_size,
    policy=chosen,
    policy_name=name,
    publish=publish,
    free_order=free_order,
    bucketed=bucketed,
  )
  outputs, _ = frame.compile_and_run(GENERAL_ENGINE, prepared)
  return list(_general_hits(capacities, outputs, len(trace)))
