"""Trace replay with vLLM v1 semantics through the on-device prefix cache.

Each request, one at a time and in order, runs through
:mod:`prefixjax.cache.prefix_cache` exactly as vLLM v1's ``KVCacheManager`` with
prefix caching on serves a request alone: match its prompt (hits capped at
``prompt_len - 1`` tokens, whole blocks), touch the hits and allocate the
rest (popping the free-queue head and dropping popped blocks' old hashes),
publish the full prompt blocks, decode ``output_len - 1`` more tokens (the
last sampled token has no KV) and publish the blocks they fill, then release
the request's blocks tail first. The pool holds ``capacity`` usable blocks
plus the null block; policy ``lru`` (vLLM's free-queue order).

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

Two paths give these hits. :func:`replay_vllm` runs the specialised engine
of :mod:`prefixjax.replay.vllm_engine` (a few ``[M]``-wide steps per
request, keys numbered exactly on the host, the free queue as an ordered set
of release counters); the general-verb path described above is
:func:`general_hits`, the reference the specialised engine is tested
against.

Dimensions: ``R`` requests, ``T`` padded tokens per request, ``K`` block
size, ``M = T // K`` blocks per request (table columns).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax._host import to_device
from prefixjax.cache import hashing, paging
from prefixjax.cache import prefix_cache as pc
from prefixjax.cache.prefix_state import DEFAULT_VLLM_VERSION, vllm_free_order
from prefixjax.replay import frame, vllm_engine
from prefixjax.replay.frame import ReplayResult
from prefixjax.workloads import Trace

__all__ = ["FRESH_TAG", "PUBLISH_MODES", "general_hits", "replay_vllm"]

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


def _serve(state: pc.PrefixCacheState, keys, prompt_len, total, publish):
  """One request alone on sequence slot 0; ``keys`` ``[M, 2]`` uint32."""
  seq = jnp.int32(0)
  state, alloc = pc.allocate_with_prefix(state, seq, keys, prompt_len)
  if publish == "early":  # as the prompt's blocks fill
    state, _ = pc.publish(state, seq, keys, prompt_len)
  state, _ = pc.append(state, seq, total - prompt_len)
  state, _ = pc.publish(state, seq, keys, total)
  state, _ = pc.release(state, seq)
  ok = alloc.status == paging.Status.OK
  return state, (jnp.where(ok, alloc.hit_tokens, 0), alloc.status)


@functools.partial(jax.jit, static_argnames="publish")
def _run_tokens(state, tokens, prompt_lens, totals, publish):
  """Scan over requests given as ``[R, T]`` tokens."""
  block_size = state.paging.block_size

  def step(state, request):
    toks, p, total = request
    keys, _ = hashing.block_hashes(toks, total, block_size=block_size)
    return _serve(state, keys, p, total, publish)

  return jax.lax.scan(step, state, (tokens, prompt_lens, totals))


@functools.partial(jax.jit, static_argnames="publish")
def _run_keys(state, keys, prompt_lens, totals, publish):
  """Scan over requests given as ``[R, M, 2]`` content keys."""

  def step(state, request):
    return _serve(state, *request, publish)

  return jax.lax.scan(step, state, (keys, prompt_lens, totals))


def replay_vllm(
  trace: Trace,
  *,
  block_size: int,
  capacities: Sequence[int],
  warmup_fraction: float = 0.5,
  publish: str = "early",
  vllm_version: str = DEFAULT_VLLM_VERSION,
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

  Returns:
    A :class:`~prefixjax.replay.frame.ReplayResult`: one point per
    capacity, policy ``lru``, and the timing. The replay runs
    :data:`prefixjax.replay.vllm_engine.ENGINE`, compiled once for all
    capacities (see the module docstring).

  Raises:
    ValueError: no token ids and no hash ids, a block size other than a
      hash-id trace's, a negative hash id or one repeated within a
      request, a bad size, a capacity too small for the largest request,
      or a ``vllm_version`` not listed above.

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
  """
  if isinstance(block_size, bool) or not isinstance(
    block_size, int | np.integer
  ):
    raise TypeError(f"block_size must be an int, got {block_size!r}")
  if block_size < 1:
    raise ValueError(f"block_size={block_size} must be >= 1")
  block_size = int(block_size)
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
  free_order = vllm_free_order(vllm_version)
  if len(trace) == 0:
    raise ValueError(f"trace {trace.name!r} has no requests")
  capacities = frame.check_capacities(capacities)
  need = int(-(-int(trace.kv_tokens.max()) // block_size))
  for capacity in capacities:
    if capacity < need:
      raise ValueError(
        f"capacity={capacity} blocks cannot hold the largest request "
        f"({need} blocks of {block_size} tokens)"
      )
  if not from_tokens:
    _check_hash_ids(trace, block_size)
  capacities = [int(c) for c in capacities]
  prepared = vllm_engine.ENGINE.prepare(
    trace,
    capacities,
    block_size=block_size,
    warmup_fraction=warmup_fraction,
    free_order=free_order,
    bucketed=True,
  )
  return frame.execute(vllm_engine.ENGINE, prepared, capacities, devices)


def general_hits(
  trace: Trace,
  block_size: int,
  capacities: Sequence[int],
  publish: str = "early",
  vllm_version: str = DEFAULT_VLLM_VERSION,
) -> list[np.ndarray]:
  """``[R]`` int64 hit tokens per capacity through the general
  prefix-cache verbs, for arguments :func:`replay_vllm` accepts (the
  reference for :mod:`prefixjax.replay.vllm_engine`); ``vllm_version``
  picks the cache's ``free_order`` as in :func:`replay_vllm`."""
  free_order = vllm_free_order(vllm_version)
  from_tokens = trace.has_token_ids
  prompt_lens = np.asarray(trace.input_lengths, np.int32)
  totals = trace.kv_tokens.astype(np.int32)
  if from_tokens:
    run, blocks = _run_tokens, _token_matrix(trace, block_size, totals)
    max_blocks = blocks.shape[1] // block_size
  else:
    run, blocks = _run_keys, _key_matrix(trace, block_size, totals)
    max_blocks = blocks.shape[1]
  args = (to_device(blocks), to_device(prompt_lens), to_device(totals))
  result = []
  for capacity in capacities:
    state = pc.init(
      int(capacity) + 1,
      block_size,
      max_seqs=1,
      max_blocks_per_seq=max_blocks,
      free_order=free_order,
    )
    _, (hits, status) = run(state, *args, publish=publish)
    status = np.asarray(status)
    if (status != paging.Status.OK).any():
      bad = int(np.flatnonzero(status != paging.Status.OK)[0])
      raise RuntimeError(
        f"request {bad} was refused ({paging.status_name(status[bad])}) "
        f"with capacity {capacity}"
      )
    result.append(np.asarray(hits, np.int64))
  return result
