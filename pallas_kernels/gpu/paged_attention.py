"""GPU (Triton-style) variant of the paged flash kernel.

Grid ``(sequences, Hkv, splits)``; each program owns the ``[R, D]`` query
rows that read one KV head of one sequence (or group, or prefill tile) and
loops with ``lax.fori_loop`` over its split's blocks of ``pages_per_block``
pages, gathering their ids from its row of the block table. The splits'
partial states are merged exactly by log-sum-exp (split-K, as in JAX's GPU
paged attention) so a small batch still fills the GPU. Masking is identical
to the TPU variant (see :func:`pallas_kernels._common.online_softmax_step`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _common


def pad_rows(num_rows: int, interpret: Any) -> int:
  """Rows per block: as is when interpreting, else a power of two >= 16."""
  if interpret:
    return num_rows
  return max(16, 1 << (num_rows - 1).bit_length())


def compiler_params(interpret: Any, **kwargs: Any) -> Any:
  if interpret:
    return None
  from pallas_kernels._dispatch import gpu_compiler_params

  return gpu_compiler_params(**kwargs)


def split_plan(
  num_seqs: int,
  num_kv_heads: int,
  pages_per_seq: int,
  page_size: int,
  interpret: Any,
  pages_per_block: int | None = None,
) -> tuple[int, int, int]:
  """``(pages_per_block, blocks_per_split, num_splits)`` for a launch.

  Compiled: blocks of about 64 tokens and enough sequence splits for ~512
  programs (split-K, as in JAX's GPU paged attention), so a small batch still
  fills the GPU. Interpreted: two pages per block and one block per split,
  so CPU tests exercise the multi-page gather, the tail and the split merge.
  A variant with its own tile (the Mosaic GPU port) passes
  ``pages_per_block``; the split rule is the same.
  """
  if pages_per_block is None and interpret:
    pages_per_block = min(2, pages_per_seq)
  elif pages_per_block is None:
    pages_per_block = max(1, min(pages_per_seq, 64 // page_size))
  num_blocks = -(-pages_per_seq // pages_per_block)
  if interpret:
    num_splits = num_blocks
  else:
    wanted = -(-512 // (num_seqs * num_kv_heads))
    num_splits = max(1, min(num_blocks, wanted))
  blocks_per_split = -(-num_blocks // num_splits)
  num_splits = -(-num_blocks // blocks_per_split)
  return pages_per_block, blocks_per_split, num_splits


def paged_flash_kernel(
  q_ref,  # [R, D]
  k_ref,  # [N, K, D]
  v_ref,  # [N, K, D]
  tables_ref,  # [P'] int32 (padded to whole splits)
  kv_lengths_ref,  # [1] int32
  first_pos_ref,  # [1] int32
  o_ref,  # [R, D] f32
  lse_ref,  # [R] f32
  *,
  scale: float,
  rows_per_token: int,
  pages_per_block: int,
  blocks_per_split: int,
):
  """Flash attention of one (sequence, KV head, split) over its pages."""
  num_rows, head_dim = q_ref.shape
  page_size = k_ref.shape[1]
  block_k = pages_per_block * page_size
  kv_length = kv_lengths_ref[0]
  q = q_ref[...].astype(jnp.float32) * scale
  row = lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0)
  row_pos = first_pos_ref[0] + row // rows_per_token
  slot = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
  v_slot = lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)

  def body(block, carry):
    m, denom, acc = carry
    page_ids = tables_ref[pl.ds(block * pages_per_block, pages_per_block)]
    k = k_ref[page_ids].reshape(block_k, head_dim)
    v = v_ref[page_ids].reshape(block_k, head_dim)
    start = block * block_k
    kv_pos = start + slot
    valid = (kv_pos <= row_pos) & (kv_pos < kv_length)
    return _common.online_softmax_step(
      m, denom, acc, q, k, v, valid, start + v_slot < kv_length
    )

  init = (
    jnp.full((num_rows, 1), -jnp.inf, jnp.float32),
    jnp.zeros((num_rows, 1), jnp.float32),
    jnp.zeros((num_rows, head_dim), jnp.float32),
  )
  first_block = pl.program_id(2) * blocks_per_split
  last_block = jnp.minimum(
    first_block + blocks_per_split, pl.cdiv(kv_length, block_k)
  )
  m, denom, acc = lax.fori_loop(first_block, last_block, body, init)
  o, lse = _common.finalize(m, denom, acc)
  o_ref[...] = o.astype(o_ref.dtype)
  lse_ref[...] = lse[:, 0]


def paged_flash_launch(
  q: jax.Array,  # [S, Hkv, R, D]
  k_pages: jax.Array,  # [Hkv, N, K, D]
  v_pages: jax.Array,  # [Hkv, N, K, D]
  block_tables: jax.Array,  # [S, P] int32
  kv_lengths: jax.Array,  # [S] int32
  first_pos: jax.Array,  # [S] int32
  *,
  scale: float,
  rows_per_token: int,
  interpret: Any,
) -> tuple[jax.Array, jax.Array]:
  """One launch; returns ``(o [S, Hkv, R, D] f32, lse [S, Hkv, R, 1])``.

  Grid ``(S, Hkv, splits)``: each program covers a contiguous range of page
  blocks; the per-split states are merged exactly by their log-sum-exps.
  """
  num_seqs, num_kv_heads, num_rows, head_dim = q.shape
  _, num_pages, page_size, _ = k_pages.shape
  pages_per_seq = block_tables.shape[1]
  pages_per_block, blocks_per_split, num_splits = split_plan(
    num_seqs, num_kv_heads, pages_per_seq, page_size, interpret
  )
  padded = num_splits * blocks_per_split * pages_per_block
  if padded != pages_per_seq:
    # Null-page padding: never read past the length, so never unmasked.
    block_tables = jnp.pad(block_tables, ((0, 0), (0, padded - pages_per_seq)))
  rows = pad_rows(num_rows, interpret)
  if rows != num_rows:
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - num_rows), (0, 0)))
  kernel = functools.partial(
    paged_flash_kernel,
    scale=scale,
    rows_per_token=rows_per_token,
    pages_per_block=pages_per_block,
    blocks_per_split=blocks_per_split,
  )
  pool_spec = pl.BlockSpec(
    (None, num_pages, page_size, head_dim), lambda s, h, c: (h, 0, 0, 0)
  )
  o, lse = pl.pallas_call(
    kernel,
    grid=(num_seqs, num_kv_heads, num_splits),
    in_specs=[
      pl.BlockSpec((None, None, rows, head_dim), lambda s, h, c: (s, h, 0, 0)),
      pool_spec,
      pool_spec,
      pl.BlockSpec((None, padded), lambda s, h, c: (s, 0)),
      pl.BlockSpec((1,), lambda s, h, c: (s,)),
      pl.BlockSpec((1,), lambda s, h, c: (s,)),
    ],
    out_specs=[
      pl.BlockSpec(
        (None, None, None, rows, head_dim), lambda s, h, c: (s, h, c, 0, 0)
      ),
      pl.BlockSpec((None, None, None, rows), lambda s, h, c: (s, h, c, 0)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct(
        (num_seqs, num_kv_heads, num_splits, rows, head_dim), jnp.float32
      ),
      jax.ShapeDtypeStruct(
        (num_seqs, num_kv_heads, num_splits, rows), jnp.float32
      ),
    ],
    compiler_params=compiler_params(interpret, num_warps=4, num_stages=2),
    interpret=interpret,
    name="paged_flash_attention_gpu",
  )(q, k_pages, v_pages, block_tables, kv_lengths, first_pos)
  o, lse = merge_splits(o[..., :num_rows, :], lse[..., :num_rows])
  return o, lse[..., None]


def merge_splits(
  o: jax.Array,  # [S, Hkv, splits, R, D] f32
  lse: jax.Array,  # [S, Hkv, splits, R] f32
) -> tuple[jax.Array, jax.Array]:
  """Exact merge over the split axis; empty splits (``-inf``) are neutral."""
  m = jnp.max(lse, axis=2, keepdims=True)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  weight = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse - m_safe))
  total = jnp.sum(weight, axis=2)  # [S, Hkv, R]
  nonempty = total > 0.0
  total_safe = jnp.where(nonempty, total, 1.0)
  merged = jnp.sum(weight[..., None] * o, axis=2) / total_safe[..., None]
  merged_lse = jnp.where(
    nonempty, m_safe[:, :, 0] + jnp.log(total_safe), -jnp.inf
  )
  return merged, merged_lse


def row_blocking(
  num_rows: int, rows_per_token: int, max_rows: int
) -> tuple[int, int, bool]:
  """``(rows_per_block, num_row_blocks, single_token)`` for ``R`` rows.

  A program holds a ``[rows, D]`` float32 accumulator in registers, so
  large query blocks (a shared-prefix group of many requests) are cut into
  blocks of at most ``max_rows`` rows (64 compiled, 8 when interpreting, to
  exercise the path); each block re-reads the group's pages, still far
  fewer reads than one per request. Multi-token blocks hold whole tokens.
  """
  single_token = rows_per_token >= num_rows
  if single_token:
    rows = min(num_rows, max_rows)
  else:
    rows = rows_per_token * max(1, max_rows // rows_per_token)
    rows = min(rows, -(-num_rows // rows_per_token) * rows_per_token)
  return rows, -(-num_rows // rows), single_token


def max_block_rows(interpret: Any) -> int:
  """Rows per program: 64 compiled, 8 interpreted (exercises the folding)."""
  return 8 if interpret else 64


def paged_flash_unbatched(
  q: jax.Array,  # [S, Hkv, R, D]
  k_pages: jax.Array,  # [Hkv, N, K, D]
  v_pages: jax.Array,  # [Hkv, N, K, D]
  block_tables: jax.Array,  # [S, P] int32
  kv_lengths: jax.Array,  # [S] int32
  first_pos: jax.Array,  # [S] int32
  *,
  scale: float,
  rows_per_token: int,
  interpret: Any,
) -> tuple[jax.Array, jax.Array]:
  """GPU variant; returns ``(o [S, Hkv, R, D] f32, lse [S, Hkv, R, 1])``."""
  return fold_row_blocks(
    paged_flash_launch,
    q,
    k_pages,
    v_pages,
    block_tables,
    kv_lengths,
    first_pos,
    scale=scale,
    rows_per_token=rows_per_token,
    max_rows=max_block_rows(interpret),
    interpret=interpret,
  )


def fold_row_blocks(
  launch: Any,
  q: jax.Array,  # [S, Hkv, R, D]
  k_pages: jax.Array,  # [Hkv, N, K, D]
  v_pages: jax.Array,  # [Hkv, N, K, D]
  block_tables: jax.Array,  # [S, P] int32
  kv_lengths: jax.Array,  # [S] int32
  first_pos: jax.Array,  # [S] int32
  *,
  scale: float,
  rows_per_token: int,
  max_rows: int,
  interpret: Any,
) -> tuple[jax.Array, jax.Array]:
  """Runs ``launch`` over query rows cut into blocks of <= ``max_rows``.

  Cuts the query rows into blocks (:func:`row_blocking`), folds the blocks
  into the sequence axis of one launch, and unfolds the result. ``launch``
  has :func:`paged_flash_launch`'s signature (the Mosaic GPU variant's too).
  """
  num_seqs, num_kv_heads, num_rows, head_dim = q.shape
  rows, num_blocks, single_token = row_blocking(
    num_rows, rows_per_token, max_rows
  )
  if num_blocks == 1:
    return launch(
      q,
      k_pages,
      v_pages,
      block_tables,
      kv_lengths,
      first_pos,
      scale=scale,
      rows_per_token=rows_per_token,
      interpret=interpret,
    )
  padded = rows * num_blocks
  q = jnp.pad(q, ((0, 0), (0, 0), (0, padded - num_rows), (0, 0)))
  q = q.reshape(num_seqs, num_kv_heads, num_blocks, rows, head_dim)
  q = q.transpose(0, 2, 1, 3, 4).reshape(
    num_seqs * num_blocks, num_kv_heads, rows, head_dim
  )
  block = jnp.arange(num_blocks, dtype=jnp.int32)
  if single_token:
    offsets = jnp.zeros((num_blocks,), jnp.int32)
  else:
    offsets = block * (rows // rows_per_token)
  first = (first_pos[:, None] + offsets[None, :]).reshape(-1)
  o, lse = launch(
    q,
    k_pages,
    v_pages,
    jnp.repeat(block_tables, num_blocks, axis=0),
    jnp.repeat(kv_lengths, num_blocks),
    first,
    scale=scale,
    rows_per_token=rows if single_token else rows_per_token,
    interpret=interpret,
  )

  def unfold(x):  # [S * nb, Hkv, rows, X] -> [S, Hkv, R, X]
    x = x.reshape(num_seqs, num_blocks, num_kv_heads, rows, x.shape[-1])
    x = x.transpose(0, 2, 1, 3, 4)
    return x.reshape(num_seqs, num_kv_heads, padded, -1)[:, :, :num_rows]

  return unfold(o), unfold(lse)
