"""The model's forward pass over the paged KV pool, one engine step at a time.

An engine step (:func:`prefixjax.serving.vllm_v1.schedule`) gives each
scheduled request a run of new tokens ``[computed, computed + n)``. Here that
work is cut on block boundaries into **chunks**: one chunk is one block ``b``
of one request, a ``[K]`` row of token ids whose row ``r`` is position
``b * K + r``, with the rows ``[lo, hi)`` new this step. A step has at most
``C = ceil(max_num_batched_tokens / K) + max_num_seqs`` chunks (each
request's run adds at most one partial block at each end), the static size
of every array here, so one compiled program serves every step.

Per layer: the chunks' queries, keys and values
(:meth:`prefixjax.model.llama.Llama.attention_inputs`), the new rows' K/V
written into their pages (:func:`pallas_kernels.write_kv`), attention of the
chunk's rows over its request's pages (every page up to ``b``, the new rows
already in place), then the output projection and MLP
(:meth:`~prefixjax.model.llama.Llama.attention_output`). The logits of row
``hi - 1`` of every chunk come back; the engine samples from the chunks that
end a request's known tokens.

Two modes:

* ``batch_invariant=True`` (default): every chunk is computed alone by the
  same compiled body (``jax.lax.map`` over chunks: projections and MLP on
  ``[K, d]``, attention by :func:`pallas_kernels.prefill_attention` over the
  one chunk with its rows at their in-block offsets). A token's bits then
  depend only on its own tokens, position and the pages it reads, not on
  which chunk slot it took, what else is in the step, or whether its prefix
  pages were computed now or read from the cache: the prefix pages hold the
  bits this program wrote when another request (or an earlier call)
  computed them. Decode tokens are chunks with one new row and read their
  pages with the same kernel and page order as prefill. The cost: chunks
  run one after another (no batching across requests), and a decode token
  pays for a whole ``[K]`` chunk of projections.
* ``batch_invariant=False``: one ``[C * K, d]`` matmul per projection for
  all chunks, prefill attention over the packed new rows of every chunk
  (:func:`pallas_kernels.prefill_attention`, ragged) and, for chunks of one
  new row, decode attention grouped by the leading pages their requests
  share (:func:`pallas_kernels.shared_prefix_attention`: a shared page is
  read once per group; its log-sum-exp merge rounds differently), or
  :func:`pallas_kernels.paged_attention` in a step where no two share. Results
  agree with the invariant mode to float32 rounding, not bitwise.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from prefixjax import _struct as struct
from prefixjax.configs import DTYPE_BYTES, ModelConfig
from prefixjax.model.llama import Llama

__all__ = ["Chunks", "KVPool", "forward", "init_pool", "max_chunks"]

_JNP_DTYPES = {
  "float32": jnp.float32,
  "bfloat16": jnp.bfloat16,
  "float16": jnp.float16,
}


def jnp_dtype(config: ModelConfig):
  """The jnp dtype of ``config.dtype``."""
  if config.dtype not in _JNP_DTYPES:
    raise ValueError(
      f"ModelConfig.dtype={config.dtype!r}: the engine runs "
      f"{tuple(_JNP_DTYPES)} (of {tuple(DTYPE_BYTES)})"
    )
  return _JNP_DTYPES[config.dtype]


@struct.dataclass
class KVPool:
  """The paged KV cache of every layer.

  Attributes:
    k: ``[L, Hkv, N, K, Dh]`` key pages (``N`` blocks of ``K`` slots).
    v: ``[L, Hkv, N, K, Dh]`` value pages.
  """

  k: jax.Array
  v: jax.Array


def init_pool(config: ModelConfig, num_blocks: int, block_size: int) -> KVPool:
  """A zero-filled pool for ``num_blocks`` blocks of ``block_size`` tokens."""
  shape = (
    config.num_layers,
    config.num_kv_heads,
    num_blocks,
    block_size,
    config.head_dim,
  )
  dtype = jnp_dtype(config)
  return KVPool(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


@struct.dataclass
class Chunks:
  """One step's work, ``C`` chunks (unused chunks have ``hi == lo == 0``).

  Attributes:
    tokens: ``[C, K]`` int32 token ids of the chunk's block (row ``r`` is
      position ``block * K + r``; rows past ``hi`` are padding).
    table: ``[C, M]`` int32 the request's block table (page ids).
    block: ``[C]`` int32 the block's index ``b`` in the request.
    lo, hi: ``[C]`` int32 the rows new this step, ``[lo, hi)``.
    group: ``[C]`` int32 decode group of each chunk (the batched mode's
      :func:`pallas_kernels.shared_prefix_attention`): chunks of one new
      row whose requests share leading pages point at the group's first
      chunk; every other chunk is its own group.
    shared: ``[C]`` int32 full pages the chunk's group shares (0 alone).
  """

  tokens: jax.Array
  table: jax.Array
  block: jax.Array
  lo: jax.Array
  hi: jax.Array
  group: jax.Array
  shared: jax.Array


def max_chunks(block_size: int, max_num_batched_tokens: int, max_seqs: int):
  """``C``: the most chunks one step can have."""
  return -(-max_num_batched_tokens // block_size) + max_seqs


def plan_chunks(
  runs: list[tuple[int, int, np.ndarray, np.ndarray]],
  block_size: int,
  num_chunks: int,
  max_blocks: int,
) -> tuple[dict[str, np.ndarray], list[int]]:
  """Cuts each request's run of new tokens on block boundaries.

  Args:
    runs: per scheduled request ``(start, stop, tokens, table)``: positions
      ``[start, stop)`` are new, ``tokens`` holds at least ``stop`` ids,
      ``table`` its ``[M]`` page ids.
    block_size: ``K``.
    num_chunks: ``C``.
    max_blocks: ``M``.

  Returns:
    ``(arrays of a Chunks, last)`` where ``last[i]`` is the chunk holding
    run ``i``'s final new token.

  Raises:
    ValueError: more than ``C`` chunks (a scheduler that broke its budget).
  """
  k = block_size
  tokens = np.zeros((num_chunks, k), np.int32)
  table = np.zeros((num_chunks, max_blocks), np.int32)
  block = np.zeros((num_chunks,), np.int32)
  lo = np.zeros((num_chunks,), np.int32)
  hi = np.zeros((num_chunks,), np.int32)
  last = []
  c = 0
  for start, stop, toks, tab in runs:
    for b in range(start // k, (stop - 1) // k + 1):
      if c == num_chunks:
        raise ValueError(f"a step needs more than C={num_chunks} chunks")
      row = toks[b * k : (b + 1) * k]
      tokens[c, : len(row)] = row
      table[c] = tab
      block[c] = b
      lo[c] = max(start, b * k) - b * k
      hi[c] = min(stop, (b + 1) * k) - b * k
      c += 1
    last.append(c - 1)
  group, shared = _decode_groups(table, block, lo, hi)
  arrays = dict(
    tokens=tokens,
    table=table,
    block=block,
    lo=lo,
    hi=hi,
    group=group,
    shared=shared,
  )
  return arrays, last


def _decode_groups(table, block, lo, hi):
  """Groups the one-row chunks by the pages their requests share.

  Chunks whose first page is the same form a group; it shares the longest
  run of equal leading pages among its members, counting only pages before
  every member's current block (full pages). Others are groups of one.
  """
  num = table.shape[0]
  group = np.arange(num, dtype=np.int32)
  shared = np.zeros((num,), np.int32)
  by_page: dict[int, list[int]] = {}
  for c in range(num):
    if hi[c] - lo[c] == 1 and block[c] > 0:
      by_page.setdefault(int(table[c, 0]), []).append(c)
  for members in by_page.values():
    if len(members) < 2:
      continue
    width = int(min(block[c] for c in members))
    rows = table[members, :width]
    same = np.all(rows == rows[:1], axis=0)
    n = width if same.all() else int(np.argmin(same))
    group[members] = members[0]
    shared[members] = n
  return group, shared


def has_groups(arrays: dict[str, np.ndarray]) -> bool:
  """Whether some decode group of :func:`plan_chunks`'s arrays has two
  members sharing a page."""
  group = arrays["group"]
  return bool(np.any((group != np.arange(group.size)) & (arrays["shared"] > 0)))


def _slots(chunks: Chunks, block_size: int) -> jax.Array:
  """``[C * K]`` write slots of the new rows (``page * K + row``), else -1."""
  k = block_size
  row = jnp.arange(k, dtype=jnp.int32)[None, :]
  page = jnp.take_along_axis(chunks.table, chunks.block[:, None], axis=1)
  new = (row >= chunks.lo[:, None]) & (row < chunks.hi[:, None])
  return jnp.where(new, page * k + row, -1).reshape(-1)


@functools.partial(
  jax.jit,
  static_argnames=(
    "model",
    "batch_invariant",
    "shared_decode",
    "backend",
    "interpret",
  ),
  donate_argnames=("pool",),
)
def forward(
  model: Llama,
  params: Any,
  pool: KVPool,
  chunks: Chunks,
  *,
  batch_invariant: bool = True,
  shared_decode: bool = True,
  backend: str | None = None,
  interpret: Any = False,
) -> tuple[jax.Array, KVPool]:
  """One step of the model over ``chunks``; writes their new K/V.

  Args:
    model: the :class:`~prefixjax.model.llama.Llama` module (static).
    params: its variables.
    pool: the KV pool (donated: the returned pool replaces it).
    chunks: the step's work.
    batch_invariant: see the module docstring (static).
    shared_decode: the batched mode's decode kernel (static):
      :func:`pallas_kernels.shared_prefix_attention` over ``chunks.group``
      (True) or :func:`pallas_kernels.paged_attention` (False: no group has
      two members, :func:`has_groups`).
    backend, interpret: passed to every :mod:`pallas_kernels` call
      (static).

  Returns:
    ``(logits [C, V] float32 of row hi - 1 of every chunk, new pool)``.
  """
  cfg = model.config
  num_chunks, k = chunks.tokens.shape
  kern = dict(backend=backend, interpret=interpret)
  positions = chunks.block[:, None] * k + jnp.arange(k, dtype=jnp.int32)[None]
  slots = _slots(chunks, k)
  kv_len = chunks.block * k + chunks.hi  # [C] tokens up to the last new row

  def call(method, *args):
    return model.apply(params, *args, method=method)

  x = call(Llama.embed_tokens, chunks.tokens)  # [C, K, d]
  k_all, v_all = pool.k, pool.v
  for layer in range(cfg.num_layers):
    if batch_invariant:
      q, kk, vv = jax.lax.map(
        lambda a, layer=layer: call(Llama.attention_inputs, layer, *a),
        (x, positions),
      )
    else:
      q, kk, vv = call(
        Llama.attention_inputs,
        layer,
        x.reshape(num_chunks * k, -1),
        positions.reshape(-1),
      )
      q = q.reshape(num_chunks, k, *q.shape[1:])
    kp, vp = pk.write_kv(
      k_all[layer],
      v_all[layer],
      kk.reshape(num_chunks * k, *kk.shape[-2:]),
      vv.reshape(num_chunks * k, *vv.shape[-2:]),
      slots,
      **kern,
    )
    k_all, v_all = k_all.at[layer].set(kp), v_all.at[layer].set(vp)
    if batch_invariant:
      attn = _attend_invariant(q, kp, vp, chunks, kv_len, kern)
    else:
      attn = _attend_batched(q, kp, vp, chunks, kv_len, kern, shared_decode)
    if batch_invariant:
      x = jax.lax.map(
        lambda a, layer=layer: call(Llama.attention_output, layer, *a),
        (x, attn),
      )
    else:
      x = call(
        Llama.attention_output,
        layer,
        x.reshape(num_chunks * k, -1),
        attn.reshape(num_chunks * k, *attn.shape[2:]),
      ).reshape(num_chunks, k, -1)
  last = jnp.clip(chunks.hi - 1, 0, k - 1)
  x_last = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [C, 1, d]
  if batch_invariant:
    logits = jax.lax.map(lambda r: call(Llama.logits, r), x_last)[:, 0]
  else:
    logits = call(Llama.logits, x_last[:, 0])
  return logits, KVPool(k=k_all, v=v_all)


def _attend_invariant(q, kp, vp, chunks, kv_len, kern):
  """Each chunk alone: its rows ``0 .. hi - 1`` at positions ``b * K + r``."""
  k = q.shape[1]

  def one(args):
    q_c, table, n, hi = args
    return pk.prefill_attention(
      q_c,
      kp,
      vp,
      table[None],
      n[None],
      jnp.stack([jnp.int32(0), hi]),
      block_q=k,
      **kern,
    )

  return jax.lax.map(one, (q, chunks.table, kv_len, chunks.hi))


def _attend_batched(q, kp, vp, chunks, kv_len, kern, shared_decode):
  """Packed prefill over every chunk's new rows; decode kernel for 1-row
  chunks."""
  num_chunks, k = q.shape[:2]
  n_new = chunks.hi - chunks.lo
  cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(n_new)])
  cu = cu.astype(jnp.int32)
  row = jnp.arange(k, dtype=jnp.int32)[None, :]
  new = (row >= chunks.lo[:, None]) & (row < chunks.hi[:, None])
  dest = jnp.where(new, cu[:-1, None] + row - chunks.lo[:, None], -1)
  flat_q = q.reshape(num_chunks * k, *q.shape[2:])
  packed = jnp.zeros_like(flat_q).at[dest.reshape(-1)].set(flat_q, mode="drop")
  o = pk.prefill_attention(
    packed, kp, vp, chunks.table, kv_len, cu, block_q=k, **kern
  )
  o = jnp.where(
    new.reshape(-1)[:, None, None], o[jnp.maximum(dest.reshape(-1), 0)], 0
  ).reshape(q.shape)
  # Decode: one new row, the last of the chunk; a group's shared pages are
  # read once for all its members.
  last = jnp.clip(chunks.hi - 1, 0, k - 1)
  q_last = jnp.take_along_axis(q, last[:, None, None, None], axis=1)[:, 0]
  if shared_decode:
    width = chunks.table.shape[1]
    column = jnp.arange(width, dtype=jnp.int32)[None, :]
    suffix = jnp.take_along_axis(
      chunks.table,
      jnp.minimum(column + chunks.shared[:, None], width - 1),
      axis=1,
    )
    dec = pk.shared_prefix_attention(
      q_last,
      kp,
      vp,
      chunks.table,
      chunks.shared * k,
      chunks.group,
      suffix,
      kv_len - chunks.shared * k,
      max_group_size=num_chunks,
      **kern,
    )
  else:
    dec = pk.paged_attention(q_last, kp, vp, chunks.table, kv_len, **kern)
  one_row = (n_new == 1)[:, None, None, None] & (row == last[:, None])[
    ..., None, None
  ]
  return jnp.where(one_row, dec[:, None], o)
