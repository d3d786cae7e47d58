"""Trace replay with vLLM v1 semantics through the on-device prefix cache.

Each request, one at a time and in order, runs through
:mod:`prefixjax.prefix_cache` exactly as vLLM v1's ``KVCacheManager`` with
prefix caching on serves a request alone: match its prompt (hits capped at
``prompt_len - 1`` tokens, whole blocks), touch the hits and allocate the
rest (popping the free-queue head and dropping popped blocks' old hashes),
publish the full prompt blocks, decode ``output_len - 1`` more tokens (the
last sampled token has no KV) and publish the blocks they fill, then release
the request's blocks tail first. The pool holds ``capacity`` usable blocks
plus the null block; policy ``lru`` (vLLM's free-queue order).

Token-id traces give exact block contents; when a request's output token ids
are not known, its outputs are given ids no prompt uses (``-1 - request``),
so output-filled blocks are cached but never hit. The whole replay is one
jitted ``lax.scan`` over requests per capacity.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax import hashing, paging
from prefixjax import prefix_cache as pc
from prefixjax.replay import ReplayPoint
from prefixjax.workloads import Trace

__all__ = ["PUBLISH_MODES", "replay_vllm"]


def _token_matrix(trace: Trace, block_size: int):
  """``[R, T]`` int32 prompt + output tokens, ``T`` a multiple of ``K``."""
  prompts = trace.input_token_ids
  outputs = trace.output_token_ids
  totals = trace.input_lengths + np.maximum(trace.output_lengths, 1) - 1
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
  return tokens, totals.astype(np.int32)


PUBLISH_MODES = ("early", "late")


@functools.partial(jax.jit, static_argnames="publish")
def _run(state: pc.PrefixCacheState, tokens, prompt_lens, totals, publish):
  block_size = state.paging.block_size
  seq = jnp.int32(0)

  def step(state, request):
    toks, p, total = request
    keys, _ = hashing.block_hashes(toks, total, block_size=block_size)
    state, alloc = pc._allocate_with_prefix(state, seq, keys, p)
    if publish == "early":  # as the prompt's blocks fill
      state, _ = pc._publish(state, seq, keys, p)
    state, _ = pc._append(state, seq, total - p)
    state, _ = pc._publish(state, seq, keys, total)
    state, _ = pc._release(state, seq)
    ok = alloc.status == paging.Status.OK
    return state, (jnp.where(ok, alloc.hit_tokens, 0), alloc.status)

  return jax.lax.scan(step, state, (tokens, prompt_lens, totals))


def replay_vllm(
  trace: Trace,
  *,
  block_size: int,
  capacities: Sequence[int],
  warmup_fraction: float = 0.5,
  publish: str = "early",
  timings: dict | None = None,
) -> list[ReplayPoint]:
  """Replays a token-id trace with vLLM v1 prefix-caching semantics.

  Args:
    trace: a trace with ``input_token_ids`` (token-id JSONL or generated).
    block_size: tokens per block.
    capacities: usable blocks in the pool (the null block is extra); each
      must hold the largest request (``ceil((P + O - 1) / K)`` blocks).
    warmup_fraction: share of requests before hits are counted.
    publish: ``"early"`` gives blocks their hashes as they fill (after
      prefill, then after decode), ``"late"`` only when the request
      finishes. With one request at a time both give the same hits; the
      switch matters once requests overlap.
    timings: if given, ``compile_s`` and ``run_s`` are added to it.

  Returns:
    One :class:`prefixjax.replay.ReplayPoint` per capacity, policy ``lru``.

  Raises:
    ValueError: no token ids, a bad size, or a capacity too small for the
      largest request.
  """
  if not trace.has_token_ids:
    raise ValueError(
      f"trace {trace.name!r} has no token ids: vLLM-semantics replay needs "
      "block contents (use a token-id trace or a generated workload)"
    )
  if not 0.0 <= warmup_fraction <= 1.0:
    raise ValueError(f"warmup_fraction={warmup_fraction} must be in [0, 1]")
  if publish not in PUBLISH_MODES:
    raise ValueError(f"publish={publish!r} is not one of {PUBLISH_MODES}")
  tokens, totals = _token_matrix(trace, block_size)
  max_blocks = tokens.shape[1] // block_size
  need = int(-(-int(totals.max()) // block_size))
  for capacity in capacities:
    if capacity < need:
      raise ValueError(
        f"capacity={capacity} blocks cannot hold the largest request "
        f"({need} blocks of {block_size} tokens)"
      )
  prompt_lens = np.asarray(trace.input_lengths, np.int32)
  warmup = int(np.floor(len(trace) * warmup_fraction))
  total_tokens = int(prompt_lens[warmup:].astype(np.int64).sum())
  args = (jnp.asarray(tokens), jnp.asarray(prompt_lens), jnp.asarray(totals))
  points = []
  for capacity in capacities:
    state = pc.init(
      int(capacity) + 1, block_size, max_seqs=1, max_blocks_per_seq=max_blocks
    )
    start = time.perf_counter()
    compiled = _run.lower(state, *args, publish=publish).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    _, (hits, status) = jax.block_until_ready(compiled(state, *args))
    run_s = time.perf_counter() - start
    if timings is not None:
      timings["compile_s"] = timings.get("compile_s", 0.0) + compile_s
      timings["run_s"] = timings.get("run_s", 0.0) + run_s
    status = np.asarray(status)
    if (status != paging.Status.OK).any():
      bad = int(np.flatnonzero(status != paging.Status.OK)[0])
      raise RuntimeError(
        f"request {bad} was refused ({paging.status_name(status[bad])}) "
        f"with capacity {capacity}"
      )
    hits = np.asarray(hits, np.int64)
    points.append(
      ReplayPoint(
        policy="lru",
        capacity_blocks=int(capacity),
        block_size=block_size,
        hit_tokens=int(hits[warmup:].sum()),
        total_tokens=total_tokens,
        measured_requests=len(trace) - warmup,
        underfilled=False,
        per_request_hit_tokens=hits,
      )
    )
  return points
