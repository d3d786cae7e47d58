"""Decode attention where groups of requests share prefix pages.

Request ``b`` belongs to group ``group_of[b]``; it attends over its group's
prefix (``prefix_block_tables[g]``, ``prefix_lengths[g]`` tokens, whole
pages) followed by its own suffix (``suffix_block_tables[b]``,
``suffix_lengths[b]`` tokens). The result equals
:func:`~pallas_kernels.paged_attention` on the concatenated tables
``prefix_pages[:prefix_lengths // K] + suffix_pages`` with length
``prefix_length + suffix_length``.

How the prefix is read once per group: the requests are sorted by group and
laid out as a ``[G, Hkv, M * g, D]`` query block, where ``M`` is
``max_group_size`` (padding rows are zero and their outputs dropped). The
paged flash kernel (:mod:`pallas_kernels.paged_attention`) then runs with one
"sequence" per group: each step DMAs one prefix page of one KV head and
multiplies it against all ``M * g`` query rows of the group. A second launch
of the same kernel covers each request's suffix pages (``[B, Hkv, g, D]``
rows), and the two partial results are merged exactly through their
log-sum-exps (:func:`pallas_kernels._common.merge_states`, fused by XLA).
Empty groups (no members) are skipped (their effective prefix length is 0,
so no page is loaded); a group of one is ordinary paged attention.

``max_group_size``: a static size. When ``None`` and ``group_of`` is concrete
it is the largest group rounded up to a power of two (so a serving loop
compiles a handful of shapes); when ``group_of`` is traced it defaults to
``B`` (always correct, wasteful in compute). Inside ``jit`` pass it
explicitly: members past ``max_group_size`` cannot be refused under tracing,
so their outputs (and log-sum-exps) are NaN, a visible failure, never
another member's prefix.

Bytes model: unique prefix pages ``sum_g ceil(prefix_g / K)`` plus suffix
pages ``sum_b ceil(suffix_b / K)``, K and V, all KV heads; versus naive paged
decode, which reads the prefix once per request. Tolerances as for
:mod:`pallas_kernels.paged_attention` (float32 math, one extra exact merge).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _common
from pallas_kernels._dispatch import reference_when_empty, resolve_backend
from pallas_kernels.paged_attention import (
  check_tables,
  decode_outputs,
  paged_attention_reference,
  paged_flash,
)


def group_layout(
  group_of: jax.Array, num_groups: int, max_group_size: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Member table of each group.

  Args:
    group_of: int32 ``[B]`` group id of each request.
    num_groups: ``G``.
    max_group_size: ``M``.

  Returns:
    ``members`` int32 ``[G, M]`` (request ids, padded with any valid id),
    ``member_valid`` bool ``[G, M]``, ``counts`` int32 ``[G]`` and ``rank``
    int32 ``[B]`` (each request's slot within its group).
  """
  batch = group_of.shape[0]
  order = jnp.argsort(group_of, stable=True).astype(jnp.int32)  # [B]
  counts = jnp.zeros((num_groups,), jnp.int32).at[group_of].add(1)  # [G]
  starts = jnp.cumsum(counts) - counts  # [G]
  slots = jnp.arange(max_group_size, dtype=jnp.int32)  # [M]
  index = starts[:, None] + slots[None, :]  # [G, M]
  members = order[jnp.minimum(index, batch - 1)]
  member_valid = slots[None, :] < counts[:, None]
  sorted_rank = jnp.arange(batch, dtype=jnp.int32) - starts[group_of[order]]
  rank = jnp.zeros((batch,), jnp.int32).at[order].set(sorted_rank)
  return members, member_valid, counts, rank


def _check_groups(
  prefix_block_tables,
  prefix_lengths,
  group_of,
  suffix_block_tables,
  suffix_lengths,
  *,
  batch: int,
  num_pages: int,
  page_size: int,
) -> None:
  """The prefix / suffix tables, their lengths and ``group_of``: int32 of
  matching shapes; for concrete values, page ids in ``[0, num_pages)``,
  lengths within their tables, whole-page prefixes, groups in range."""
  num_groups = prefix_block_tables.shape[0]
  check_tables(
    "prefix_block_tables",
    prefix_block_tables,
    "prefix_lengths",
    prefix_lengths,
    num_groups,
    num_pages,
    page_size,
  )
  check_tables(
    "suffix_block_tables",
    suffix_block_tables,
    "suffix_lengths",
    suffix_lengths,
    batch,
    num_pages,
    page_size,
  )
  _common.check_int_array("group_of", group_of, (batch,), "one per request")
  _common.check_range("group_of", group_of, 0, num_groups)
  _common.check_whole_pages("prefix_lengths", prefix_lengths, page_size)


def concat_block_tables(
  prefix_block_tables: jax.Array,  # [G, Pp]
  prefix_lengths: jax.Array,  # [G]
  group_of: jax.Array,  # [B]
  suffix_block_tables: jax.Array,  # [B, Ps]
  suffix_lengths: jax.Array,  # [B]
  page_size: int,
) -> tuple[jax.Array, jax.Array]:
  """Per-request tables ``[B, Pp + Ps]`` and lengths ``[B]`` (prefix first).

  Request ``b``'s row is its group's first ``prefix_lengths[g] // K`` prefix
  pages, then its suffix pages, padded with suffix entries. The arguments
  are checked as :func:`shared_prefix_attention` checks them (int32 arrays
  of matching shapes; for concrete values, group ids in range, whole-page
  prefixes and lengths within their tables), except that page ids are only
  required to be non-negative: no pool is given here.

  Raises:
    ValueError: bad shapes, dtypes or (concrete) values.
    TypeError: ``page_size`` not an int.
  """
  page_size = _common.check_page_size(page_size)
  _common.check_rank("prefix_block_tables", prefix_block_tables, 2, "[G, Pp]")
  _common.check_rank("suffix_block_tables", suffix_block_tables, 2, "[B, Ps]")
  batch = suffix_block_tables.shape[0]
  any_page = int(np.iinfo(np.int32).max)
  _check_groups(
    prefix_block_tables,
    prefix_lengths,
    group_of,
    suffix_block_tables,
    suffix_lengths,
    batch=batch,
    num_pages=any_page,
    page_size=page_size,
  )
  return _concat_block_tables(
    prefix_block_tables,
    prefix_lengths,
    group_of,
    suffix_block_tables,
    suffix_lengths,
    page_size,
  )


def _concat_block_tables(
  prefix_block_tables,
  prefix_lengths,
  group_of,
  suffix_block_tables,
  suffix_lengths,
  page_size,
):
  prefix_pages = prefix_block_tables.shape[1]
  width = prefix_pages + suffix_block_tables.shape[1]
  used = (prefix_lengths // page_size)[group_of][:, None]  # [B, 1]
  column = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, W]
  from_prefix = jnp.take_along_axis(
    prefix_block_tables[group_of],
    jnp.broadcast_to(
      jnp.minimum(column, prefix_pages - 1), (group_of.size, width)
    ),
    axis=1,
  )
  suffix_column = jnp.clip(column - used, 0, suffix_block_tables.shape[1] - 1)
  from_suffix = jnp.take_along_axis(suffix_block_tables, suffix_column, axis=1)
  tables = jnp.where(column < used, from_prefix, from_suffix)
  lengths = prefix_lengths[group_of] + suffix_lengths
  return tables.astype(jnp.int32), lengths.astype(jnp.int32)


def shared_prefix_attention_reference(
  q: jax.Array,
  k_pages: jax.Array,
  v_pages: jax.Array,
  prefix_block_tables: jax.Array,
  prefix_lengths: jax.Array,
  group_of: jax.Array,
  suffix_block_tables: jax.Array,
  suffix_lengths: jax.Array,
  *,
  scale: float | None = None,
  return_lse: bool = False,
):
  """Plain-``jnp`` reference: paged attention over concatenated tables."""
  tables, lengths = _concat_block_tables(
    prefix_block_tables,
    prefix_lengths,
    group_of,
    suffix_block_tables,
    suffix_lengths,
    k_pages.shape[2],
  )
  return paged_attention_reference(
    q, k_pages, v_pages, tables, lengths, scale=scale, return_lse=return_lse
  )


@functools.partial(
  jax.jit,
  static_argnames=(
    "scale",
    "return_lse",
    "max_group_size",
    "backend",
    "interpret",
  ),
)
def _shared_prefix_attention(
  q,
  k_pages,
  v_pages,
  prefix_block_tables,
  prefix_lengths,
  group_of,
  suffix_block_tables,
  suffix_lengths,
  *,
  scale,
  return_lse,
  max_group_size,
  backend,
  interpret,
):
  # Traced values out of range (page ids, lengths, partial prefix pages,
  # group ids): those requests' rows NaN (see _common.unreadable_rows).
  num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
  num_groups = prefix_block_tables.shape[0]
  prefix_bad, prefix_block_tables, whole = _common.unreadable_rows(
    prefix_block_tables, prefix_lengths, num_pages, page_size
  )
  prefix_bad |= whole % page_size != 0
  prefix_lengths = whole - whole % page_size
  bad, suffix_block_tables, suffix_lengths = _common.unreadable_rows(
    suffix_block_tables, suffix_lengths, num_pages, page_size
  )
  outside = (group_of < 0) | (group_of >= num_groups)
  group_of = jnp.clip(group_of, 0, num_groups - 1).astype(jnp.int32)
  bad |= outside | prefix_bad[group_of]
  if backend == "reference":
    return _common.nan_rows(
      shared_prefix_attention_reference(
        q,
        k_pages,
        v_pages,
        prefix_block_tables,
        prefix_lengths,
        group_of,
        suffix_block_tables,
        suffix_lengths,
        scale=scale,
        return_lse=return_lse,
      ),
      bad,
    )
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads = k_pages.shape[0]
  group = num_q_heads // num_kv_heads
  size = max_group_size
  members, member_valid, counts, rank = group_layout(group_of, num_groups, size)
  # [G, M, Hq, D] -> [G, Hkv, M * g, D]: all rows that share a prefix page.
  q_groups = jnp.where(member_valid[:, :, None, None], q[members], 0)
  q_groups = q_groups.reshape(num_groups, size, num_kv_heads, group, head_dim)
  q_groups = q_groups.transpose(0, 2, 1, 3, 4).reshape(
    num_groups, num_kv_heads, size * group, head_dim
  )
  prefix_used = jnp.where(counts > 0, prefix_lengths, 0)
  o_prefix, lse_prefix = paged_flash(
    q_groups,
    k_pages,
    v_pages,
    prefix_block_tables,
    prefix_used,
    prefix_used - 1,
    scale=scale,
    rows_per_token=size * group,
    backend=backend,
    interpret=interpret,
  )
  # Back to requests: [G, Hkv, M, g, .] -> [B, Hkv, g, .].
  o_prefix = o_prefix.reshape(num_groups, num_kv_heads, size, group, head_dim)
  o_prefix = o_prefix[group_of, :, rank]
  lse_prefix = lse_prefix.reshape(num_groups, num_kv_heads, size, group, 1)
  lse_prefix = lse_prefix[group_of, :, rank]
  o_suffix, lse_suffix = paged_flash(
    q.reshape(batch, num_kv_heads, group, head_dim),
    k_pages,
    v_pages,
    suffix_block_tables,
    suffix_lengths,
    suffix_lengths - 1,
    scale=scale,
    rows_per_token=group,
    backend=backend,
    interpret=interpret,
  )
  o, lse = _common.merge_states(o_prefix, lse_prefix, o_suffix, lse_suffix)
  # A member past max_group_size (only possible with a traced group_of)
  # has no prefix rows: NaN, never another member's prefix.
  over = (rank >= size)[:, None, None, None]
  o = jnp.where(over, jnp.nan, o)
  lse = jnp.where(over, jnp.nan, lse)
  return _common.nan_rows(decode_outputs(q, o, lse, return_lse), bad)


def shared_prefix_attention(
  q: jax.Array,
  k_pages: jax.Array,
  v_pages: jax.Array,
  prefix_block_tables: jax.Array,
  prefix_lengths: jax.Array,
  group_of: jax.Array,
  suffix_block_tables: jax.Array,
  suffix_lengths: jax.Array,
  *,
  scale: float | None = None,
  return_lse: bool = False,
  max_group_size: int | None = None,
  backend: str | None = None,
  interpret: Any = False,
):
  """Decode attention over a per-group shared prefix and per-request suffix.

  Args:
    q: ``[B, Hq, D]`` queries.
    k_pages: ``[Hkv, N, K, D]`` key pages, same dtype as ``q``.
    v_pages: ``[Hkv, N, K, D]`` value pages.
    prefix_block_tables: int32 ``[G, Pp]`` prefix page ids of each group.
    prefix_lengths: int32 ``[G]`` prefix tokens, whole pages (multiples of
      ``K``), at most ``Pp * K``.
    group_of: int32 ``[B]`` group of each request, in ``[0, G)``.
    suffix_block_tables: int32 ``[B, Ps]`` private page ids of each request.
    suffix_lengths: int32 ``[B]`` private tokens, at most ``Ps * K``.
    scale: score scale; default ``1 / sqrt(D)``.
    return_lse: also return the log-sum-exp ``[B, Hq]``.
    max_group_size: static bound on requests per group (see module doc).
    backend: see :mod:`pallas_kernels._dispatch`.
    interpret: run the Pallas variant in interpret mode.

  Returns:
    ``o [B, Hq, D]`` in ``q.dtype``, and ``lse [B, Hq]`` if ``return_lse``.

  Raises:
    ValueError: bad shapes or dtypes, or (concrete inputs) ids or lengths out
      of range, partial prefix pages, or a group larger than
      ``max_group_size``.

  Example:
    >>> import jax.numpy as jnp
    >>> q = jnp.ones((3, 4, 32))
    >>> pages = jnp.ones((1, 8, 8, 32))
    >>> o = shared_prefix_attention(
    ...     q, pages, pages,
    ...     jnp.array([[1, 2]], jnp.int32), jnp.array([16], jnp.int32),
    ...     jnp.zeros((3,), jnp.int32),
    ...     jnp.array([[3], [4], [5]], jnp.int32),
    ...     jnp.array([5, 1, 8], jnp.int32), backend="reference")
    >>> o.shape
    (3, 4, 32)
  """
  return_lse = _common.check_flag("return_lse", return_lse)
  _common.check_rank("q", q, 3, "[B, Hq, D]")
  _, _, num_pages, page_size, head_dim = _common.check_pages(
    q, k_pages, v_pages
  )
  batch = q.shape[0]
  _common.check_rank("prefix_block_tables", prefix_block_tables, 2, "[G, Pp]")
  num_groups = prefix_block_tables.shape[0]
  if num_groups == 0 or batch == 0:
    raise ValueError(
      f"q batch={batch} and prefix_block_tables groups={num_groups} must be "
      "positive."
    )
  _check_groups(
    prefix_block_tables,
    prefix_lengths,
    group_of,
    suffix_block_tables,
    suffix_lengths,
    batch=batch,
    num_pages=num_pages,
    page_size=page_size,
  )
  largest = None
  if _common.is_concrete(group_of):
    largest = int(np.bincount(_common.host(group_of), minlength=1).max())
  if max_group_size is None:
    if largest is None:
      max_group_size = batch
    else:
      max_group_size = min(batch, 1 << (max(largest, 1) - 1).bit_length())
  if isinstance(max_group_size, bool) or not isinstance(
    max_group_size, (int, np.integer)
  ):
    raise ValueError(
      f"max_group_size={max_group_size!r} must be an int (or None)."
    )
  max_group_size = int(max_group_size)
  if max_group_size < 1 or (largest is not None and largest > max_group_size):
    raise ValueError(
      f"max_group_size={max_group_size} must be >= 1 and >= the largest "
      f"group ({largest} requests)."
    )
  backend, interpret = reference_when_empty(
    resolve_backend(backend, interpret, kernel="shared_prefix_attention"), q
  )
  return _shared_prefix_attention(
    q,
    k_pages,
    v_pages,
    prefix_block_tables,
    prefix_lengths,
    group_of,
    suffix_block_tables,
    suffix_lengths,
    scale=_common.default_scale(scale, head_dim),
    return_lse=bool(return_lse),
    max_group_size=max_group_size,
    backend=backend,
    interpret=interpret,
  )
