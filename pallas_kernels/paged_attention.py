"""Paged decode attention over a `[Hkv, N, K, D]` page pool.

Layouts (letters as in :mod:`pallas_kernels._common`):

* ``q``: ``[B, Hq, D]``, one new token per request; ``Hq = g * Hkv`` and query
  head ``j`` reads KV head ``j // g`` (JAX's GQA convention).
* ``k_pages``, ``v_pages``: ``[Hkv, N, K, D]`` (the layout of JAX's own Pallas
  ``paged_attention``). Page 0 is the null page that pads block tables.
* ``block_tables``: int32 ``[B, P]``; position ``t`` of request ``b`` lives in
  page ``block_tables[b, t // K]`` at offset ``t % K``.
* ``lengths``: int32 ``[B]`` in ``[0, P * K]``; a request of length 0 gets
  ``o = 0`` and ``lse = -inf`` (the neutral element of
  :func:`~pallas_kernels.merge_attention_states`).
* Outputs: ``o`` ``[B, Hq, D]`` in ``q.dtype``; ``lse`` ``[B, Hq]`` float32,
  the natural-log log-sum-exp of the scaled scores.

All arithmetic is float32 (inputs are upcast in the kernel), so results
differ from a float64 computation on the same inputs only by float32
accumulation and, for bf16, by rounding the output to bf16. Stated
tolerances (max abs = rel, ``tests/test_kernels_support.py``): float32
``2e-5`` against the reference and ``1e-4`` against float64; bfloat16
``2e-2`` against the reference and ``3e-2`` against float64; the float32
``lse`` ``1e-4`` in both dtypes.

Kernel (the TPU variant): grid ``(sequences, Hkv, page blocks)``. Block
tables, lengths and each row's first query position are scalar-prefetched
into SMEM; the K/V BlockSpec index maps read the prefetched table, so the
pipeline DMAs ``pages_per_block`` ``[K, D]`` pages per step (about 128
tokens; 2 pages in interpret mode) and, past a sequence's last page, keeps
pointing at that last page (an unchanged block index is not re-fetched), so
unused table entries cost neither DMA nor compute. The query block is
``[R, D]``: every query row that reads the same KV head (``R = g`` for decode;
``R = members * g`` for a shared-prefix group; ``R = tile * g`` for prefill),
so a page loaded once serves all of them. The same kernel body, with a causal
mask driven by ``rows_per_token`` and ``first_pos``, serves decode, the
shared-prefix pass and chunked prefill.

Bytes model (used by ``benchmarks/kernels.py``): K and V of the pages read
(``2 * Hkv * K * D * itemsize`` each), counting each unique page once, plus q
and o.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _common
from pallas_kernels._dispatch import (
  gpu_variant,
  reference_when_empty,
  resolve_backend,
)


def paged_flash_kernel(
  kv_lengths_ref,  # [S] int32, SMEM
  first_pos_ref,  # [S] int32, SMEM
  tables_ref,  # [S * P'] int32, SMEM
  q_ref,  # [R, D]
  *refs,  # k pages x ppb: [K, D]; v pages x ppb: [K, D]; then outputs
  scale: float,
  rows_per_token: int,
  pages_per_block: int,
):
  """Flash-attention step of sequence ``program_id(0)`` over one page block.

  ``refs`` holds ``pages_per_block`` K page refs (``[K, D]``), as many V page
  refs, the outputs ``o [R, D]`` (f32) and ``lse [R, 1]`` (f32), and the
  scratch ``m [R, 1]``, ``l [R, 1]``, ``acc [R, D]`` (f32, VMEM). Query row
  ``r`` sits at position ``first_pos + r // rows_per_token`` and sees the
  slots at positions ``<=`` its own and ``< kv_length``.
  """
  k_refs = refs[:pages_per_block]
  v_refs = refs[pages_per_block : 2 * pages_per_block]
  o_ref, lse_ref, m_ref, l_ref, acc_ref = refs[2 * pages_per_block :]
  seq, block = pl.program_id(0), pl.program_id(2)
  page_size = k_refs[0].shape[0]
  block_k = pages_per_block * page_size
  num_rows = q_ref.shape[0]
  kv_length = kv_lengths_ref[seq]

  @pl.when(block == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(block * block_k < kv_length)
  def _step():
    q = q_ref[...].astype(jnp.float32) * scale
    k = jnp.concatenate([ref[...] for ref in k_refs], axis=0)  # [bk, D]
    v = jnp.concatenate([ref[...] for ref in v_refs], axis=0)  # [bk, D]
    start = block * block_k
    kv_pos = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    row = lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0)
    row_pos = first_pos_ref[seq] + row // rows_per_token
    valid = (kv_pos <= row_pos) & (kv_pos < kv_length)
    v_pos = start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
    m, denom, acc = _common.online_softmax_step(
      m_ref[...],
      l_ref[...],
      acc_ref[...],
      q,
      k,
      v,
      valid,
      v_pos < kv_length,
    )
    m_ref[...], l_ref[...], acc_ref[...] = m, denom, acc

  @pl.when(block == pl.num_programs(2) - 1)
  def _finish():
    o, lse = _common.finalize(m_ref[...], l_ref[...], acc_ref[...])
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


def tpu_pages_per_block(
  pages_per_seq: int, page_size: int, interpret: Any
) -> int:
  """Pages per grid step: ~128 tokens compiled, 2 interpreted (covers the
  multi-page and tail paths in CPU tests)."""
  if interpret:
    return min(2, pages_per_seq)
  return max(1, min(pages_per_seq, 128 // page_size))


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
  """TPU grid setup; returns ``(o [S, Hkv, R, D] f32, lse [S, Hkv, R, 1])``.

  Grid ``(S, Hkv, blocks)``; each step brings ``pages_per_block`` pages of K
  and of V through one BlockSpec each (the same pool passed several times),
  whose index maps read the scalar-prefetched table.
  """
  num_seqs, num_kv_heads, num_rows, head_dim = q.shape
  page_size = k_pages.shape[2]
  pages_per_block = tpu_pages_per_block(
    block_tables.shape[1], page_size, interpret
  )
  num_blocks = -(-block_tables.shape[1] // pages_per_block)
  pages_per_seq = num_blocks * pages_per_block
  if pages_per_seq != block_tables.shape[1]:
    block_tables = jnp.pad(
      block_tables, ((0, 0), (0, pages_per_seq - block_tables.shape[1]))
    )

  def kv_index(j):
    def index(seq, head, block, kv_lengths_ref, first_pos_ref, tables_ref):
      del first_pos_ref
      # Past the last page, keep pointing at it: an unchanged block index is
      # not fetched again, so unused table entries cost no DMA.
      last = jnp.maximum(pl.cdiv(kv_lengths_ref[seq], page_size) - 1, 0)
      page = jnp.minimum(block * pages_per_block + j, last)
      return head, tables_ref[seq * pages_per_seq + page], 0, 0

    return pl.BlockSpec((None, None, page_size, head_dim), index)

  def row_index(seq, head, block, *_):
    return seq, head, 0, 0

  kv_specs = [kv_index(j) for j in range(pages_per_block)]
  q_spec = pl.BlockSpec((None, None, num_rows, head_dim), row_index)
  lse_spec = pl.BlockSpec((None, None, num_rows, 1), row_index)
  kernel = functools.partial(
    paged_flash_kernel,
    scale=scale,
    rows_per_token=rows_per_token,
    pages_per_block=pages_per_block,
  )
  return pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3,
      grid=(num_seqs, num_kv_heads, num_blocks),
      in_specs=[q_spec, *kv_specs, *kv_specs],
      out_specs=[q_spec, lse_spec],
      scratch_shapes=[
        pltpu.VMEM((num_rows, 1), jnp.float32),
        pltpu.VMEM((num_rows, 1), jnp.float32),
        pltpu.VMEM((num_rows, head_dim), jnp.float32),
      ],
    ),
    out_shape=[
      jax.ShapeDtypeStruct(q.shape, jnp.float32),
      jax.ShapeDtypeStruct((*q.shape[:-1], 1), jnp.float32),
    ],
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "arbitrary")
    ),
    interpret=interpret,
    name="paged_flash_attention",
  )(
    kv_lengths,
    first_pos,
    block_tables.reshape(-1),
    q,
    *([k_pages] * pages_per_block),
    *([v_pages] * pages_per_block),
  )


def paged_flash(
  q: jax.Array,  # [S, Hkv, R, D]
  k_pages: jax.Array,
  v_pages: jax.Array,
  block_tables: jax.Array,  # [S, P]
  kv_lengths: jax.Array,  # [S]
  first_pos: jax.Array,  # [S]
  *,
  scale: float,
  rows_per_token: int,
  backend: str,
  interpret: Any,
) -> tuple[jax.Array, jax.Array]:
  """The shared Pallas entry point: TPU or GPU variant of the flash kernel."""
  impl = (
    paged_flash_unbatched
    if backend == "pallas_tpu"
    else gpu_variant("paged_attention").paged_flash_unbatched
  )
  return impl(
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


def decode_outputs(
  q: jax.Array,  # [B, Hq, D]
  o: jax.Array,  # [B, Hkv, g, D] (or any shape of B * Hq * D elements)
  lse: jax.Array,  # [B, Hkv, g, 1] (or any shape of B * Hq elements)
  return_lse: bool,
):
  """Per-KV-head results back to ``o [B, Hq, D]`` in ``q.dtype`` and, if
  ``return_lse``, ``lse [B, Hq]``: the public decode kernels' outputs."""
  batch, num_q_heads, head_dim = q.shape
  o = o.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
  lse = lse.reshape(batch, num_q_heads)
  return (o, lse) if return_lse else o


def paged_attention_reference(
  q: jax.Array,
  k_pages: jax.Array,
  v_pages: jax.Array,
  block_tables: jax.Array,
  lengths: jax.Array,
  *,
  scale: float | None = None,
  return_lse: bool = False,
):
  """Plain-``jnp`` paged decode attention (same contract as the kernel)."""
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  scale = _common.default_scale(scale, head_dim)
  max_len = block_tables.shape[1] * page_size
  # [Hkv, B, P, K, D] -> [B, Hkv, L, D]
  k = k_pages[:, block_tables].reshape(num_kv_heads, batch, max_len, head_dim)
  v = v_pages[:, block_tables].reshape(num_kv_heads, batch, max_len, head_dim)
  k = jnp.swapaxes(k, 0, 1).astype(jnp.float32)
  v = jnp.swapaxes(v, 0, 1).astype(jnp.float32)
  qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32)
  scores = jnp.einsum(
    "bhgd,bhld->bhgl", qg * scale, k, precision=lax.Precision.HIGHEST
  )
  pos = jnp.arange(max_len, dtype=jnp.int32)
  valid = pos[None, :] < lengths[:, None]  # [B, L]
  valid4 = valid[:, None, None, :]
  scores = jnp.where(valid4, scores, -jnp.inf)
  m = jnp.max(scores, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(valid4, jnp.exp(scores - m_safe), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  v = jnp.where(valid[:, None, :, None], v, 0.0)
  acc = jnp.einsum("bhgl,bhld->bhgd", p, v, precision=lax.Precision.HIGHEST)
  o, lse = _common.finalize(m_safe, denom, acc)
  return decode_outputs(q, o, lse, return_lse)


@functools.partial(
  jax.jit, static_argnames=("scale", "return_lse", "backend", "interpret")
)
def _paged_attention(
  q,
  k_pages,
  v_pages,
  block_tables,
  lengths,
  *,
  scale,
  return_lse,
  backend,
  interpret,
):
  # Traced page ids or lengths out of range: those rows NaN (see
  # _common.unreadable_rows), never another sequence's pages.
  bad, block_tables, lengths = _common.unreadable_rows(
    block_tables, lengths, k_pages.shape[1], k_pages.shape[2]
  )
  if backend == "reference":
    out = paged_attention_reference(
      q,
      k_pages,
      v_pages,
      block_tables,
      lengths,
      scale=scale,
      return_lse=return_lse,
    )
  else:
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    group = num_q_heads // num_kv_heads
    o, lse = paged_flash(
      q.reshape(batch, num_kv_heads, group, head_dim),
      k_pages,
      v_pages,
      block_tables,
      lengths,
      lengths - 1,
      scale=scale,
      rows_per_token=group,
      backend=backend,
      interpret=interpret,
    )
    out = decode_outputs(q, o, lse, return_lse)
  return _common.nan_rows(out, bad)


def check_tables(
  name: str,
  tables: Any,
  lengths_name: str,
  lengths: Any,
  rows: int,
  num_pages: int,
  page_size: int,
) -> None:
  """Validates an int32 ``[rows, P]`` block table and ``[rows]`` lengths."""
  _common.check_rank(name, tables, 2, "[rows, pages_per_sequence]")
  if tables.shape[1] == 0:
    raise ValueError(
      f"{name}.shape={tuple(tables.shape)} has no page columns; give each "
      "row at least one (pad with page 0)."
    )
  _common.check_int_array(name, tables, (rows, tables.shape[1]), "row count")
  _common.check_int_array(lengths_name, lengths, (rows,), f"one per {name} row")
  _common.check_range(name, tables, 0, num_pages)
  _common.check_range(lengths_name, lengths, 0, tables.shape[1] * page_size + 1)


def paged_attention(
  q: jax.Array,
  k_pages: jax.Array,
  v_pages: jax.Array,
  block_tables: jax.Array,
  lengths: jax.Array,
  *,
  scale: float | None = None,
  return_lse: bool = False,
  backend: str | None = None,
  interpret: Any = False,
):
  """Decode attention of one query token per request over paged K/V.

  Args:
    q: ``[B, Hq, D]`` queries (float32, bfloat16 or float16).
    k_pages: ``[Hkv, N, K, D]`` key pages, same dtype as ``q``.
    v_pages: ``[Hkv, N, K, D]`` value pages.
    block_tables: int32 ``[B, P]`` page ids, padded with page 0.
    lengths: int32 ``[B]`` tokens per request, ``0 <= lengths <= P * K``.
    scale: score scale; default ``1 / sqrt(D)``.
    return_lse: also return the log-sum-exp ``[B, Hq]`` (float32).
    backend: ``None``, ``"reference"``, ``"pallas_tpu"`` or ``"pallas_gpu"``
      (see :mod:`pallas_kernels._dispatch`).
    interpret: run the Pallas variant in interpret mode (CPU testing).

  Returns:
    ``o [B, Hq, D]`` in ``q.dtype``, and ``lse [B, Hq]`` if ``return_lse``.

  Raises:
    ValueError: bad shapes or dtypes, ``Hq`` not a multiple of ``Hkv``, or
      (for concrete inputs) page ids or lengths out of range.

  Example:
    >>> import jax.numpy as jnp
    >>> q = jnp.ones((2, 4, 32))
    >>> pages = jnp.ones((1, 4, 8, 32))
    >>> tables = jnp.array([[1, 2], [3, 0]], jnp.int32)
    >>> o = paged_attention(q, pages, pages, tables,
    ...                     jnp.array([10, 3], jnp.int32), backend="reference")
    >>> o.shape
    (2, 4, 32)
  """
  return_lse = _common.check_flag("return_lse", return_lse)
  _common.check_rank("q", q, 3, "[B, Hq, D]")
  _, _, num_pages, page_size, head_dim = _common.check_pages(
    q, k_pages, v_pages
  )
  check_tables(
    "block_tables",
    block_tables,
    "lengths",
    lengths,
    q.shape[0],
    num_pages,
    page_size,
  )
  backend, interpret = reference_when_empty(
    resolve_backend(backend, interpret, kernel="paged_attention"), q
  )
  return _paged_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    scale=_common.default_scale(scale, head_dim),
    return_lse=bool(return_lse),
    backend=backend,
    interpret=interpret,
  )
