"""Ragged chunked prefill attention over cached pages.

Layouts: ``q`` ``[T, Hq, D]`` holds the new tokens of ``S`` sequences back to
back; sequence ``s`` owns rows ``cu_q_lengths[s]:cu_q_lengths[s + 1]``
(``q_len_s`` rows) and rows past ``cu_q_lengths[S]`` are padding (output 0).
Its K/V are already in the pages (write them first with
:func:`~pallas_kernels.write_kv`): ``kv_lengths[s]`` tokens through
``block_tables[s]``, the new tokens being the last ``q_len_s`` of them. New
token ``j`` sits at position ``kv_lengths[s] - q_len_s + j`` and attends
causally to every position up to and including its own.

Kernel: the query rows of each sequence are cut into tiles of ``block_q``
tokens (a tile never straddles two sequences; there are at most
``ceil(T / block_q) + S`` tiles, the static grid size). The wrapper gathers
each tile's rows into a ``[tiles, Hkv, block_q * g, D]`` block and reuses
the paged flash kernel of :mod:`pallas_kernels.paged_attention` with
``rows_per_token = g`` and each tile's first position, so a tile reads only
the pages up to its last query position, one page per step, and every page
it reads serves all its ``block_q * g`` rows. Outputs are gathered back to
``[T, Hq, D]``.

Bytes model: per tile, K and V of ``ceil((first_pos + rows) / K)`` pages
(pages shared by tiles of one sequence are re-read per tile), plus q and o.
Tolerances as for :mod:`pallas_kernels.paged_attention`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _common
from pallas_kernels._dispatch import reference_when_empty, resolve_backend
from pallas_kernels.paged_attention import check_tables, paged_flash


def token_positions(
  cu_q_lengths: jax.Array, kv_lengths: jax.Array, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Per token: ``(sequence [T], local index [T], position [T], valid [T])``."""
  num_seqs = kv_lengths.shape[0]
  token = jnp.arange(num_tokens, dtype=jnp.int32)
  seq = jnp.searchsorted(cu_q_lengths[1:], token, side="right")
  seq = jnp.minimum(seq, num_seqs - 1).astype(jnp.int32)
  valid = token < cu_q_lengths[num_seqs]
  local = token - cu_q_lengths[seq]
  q_lengths = cu_q_lengths[1:] - cu_q_lengths[:-1]
  position = kv_lengths[seq] - q_lengths[seq] + local
  return seq, local, position, valid


def prefill_attention_reference(
  q: jax.Array,
  k_pages: jax.Array,
  v_pages: jax.Array,
  block_tables: jax.Array,
  kv_lengths: jax.Array,
  cu_q_lengths: jax.Array,
  *,
  scale: float | None = None,
) -> jax.Array:
  """Plain-``jnp`` reference, one chunk of tokens at a time (``lax.map``)."""
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  scale = _common.default_scale(scale, head_dim)
  max_len = block_tables.shape[1] * page_size
  seq, _, position, valid = token_positions(
    cu_q_lengths, kv_lengths, num_tokens
  )
  kv_pos = jnp.arange(max_len, dtype=jnp.int32)

  def one_token(args):
    q_t, seq_t, pos_t, valid_t = args  # [Hq, D], (), (), ()
    pages = block_tables[seq_t]  # [P]
    k = k_pages[:, pages].reshape(num_kv_heads, max_len, head_dim)
    v = v_pages[:, pages].reshape(num_kv_heads, max_len, head_dim)
    seen = (kv_pos <= pos_t) & valid_t  # [L]
    qg = q_t.reshape(num_kv_heads, group, head_dim).astype(jnp.float32)
    s = jnp.einsum(
      "hgd,hld->hgl",
      qg * scale,
      k.astype(jnp.float32),
      precision=lax.Precision.HIGHEST,
    )
    s = jnp.where(seen[None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(seen[None, None, :], jnp.exp(s - m_safe), 0.0)
    v = jnp.where(seen[None, :, None], v.astype(jnp.float32), 0.0)
    acc = jnp.einsum("hgl,hld->hgd", p, v, precision=lax.Precision.HIGHEST)
    o, _ = _common.finalize(m_safe, jnp.sum(p, -1, keepdims=True), acc)
    return o.reshape(num_q_heads, head_dim).astype(q.dtype)

  return lax.map(
    one_token,
    (q, seq, position, valid),
    batch_size=min(num_tokens, 16),
  )


def tile_layout(
  cu_q_lengths: jax.Array, kv_lengths: jax.Array, num_tokens: int, block_q: int
) -> dict[str, jax.Array]:
  """Cuts each sequence's rows into tiles of ``block_q`` tokens.

  Returns int32 arrays over ``num_tiles = ceil(T / block_q) + S`` tiles:
  ``seq``, ``q_start`` (first row in ``q``), ``rows`` (valid rows, 0 for
  unused tiles), ``first_pos`` and ``kv_length`` (positions the tile reads),
  plus per-sequence ``tile_start``.
  """
  num_seqs = kv_lengths.shape[0]
  num_tiles = -(-num_tokens // block_q) + num_seqs
  q_lengths = cu_q_lengths[1:] - cu_q_lengths[:-1]  # [S]
  tiles_per_seq = (q_lengths + block_q - 1) // block_q
  tile_end = jnp.cumsum(tiles_per_seq).astype(jnp.int32)
  tile_start = tile_end - tiles_per_seq
  tile = jnp.arange(num_tiles, dtype=jnp.int32)
  seq = jnp.searchsorted(tile_end, tile, side="right")
  seq = jnp.minimum(seq, num_seqs - 1).astype(jnp.int32)
  used = tile < tile_end[num_seqs - 1]
  offset = (tile - tile_start[seq]) * block_q
  rows = jnp.where(used, jnp.clip(q_lengths[seq] - offset, 0, block_q), 0)
  first_pos = kv_lengths[seq] - q_lengths[seq] + offset
  return {
    "seq": seq,
    "q_start": cu_q_lengths[seq] + offset,
    "rows": rows,
    "first_pos": first_pos,
    "kv_length": jnp.where(rows > 0, first_pos + rows, 0),
    "tile_start": tile_start,
  }


@functools.partial(
  jax.jit, static_argnames=("scale", "block_q", "backend", "interpret")
)
def _prefill_attention(
  q,
  k_pages,
  v_pages,
  block_tables,
  kv_lengths,
  cu_q_lengths,
  *,
  scale,
  block_q,
  backend,
  interpret,
):
  # Traced values out of range (page ids, kv lengths, offsets that are not
  # non-decreasing from 0 within the T tokens, more new tokens than kv
  # tokens): the tokens of those sequences NaN, never other pages' keys
  # (see _common.unreadable_rows); bad offsets make every token NaN.
  num_tokens = q.shape[0]
  bad_seq, block_tables, kv_lengths = _common.unreadable_rows(
    block_tables, kv_lengths, k_pages.shape[1], k_pages.shape[2]
  )
  q_lengths = cu_q_lengths[1:] - cu_q_lengths[:-1]
  bad_seq |= q_lengths > kv_lengths
  offsets_bad = (
    (cu_q_lengths[0] != 0)
    | jnp.any(q_lengths < 0)
    | (cu_q_lengths[-1] > num_tokens)
  )
  seq, local, _, valid = token_positions(cu_q_lengths, kv_lengths, num_tokens)
  bad = offsets_bad | (valid & bad_seq[seq])
  if backend == "reference":
    return _common.nan_rows(
      prefill_attention_reference(
        q, k_pages, v_pages, block_tables, kv_lengths, cu_q_lengths, scale=scale
      ),
      bad,
    )
  _, num_q_heads, head_dim = q.shape
  num_kv_heads = k_pages.shape[0]
  group = num_q_heads // num_kv_heads
  tiles = tile_layout(cu_q_lengths, kv_lengths, num_tokens, block_q)
  num_tiles = tiles["seq"].shape[0]
  row = jnp.arange(block_q, dtype=jnp.int32)
  q_rows = jnp.minimum(tiles["q_start"][:, None] + row[None, :], num_tokens - 1)
  q_tiles = jnp.where(
    (row[None, :] < tiles["rows"][:, None])[:, :, None, None], q[q_rows], 0
  )  # [tiles, block_q, Hq, D]
  q_tiles = q_tiles.reshape(num_tiles, block_q, num_kv_heads, group, head_dim)
  q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(
    num_tiles, num_kv_heads, block_q * group, head_dim
  )
  o_tiles, _ = paged_flash(
    q_tiles,
    k_pages,
    v_pages,
    block_tables[tiles["seq"]],
    tiles["kv_length"],
    tiles["first_pos"],
    scale=scale,
    rows_per_token=group,
    backend=backend,
    interpret=interpret,
  )
  o_tiles = o_tiles.reshape(num_tiles, num_kv_heads, block_q, group, head_dim)
  o_tiles = o_tiles.transpose(0, 2, 1, 3, 4).reshape(
    num_tiles * block_q, num_q_heads, head_dim
  )
  flat = (tiles["tile_start"][seq] + local // block_q) * block_q
  flat = jnp.clip(flat + local % block_q, 0, num_tiles * block_q - 1)
  o = jnp.where(valid[:, None, None], o_tiles[flat], 0.0)
  return _common.nan_rows(o.astype(q.dtype), bad)


def prefill_attention(
  q: jax.Array,
  k_pages: jax.Array,
  v_pages: jax.Array,
  block_tables: jax.Array,
  kv_lengths: jax.Array,
  cu_q_lengths: jax.Array,
  *,
  scale: float | None = None,
  block_q: int = 16,
  backend: str | None = None,
  interpret: Any = False,
) -> jax.Array:
  """Causal attention of ragged new tokens over their cached pages.

  Args:
    q: ``[T, Hq, D]`` queries of all sequences, back to back.
    k_pages: ``[Hkv, N, K, D]`` key pages (the new tokens already written).
    v_pages: ``[Hkv, N, K, D]`` value pages.
    block_tables: int32 ``[S, P]`` page ids of each sequence.
    kv_lengths: int32 ``[S]`` tokens of each sequence including the new ones.
    cu_q_lengths: int32 ``[S + 1]`` cumulative new-token counts, starting at
      0, non-decreasing, ``cu_q_lengths[S] <= T``, and
      ``q_len_s <= kv_lengths[s]``.
    scale: score scale; default ``1 / sqrt(D)``.
    block_q: static query tile (tokens per kernel block).
    backend: see :mod:`pallas_kernels._dispatch`.
    interpret: run the Pallas variant in interpret mode.

  Returns:
    ``o [T, Hq, D]`` in ``q.dtype`` (zeros on padding rows).

  Raises:
    ValueError: bad shapes or dtypes, or (concrete inputs) ids, lengths or
      offsets that break the rules above.

  Example:
    >>> import jax.numpy as jnp
    >>> q = jnp.ones((5, 4, 32))
    >>> pages = jnp.ones((2, 8, 8, 32))
    >>> o = prefill_attention(
    ...     q, pages, pages, jnp.array([[1, 2], [3, 0]], jnp.int32),
    ...     jnp.array([12, 2], jnp.int32), jnp.array([0, 3, 5], jnp.int32),
    ...     backend="reference")
    >>> o.shape
    (5, 4, 32)
  """
  _common.check_rank("q", q, 3, "[T, Hq, D]")
  _, _, num_pages, page_size, head_dim = _common.check_pages(
    q, k_pages, v_pages
  )
  num_tokens = q.shape[0]
  _common.check_rank("block_tables", block_tables, 2, "[S, P]")
  num_seqs = block_tables.shape[0]
  if num_tokens == 0 or num_seqs == 0:
    raise ValueError(f"q tokens={num_tokens} and S={num_seqs} must be > 0.")
  check_tables(
    "block_tables",
    block_tables,
    "kv_lengths",
    kv_lengths,
    num_seqs,
    num_pages,
    page_size,
  )
  _common.check_int_array(
    "cu_q_lengths", cu_q_lengths, (num_seqs + 1,), "S + 1 offsets"
  )
  if isinstance(block_q, np.integer):
    block_q = int(block_q)
  if isinstance(block_q, bool) or not isinstance(block_q, int) or block_q < 1:
    raise ValueError(f"block_q={block_q!r} must be a positive int.")
  if _common.is_concrete(cu_q_lengths):  # needs no kv_lengths
    cu = _common.host(cu_q_lengths)
    q_lengths = cu[1:] - cu[:-1]
    if cu[0] != 0 or (q_lengths < 0).any() or cu[-1] > num_tokens:
      raise ValueError(
        f"cu_q_lengths={cu.tolist()} must start at 0, be non-decreasing and "
        f"end at <= T={num_tokens}."
      )
  if _common.is_concrete(cu_q_lengths) and _common.is_concrete(kv_lengths):
    kv = _common.host(kv_lengths)
    if (q_lengths > kv).any():
      raise ValueError(
        f"cu_q_lengths gives q lengths {q_lengths.tolist()} that exceed "
        f"kv_lengths={kv.tolist()}."
      )
  backend, interpret = reference_when_empty(
    resolve_backend(backend, interpret, kernel="prefill_attention"), q
  )
  return _prefill_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    kv_lengths,
    cu_q_lengths,
    scale=_common.default_scale(scale, head_dim),
    block_q=int(min(block_q, num_tokens)),
    backend=backend,
    interpret=interpret,
  )
