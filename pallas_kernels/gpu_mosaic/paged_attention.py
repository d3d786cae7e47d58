"""Mosaic GPU variant of the paged flash kernel (Hopper: TMA + WGMMA).

Same contract as the Triton-style variant's ``paged_flash_unbatched``
(:mod:`pallas_kernels.gpu.paged_attention`), so
:func:`pallas_kernels._dispatch.gpu_variant` can serve either. One program
per ``(sequence, KV head, split)`` and one warpgroup per program:

* the program's row of per-sequence metadata (KV length, first query
  position, then its block-table row) is copied into shared memory once;
* its query rows, padded to the 64 rows of a WGMMA tile, are copied in;
* its split walks tiles of ``block_k = max(64, page_size)`` tokens; each
  tile's pages are gathered page by page by TMA into shared memory (the page
  ids read from the table row), double-buffered: tile ``i + 1`` is in flight
  while tile ``i`` is computed;
* ``S = Q K^T`` and ``O += P V`` run on the tensor cores (``plgpu.wgmma``,
  float32 accumulators; ``P`` is cast to the input dtype for the second
  product, as in JAX's own Mosaic GPU flash attention,
  ``jax/experimental/pallas/ops/gpu/attention_mgpu.py``, jax 0.10.2);
* the online softmax and the masking are those of
  :func:`pallas_kernels._common.online_softmax_step`: slot ``t`` is visible to
  a row at position ``p`` iff ``t <= p`` and ``t < kv_length``. The value
  rows past the length in the last tile are zeroed in shared memory before
  ``P V``, so NaN or garbage in unused page slots never reaches the output;
* the splits' partial states are merged exactly by log-sum-exp
  (:func:`pallas_kernels.gpu.paged_attention.merge_splits`).

Supported (:func:`unsupported_reason`, :func:`device_reason`): a Hopper GPU
(compute capability 9.x), ``float16`` / ``bfloat16`` inputs
(WGMMA has no float32 path taking its left operand from registers), a page
size of 8, 16, 32, 64 or 128 tokens (TMA tiles of 8 rows; tiles of whole
pages, at least 64 tokens), a head dim of 16, 32 or a multiple of 64 (the
shared-memory swizzle), a block table short enough for one TMA copy (about
16,000 pages), and the shared-memory budget of a Hopper SM. Anything else is
served by the Triton-style variant, with a logged reason.

Interpret mode (``interpret`` truthy) runs the same kernel in JAX's GPU
interpret mode (``InterpretGPUParams``: simulated shared memory, TMA copies,
barriers; NaN for uninitialised memory; optional race detection), with two
substitutions the interpreter needs: the two products are ``jnp`` dot
products on the same shared-memory tiles (its WGMMA takes neither a
transposed operand nor a left operand in registers), and the register
layouts (``plgpu.Layout.WGMMA``) are left to the compiler. Whether the
compiled kernel lowers is checked separately, by lowering for ``cuda`` with
the CUDA plugin installed (``tests/test_kernels_mosaic_gpu.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu import paged_attention as triton_variant

# Query rows of one program: one WGMMA tile (M = 64).
TILE_ROWS = 64
# Leading int32 fields of a program's metadata row: kv_length, first_pos.
META = 2
# The metadata row travels as a [rows, 128] int32 tile: TMA copies move a
# multiple of 128 bytes (the warpgroup size) and at most 256 elements along
# each dimension, so a row holds at most 256 * 128 entries.
META_COLS = 128
MAX_META_ROWS = 256
PAGE_SIZES = (8, 16, 32, 64, 128)
# Dynamic shared memory of one H100 / H200 SM (227 KiB, CUDA C Programming
# Guide, compute capability 9.0), as Mosaic GPU reports it.
MAX_SMEM_BYTES = 232448
_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def block_tokens(page_size: int) -> int:
  """Tokens per tile: whole pages, at least 64 (WGMMA's K step)."""
  return max(64, page_size)


def meta_rows(pages_per_seq: int, page_size: int) -> int:
  """Rows of 128 int32 a program's metadata row may need: the table is
  padded to whole splits, less than twice its pages plus one tile."""
  width = META + 2 * pages_per_seq + block_tokens(page_size) // page_size
  return -(-width // META_COLS)


def smem_bytes(head_dim: int, page_size: int, pages_per_seq: int, dtype) -> int:
  """Shared memory one program uses (two K and two V buffers), with 4 KiB
  for barriers and alignment (Mosaic GPU's own count ran 2.5 KiB above the
  buffers' sum at head dim 256)."""
  itemsize = jnp.dtype(dtype).itemsize
  block_k = block_tokens(page_size)
  return (
    TILE_ROWS * head_dim * itemsize  # q
    + 4 * block_k * head_dim * itemsize  # k, v, two slots each
    + TILE_ROWS * head_dim * 4  # o, float32
    + TILE_ROWS * 4  # lse
    + meta_rows(pages_per_seq, page_size) * META_COLS * 4  # metadata
    + 4096  # barriers and alignment
  )


def unsupported_reason(
  dtype: Any, head_dim: int, page_size: int, pages_per_seq: int
) -> str | None:
  """Why this variant cannot serve a call, or ``None`` if it can."""
  if jnp.dtype(dtype) not in _DTYPES:
    return f"dtype {jnp.dtype(dtype).name} (needs float16 or bfloat16)"
  if page_size not in PAGE_SIZES:
    return f"page size {page_size} (needs one of {PAGE_SIZES})"
  if not (head_dim in (16, 32) or head_dim % 64 == 0):
    # Rows of 32, 64 or 128 bytes, or whole 128-byte swizzle tiles.
    return f"head dim {head_dim} (needs 16, 32 or a multiple of 64)"
  if meta_rows(pages_per_seq, page_size) > MAX_META_ROWS:
    return f"{pages_per_seq} pages per sequence (one TMA copy of its table)"
  need = smem_bytes(head_dim, page_size, pages_per_seq, dtype)
  if need > MAX_SMEM_BYTES:
    return f"{need} bytes of shared memory (at most {MAX_SMEM_BYTES})"
  return None


def device_reason(interpret: Any) -> str | None:
  """Why the local GPU cannot run the compiled kernel, or ``None``.

  TMA with WGMMA is Hopper's (compute capability 9.x): Ampere and Ada lack
  both, and Blackwell (10.x) replaces WGMMA with ``tcgen05``. Interpret
  mode, and lowering on a machine without a GPU, need no device.
  """
  if interpret:
    return None
  devices = [d for d in jax.devices() if d.platform == "gpu"]
  if not devices:
    return None
  capability = str(getattr(devices[0], "compute_capability", "") or "")
  major = capability.split(".")[0]
  if major.isdigit() and int(major) != 9:
    return (
      f"compute capability {capability} of {devices[0].device_kind} "
      "(needs 9.x, Hopper: TMA and WGMMA)"
    )
  return None


def interpret_params(interpret: Any) -> Any:
  """``pallas_call(interpret=)`` value: ``True`` means GPU interpret mode."""
  if not interpret:
    return False
  if interpret is True:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
  return interpret


def paged_flash_launch(
  q: jax.Array,  # [S, Hkv, R, D], R <= 64
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
  """One launch; returns ``(o [S, Hkv, R, D] f32, lse [S, Hkv, R, 1])``."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  num_seqs, num_kv_heads, num_rows, head_dim = q.shape
  _, _, page_size, _ = k_pages.shape
  pages_per_seq = block_tables.shape[1]
  if num_rows > TILE_ROWS:
    raise ValueError(f"{num_rows} query rows; one launch takes <= {TILE_ROWS}")
  dtype = q.dtype
  block_k = block_tokens(page_size)
  interpret = interpret_params(interpret)
  interpreting = interpret is not False
  # The Triton-style variant's split rule over this variant's tiles (one
  # tile per split when interpreting: exercises the merge on CPU).
  pages_per_block, blocks_per_split, num_splits = triton_variant.split_plan(
    num_seqs,
    num_kv_heads,
    pages_per_seq,
    page_size,
    interpreting,
    pages_per_block=block_k // page_size,
  )
  padded = num_splits * blocks_per_split * pages_per_block
  # Null-page padding: past every length, so never unmasked.
  tables = jnp.pad(block_tables, ((0, 0), (0, padded - pages_per_seq)))
  meta = jnp.stack([kv_lengths, first_pos], axis=1)
  rows_info = jnp.concatenate([meta, tables], axis=1).astype(jnp.int32)
  width = rows_info.shape[1]
  rows_info = jnp.pad(rows_info, ((0, 0), (0, -width % META_COLS)))
  rows_info = rows_info.reshape(num_seqs, -1, META_COLS)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, TILE_ROWS - num_rows), (0, 0)))

  itemsize = jnp.dtype(dtype).itemsize
  swizzle = min(128, head_dim * itemsize)
  transforms = (
    plgpu.TilingTransform((8, swizzle // itemsize)),
    plgpu.SwizzleTransform(swizzle),
  )

  def layout(x):
    return x if interpreting else plgpu.layout_cast(x, plgpu.Layout.WGMMA)

  def row_layout(x):
    if interpreting:
      return x
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))

  def iota(shape, dim):
    if interpreting:
      return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(
      jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA
    )

  def body(
    q_ref, k_ref, v_ref, info_ref, o_ref, lse_ref,
    q_smem, k_smem, v_smem, o_smem, lse_smem, info_smem,
    in_bar, k_bar, v_bar,
  ):  # fmt: skip
    seq = lax.axis_index("seq")
    head = lax.axis_index("head")
    split = lax.axis_index("split")
    plgpu.copy_gmem_to_smem(info_ref.at[seq], info_smem, in_bar.at[0])
    plgpu.copy_gmem_to_smem(q_ref.at[seq, head], q_smem, in_bar.at[1])
    plgpu.barrier_wait(in_bar.at[0])
    kv_length = info_smem[0, 0]
    first = info_smem[0, 1]
    first_block = split * blocks_per_split
    last_block = jnp.maximum(
      first_block,
      jnp.minimum(
        first_block + blocks_per_split,
        lax.div(kv_length + (block_k - 1), jnp.int32(block_k)),
      ),
    )

    def fetch(block, slot):
      for j in range(pages_per_block):
        entry = META + block * pages_per_block + j
        page = info_smem[entry // META_COLS, entry % META_COLS]
        rows = pl.ds(j * page_size, page_size)
        barrier = slot * pages_per_block + j
        plgpu.copy_gmem_to_smem(
          k_ref.at[head, page], k_smem.at[slot, rows], k_bar.at[barrier]
        )
        plgpu.copy_gmem_to_smem(
          v_ref.at[head, page], v_smem.at[slot, rows], v_bar.at[barrier]
        )

    @pl.when(first_block < last_block)
    def _prologue():
      fetch(first_block, 0)

    plgpu.barrier_wait(in_bar.at[1])
    row = iota((TILE_ROWS, block_k), 0)
    col = iota((TILE_ROWS, block_k), 1)
    row_pos = first + lax.div(row, jnp.int32(rows_per_token))

    def tile(block, carry):
      acc, m_prev, l_prev = carry
      slot = lax.rem(block - first_block, 2)

      @pl.when(block + 1 < last_block)
      def _prefetch():
        fetch(block + 1, 1 - slot)

      k_tile = k_smem.at[slot]
      v_tile = v_smem.at[slot]
      for j in range(pages_per_block):
        plgpu.barrier_wait(k_bar.at[slot * pages_per_block + j])
      if interpreting:
        s = lax.dot_general(
          q_smem[...],
          k_tile[...],
          (((1,), (1,)), ((), ())),
          preferred_element_type=jnp.float32,
        )
      else:

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
          return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((TILE_ROWS, block_k), jnp.float32))
      start = block * block_k
      kv_pos = start + col
      valid = (kv_pos <= row_pos) & (kv_pos < kv_length)
      s = jnp.where(valid, s * scale, -jnp.inf)
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
      m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
      alpha = jnp.exp(m_prev - m_safe)  # 0 where m_prev == -inf.
      p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
      p = jnp.where(valid, p, 0.0)
      l_next = alpha * l_prev + jnp.sum(p, axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      for j in range(pages_per_block):
        plgpu.barrier_wait(v_bar.at[slot * pages_per_block + j])

      @pl.when(start + block_k > kv_length)
      def _zero_tail():
        v = v_tile[...]
        v_pos = start + iota((block_k, head_dim), 0)
        v_tile[...] = jnp.where(v_pos < kv_length, v, jnp.zeros_like(v))
        plgpu.commit_smem()

      if interpreting:
        pv = jnp.dot(
          p.astype(dtype), v_tile[...], preferred_element_type=jnp.float32
        )
      else:

        def pv_product(acc_ref):
          plgpu.wgmma(acc_ref, p.astype(dtype), v_tile)
          return acc_ref[...]

        pv = pl.run_scoped(
          pv_product, plgpu.ACC((TILE_ROWS, head_dim), jnp.float32)
        )
      return acc + pv, m_next, l_next

    init = (
      layout(jnp.zeros((TILE_ROWS, head_dim), jnp.float32)),
      row_layout(jnp.full((TILE_ROWS,), -jnp.inf, jnp.float32)),
      row_layout(jnp.zeros((TILE_ROWS,), jnp.float32)),
    )
    acc, m, denom = lax.fori_loop(first_block, last_block, tile, init)
    nonempty = denom > 0.0
    safe = jnp.where(nonempty, denom, 1.0)
    wide = functools.partial(lax.broadcast_in_dim, shape=acc.shape)
    o = jnp.where(wide(nonempty, broadcast_dimensions=[0]), acc, 0.0)
    o_smem[...] = o / wide(safe, broadcast_dimensions=[0])
    lse_smem[...] = jnp.where(nonempty, m + jnp.log(safe), -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[seq, head, split])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[seq, head, split])
    plgpu.wait_smem_to_gmem(0)

  o, lse = plgpu.kernel(
    body,
    out_type=(
      jax.ShapeDtypeStruct(
        (num_seqs, num_kv_heads, num_splits, TILE_ROWS, head_dim), jnp.float32
      ),
      jax.ShapeDtypeStruct(
        (num_seqs, num_kv_heads, num_splits, TILE_ROWS), jnp.float32
      ),
    ),
    scratch_types=(
      plgpu.SMEM((TILE_ROWS, head_dim), dtype, transforms=transforms),
      plgpu.SMEM((2, block_k, head_dim), dtype, transforms=transforms),
      plgpu.SMEM((2, block_k, head_dim), dtype, transforms=transforms),
      plgpu.SMEM((TILE_ROWS, head_dim), jnp.float32),
      plgpu.SMEM((TILE_ROWS,), jnp.float32),
      plgpu.SMEM(rows_info.shape[1:], jnp.int32),
      plgpu.Barrier(num_barriers=2),
      plgpu.Barrier(num_barriers=2 * pages_per_block),
      plgpu.Barrier(num_barriers=2 * pages_per_block),
    ),
    grid=(num_seqs, num_kv_heads, num_splits),
    grid_names=("seq", "head", "split"),
    interpret=interpret,
  )(q, k_pages, v_pages, rows_info)
  o, lse = triton_variant.merge_splits(
    o[..., :num_rows, :], lse[..., :num_rows]
  )
  return o, lse[..., None]


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
  """Mosaic GPU variant; returns ``(o [S, Hkv, R, D] f32, lse [S, Hkv, R, 1])``.

  Falls back to the Triton-style variant (with a logged reason, once) for
  inputs this one does not support (:func:`unsupported_reason`) and on GPUs
  other than Hopper (:func:`device_reason`).
  """
  reason = unsupported_reason(
    q.dtype, q.shape[-1], k_pages.shape[2], block_tables.shape[1]
  ) or device_reason(interpret)
  args = (q, k_pages, v_pages, block_tables, kv_lengths, first_pos)
  kwargs = dict(scale=scale, rows_per_token=rows_per_token, interpret=interpret)
  if reason is not None:
    from pallas_kernels._dispatch import log_once

    log_once(
      "paged_attention",
      f"the Mosaic GPU variant does not support {reason}; using the "
      "Triton-style variant.",
    )
    return triton_variant.paged_flash_unbatched(*args, **kwargs)
  return triton_variant.fold_row_blocks(
    paged_flash_launch,
    *args,
    max_rows=triton_variant.max_block_rows(interpret),
    **kwargs,
  )
