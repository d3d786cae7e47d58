"""Argument checks (ValueError naming the argument) and backend dispatch."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import _dispatch

F32 = jnp.float32
I32 = jnp.int32


def decode_args(**override):
  args = {
    "q": jnp.zeros((2, 4, 32), F32),
    "k_pages": jnp.zeros((2, 5, 8, 32), F32),
    "v_pages": jnp.zeros((2, 5, 8, 32), F32),
    "block_tables": jnp.array([[1, 2], [3, 0]], I32),
    "lengths": jnp.array([10, 3], I32),
  }
  args.update(override)
  return args


def shared_args(**override):
  args = {
    "q": jnp.zeros((3, 4, 32), F32),
    "k_pages": jnp.zeros((2, 6, 8, 32), F32),
    "v_pages": jnp.zeros((2, 6, 8, 32), F32),
    "prefix_block_tables": jnp.array([[1, 2], [3, 0]], I32),
    "prefix_lengths": jnp.array([16, 8], I32),
    "group_of": jnp.array([0, 1, 0], I32),
    "suffix_block_tables": jnp.array([[4], [5], [0]], I32),
    "suffix_lengths": jnp.array([3, 8, 0], I32),
  }
  args.update(override)
  return args


def prefill_args(**override):
  args = {
    "q": jnp.zeros((6, 4, 32), F32),
    "k_pages": jnp.zeros((2, 5, 8, 32), F32),
    "v_pages": jnp.zeros((2, 5, 8, 32), F32),
    "block_tables": jnp.array([[1, 2], [3, 0]], I32),
    "kv_lengths": jnp.array([12, 2], I32),
    "cu_q_lengths": jnp.array([0, 4, 6], I32),
  }
  args.update(override)
  return args


def write_args(**override):
  args = {
    "k_pages": jnp.zeros((2, 5, 8, 32), F32),
    "v_pages": jnp.zeros((2, 5, 8, 32), F32),
    "k_new": jnp.zeros((3, 2, 32), F32),
    "v_new": jnp.zeros((3, 2, 32), F32),
    "slot_mapping": jnp.array([8, 9, -1], I32),
  }
  args.update(override)
  return args


def copy_args(**override):
  args = {
    "k_pages": jnp.zeros((2, 5, 8, 32), F32),
    "v_pages": jnp.zeros((2, 5, 8, 32), F32),
    "src": jnp.array([1, 2], I32),
    "dst": jnp.array([3, 4], I32),
  }
  args.update(override)
  return args


def merge_args(**override):
  args = {
    "o_a": jnp.zeros((2, 4, 32), F32),
    "lse_a": jnp.zeros((2, 4), F32),
    "o_b": jnp.zeros((2, 4, 32), F32),
    "lse_b": jnp.zeros((2, 4), F32),
  }
  args.update(override)
  return args


BAD_CASES = {
  # paged_attention
  "paged-q-rank": (
    pk.paged_attention,
    decode_args(q=jnp.zeros((2, 32), F32)),
    "q",
  ),
  "paged-q-dtype": (
    pk.paged_attention,
    decode_args(q=jnp.zeros((2, 4, 32), jnp.float16)),
    "q",
  ),
  "paged-int-pages": (
    pk.paged_attention,
    decode_args(k_pages=jnp.zeros((2, 5, 8, 32), I32)),
    "k_pages",
  ),
  "paged-v-shape": (
    pk.paged_attention,
    decode_args(v_pages=jnp.zeros((2, 5, 8, 16), F32)),
    "v_pages",
  ),
  "paged-head-multiple": (
    pk.paged_attention,
    decode_args(q=jnp.zeros((2, 3, 32), F32)),
    "num_q_heads",
  ),
  "paged-head-dim": (
    pk.paged_attention,
    decode_args(q=jnp.zeros((2, 4, 16), F32)),
    "head_dim",
  ),
  "paged-table-dtype": (
    pk.paged_attention,
    decode_args(block_tables=jnp.array([[1, 2], [3, 0]], jnp.int16)),
    "block_tables",
  ),
  "paged-table-rows": (
    pk.paged_attention,
    decode_args(block_tables=jnp.array([[1, 2]], I32)),
    "block_tables",
  ),
  "paged-page-id": (
    pk.paged_attention,
    decode_args(block_tables=jnp.array([[1, 5], [3, 0]], I32)),
    "block_tables",
  ),
  "paged-negative-page-id": (
    pk.paged_attention,
    decode_args(block_tables=jnp.array([[1, -1], [3, 0]], I32)),
    "block_tables",
  ),
  "paged-lengths-dtype": (
    pk.paged_attention,
    decode_args(lengths=jnp.array([10, 3], jnp.uint32)),
    "lengths",
  ),
  "paged-lengths-range": (
    pk.paged_attention,
    decode_args(lengths=jnp.array([17, 3], I32)),
    "lengths",
  ),
  # shared_prefix_attention
  "shared-group-range": (
    pk.shared_prefix_attention,
    shared_args(group_of=jnp.array([0, 2, 0], I32)),
    "group_of",
  ),
  "shared-partial-prefix": (
    pk.shared_prefix_attention,
    shared_args(prefix_lengths=jnp.array([12, 8], I32)),
    "prefix_lengths",
  ),
  "shared-suffix-page-id": (
    pk.shared_prefix_attention,
    shared_args(suffix_block_tables=jnp.array([[4], [6], [0]], I32)),
    "suffix_block_tables",
  ),
  "shared-prefix-dtype": (
    pk.shared_prefix_attention,
    shared_args(prefix_block_tables=np.array([[1, 2], [3, 0]], np.int64)),
    "prefix_block_tables",
  ),
  # prefill_attention
  "prefill-cu-shape": (
    pk.prefill_attention,
    prefill_args(cu_q_lengths=jnp.array([0, 4], I32)),
    "cu_q_lengths",
  ),
  "prefill-cu-past-end": (
    pk.prefill_attention,
    prefill_args(cu_q_lengths=jnp.array([0, 4, 7], I32)),
    "cu_q_lengths",
  ),
  "prefill-q-longer-than-kv": (
    pk.prefill_attention,
    prefill_args(cu_q_lengths=jnp.array([0, 3, 6], I32)),
    "kv_lengths",
  ),
  "prefill-page-id": (
    pk.prefill_attention,
    prefill_args(block_tables=jnp.array([[1, 9], [3, 0]], I32)),
    "block_tables",
  ),
  # write_kv
  "write-slot-range": (
    pk.write_kv,
    write_args(slot_mapping=jnp.array([8, 40, -1], I32)),
    "slot_mapping",
  ),
  "write-slot-repeat": (
    pk.write_kv,
    write_args(slot_mapping=jnp.array([8, 8, -1], I32)),
    "slot_mapping",
  ),
  "write-heads": (
    pk.write_kv,
    write_args(k_new=jnp.zeros((3, 1, 32), F32)),
    "k_new",
  ),
  "write-v-dtype": (
    pk.write_kv,
    write_args(v_new=jnp.zeros((3, 2, 32), jnp.bfloat16)),
    "v_new",
  ),
  # copy_blocks
  "copy-range": (pk.copy_blocks, copy_args(dst=jnp.array([3, 5], I32)), "dst"),
  "copy-dtype": (
    pk.copy_blocks,
    copy_args(src=jnp.array([1.0, 2.0], F32)),
    "src",
  ),
  "copy-overlap": (
    pk.copy_blocks,
    copy_args(dst=jnp.array([3, 1], I32)),
    "dst",
  ),
  # tables without a page column (the Pallas grid read past them)
  "paged-no-columns": (
    pk.paged_attention,
    decode_args(
      block_tables=jnp.zeros((2, 0), I32), lengths=jnp.zeros((2,), I32)
    ),
    "block_tables.shape=.2, 0. has no page columns",
  ),
  "shared-no-prefix-columns": (
    pk.shared_prefix_attention,
    shared_args(
      prefix_block_tables=jnp.zeros((2, 0), I32),
      prefix_lengths=jnp.zeros((2,), I32),
    ),
    "prefix_block_tables.shape=.2, 0. has no page columns",
  ),
  # merge_attention_states
  "merge-lse-shape": (
    pk.merge_attention_states,
    merge_args(lse_b=jnp.zeros((2, 3), F32)),
    "lse_b",
  ),
  "merge-o-dtype": (
    pk.merge_attention_states,
    merge_args(o_b=jnp.zeros((2, 4, 32), jnp.bfloat16)),
    "o_b",
  ),
}


@pytest.mark.parametrize(
  ("fn", "args", "name"), BAD_CASES.values(), ids=BAD_CASES.keys()
)
def test_bad_arguments_raise_value_error_naming_them(fn, args, name):
  with pytest.raises(ValueError, match=name):
    fn(**args, backend="pallas_tpu", interpret=True)


def test_unknown_backend_is_rejected():
  with pytest.raises(ValueError, match="backend"):
    pk.paged_attention(**decode_args(), backend="cuda")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU-only rule")
@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_compiled_pallas_backend_on_cpu_needs_interpret(backend):
  with pytest.raises(ValueError, match="interpret=True"):
    pk.paged_attention(**decode_args(), backend=backend)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU-only rule")
def test_default_backend_on_cpu_logs_fallback_to_reference(caplog):
  _dispatch._log_once.cache_clear()
  with caplog.at_level(logging.WARNING, logger="pallas_kernels"):
    got = pk.resolve_backend(None, False, kernel="paged_attention")
    o = pk.paged_attention(**decode_args())
  assert got == ("reference", None)
  assert "falling back to the jnp reference" in caplog.text
  assert o.shape == (2, 4, 32)
  assert pk.resolve_backend(None, True, kernel="x")[0] == "pallas_tpu"
  assert pk.resolve_backend("pallas_gpu", True, kernel="x") == (
    "pallas_gpu",
    True,
  )


def test_traced_values_skip_concrete_checks():
  """Inside jit only static properties can be checked; values pass through."""

  @jax.jit
  def run(tables):
    return pk.paged_attention(
      **decode_args(block_tables=tables), backend="reference"
    )

  out = run(jnp.array([[1, 2], [3, 0]], I32))
  assert np.isfinite(np.asarray(out)).all()


def test_concrete_offsets_are_checked_when_the_lengths_are_traced():
  """cu_q_lengths' own rule needs no kv_lengths: a concrete bad offset is
  refused even when kv_lengths is a tracer (it ran with shifted rows)."""

  cu = jnp.array([1, 3, 2], I32)  # concrete: made outside the trace

  @jax.jit
  def run(kv):
    return pk.prefill_attention(
      **prefill_args(kv_lengths=kv, cu_q_lengths=cu), backend="reference"
    )

  with pytest.raises(ValueError, match="must start at 0, be non-decreasing"):
    run(jnp.array([12, 2], I32))


@pytest.mark.parametrize("interpret", [0, "yes", 1.0])
def test_interpret_must_be_a_bool_or_params(interpret):
  with pytest.raises(TypeError, match="must be a bool, None or an interpret"):
    pk.paged_attention(
      **decode_args(), backend="pallas_tpu", interpret=interpret
    )


@pytest.mark.parametrize(
  "kw, error, match",
  [
    (dict(return_lse="no"), TypeError, "return_lse='no' must be True or"),
    (dict(scale=float("nan")), ValueError, "scale=nan must be finite"),
    (dict(scale="0.1"), TypeError, "scale='0.1' must be a number"),
  ],
)
def test_flags_and_scale_are_checked(kw, error, match):
  """``return_lse="no"`` read as True; ``scale=nan`` gave NaN outputs."""
  with pytest.raises(error, match=match):
    pk.paged_attention(**decode_args(), backend="reference", **kw)


def test_max_group_size_must_be_an_int():
  with pytest.raises(ValueError, match=r"max_group_size=2\.5 must be an int"):
    pk.shared_prefix_attention(
      **shared_args(), max_group_size=2.5, backend="reference"
    )


EMPTY_CASES = {
  "paged_attention": (
    pk.paged_attention,
    lambda r: decode_args(
      q=jnp.zeros((0, 4, 32), F32),
      k_pages=r((2, 5, 8, 32)),
      v_pages=r((2, 5, 8, 32)),
      block_tables=jnp.zeros((0, 2), I32),
      lengths=jnp.zeros((0,), I32),
    ),
  ),
  "write_kv": (
    pk.write_kv,
    lambda r: write_args(
      k_pages=r((2, 5, 8, 32)),
      v_pages=r((2, 5, 8, 32)),
      k_new=jnp.zeros((0, 2, 32), F32),
      v_new=jnp.zeros((0, 2, 32), F32),
      slot_mapping=jnp.zeros((0,), I32),
    ),
  ),
  "copy_blocks": (
    pk.copy_blocks,
    lambda r: copy_args(
      k_pages=r((2, 5, 8, 32)),
      v_pages=r((2, 5, 8, 32)),
      src=jnp.zeros((0,), I32),
      dst=jnp.zeros((0,), I32),
    ),
  ),
  "merge_attention_states": (
    pk.merge_attention_states,
    lambda r: merge_args(
      o_a=jnp.zeros((0, 4, 32), F32),
      lse_a=jnp.zeros((0, 4), F32),
      o_b=jnp.zeros((0, 4, 32), F32),
      lse_b=jnp.zeros((0, 4), F32),
    ),
  ),
}


@pytest.mark.parametrize("kernel", EMPTY_CASES)
def test_zero_rows_give_the_references_result(kernel, rng):
  """No rows to compute: the Pallas path (which failed inside the kernel's
  index maps, or divided by zero) returns what the reference returns, the
  empty output or the pages unchanged."""
  fn, make = EMPTY_CASES[kernel]
  args = make(lambda shape: jnp.asarray(rng.standard_normal(shape), F32))
  got = fn(**args, backend="pallas_tpu", interpret=True)
  want = fn(**args, backend="reference")
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  if kernel in ("write_kv", "copy_blocks"):
    np.testing.assert_array_equal(np.asarray(got[0]), args["k_pages"])


def concat_args(**override):
  args = shared_args(**override)
  for name in ("q", "k_pages", "v_pages"):
    del args[name]
  return args


@pytest.mark.parametrize(
  "override, error, match",
  [
    (dict(group_of=jnp.array([0, 2, 0], I32)), ValueError, "group_of"),
    (dict(group_of=jnp.array([0, 1], I32)), ValueError, r"group_of\.shape"),
    (dict(prefix_lengths=jnp.array([12, 8], I32)), ValueError, "whole pages"),
    (
      dict(suffix_lengths=jnp.array([3, 9, 0], I32)),
      ValueError,
      "suffix_lengths has out-of-range values",
    ),
    (
      dict(prefix_lengths=jnp.array([24, 8], I32)),
      ValueError,
      "prefix_lengths has out-of-range values",
    ),
    (
      dict(suffix_block_tables=jnp.array([[4.0], [5], [0]], F32)),
      ValueError,
      r"suffix_block_tables\.dtype",
    ),
    (
      dict(prefix_block_tables=jnp.array([1, 2], I32)),
      ValueError,
      "prefix_block_tables must have rank 2",
    ),
    (dict(page_size=0), ValueError, "page_size=0 must be >= 1"),
    (dict(page_size=8.0), TypeError, r"page_size=8\.0 must be an int"),
  ],
)
def test_concat_block_tables_checks_its_arguments(override, error, match):
  """It took any shapes and values: an out-of-range group read another
  group's prefix, a partial prefix page dropped tokens silently."""
  page_size = override.pop("page_size", 8)
  with pytest.raises(error, match=match):
    pk.concat_block_tables(**concat_args(**override), page_size=page_size)


@pytest.mark.parametrize(
  "args, kw, error, match",
  [
    (([0, 2], [16, 8], [3, 4]), {}, ValueError, "group_of has out-of-range"),
    (([0, 1], [16, 8], [3]), {}, ValueError, r"suffix_lengths\.shape"),
    (([0, 1], [16.5, 8], [3, 4]), {}, ValueError, "must be an integer type"),
    (([0, 1], [16, 8], [3, -4]), {}, ValueError, "negative values"),
    (([[0, 1]], [16, 8], [3, 4]), {}, ValueError, "group_of must have rank 1"),
    (([0, 1], [16, 8], [3, 4]), dict(page_size=0), ValueError, "page_size"),
    (
      ([0, 1], [16, 8], [3, 4]),
      dict(min_bytes_ratio=float("nan")),
      ValueError,
      "min_bytes_ratio=nan must be finite and positive",
    ),
    (
      ([0, 1], [16, 8], [3, 4]),
      dict(min_bytes_ratio="2"),
      TypeError,
      "min_bytes_ratio='2' must be a number",
    ),
  ],
)
def test_prefer_shared_prefix_checks_its_arguments(args, kw, error, match):
  """It took any input: a group id past the prefixes was clamped into the
  last group, float lengths were truncated."""
  kw = {"page_size": 8, **kw}
  with pytest.raises(error, match=match):
    pk.prefer_shared_prefix(*(np.asarray(a) for a in args), **kw)


JIT_BACKENDS = [
  dict(backend="reference"),
  dict(backend="pallas_tpu", interpret=True),
]


def _pool(rng, num_pages=6):
  k = jnp.asarray(rng.standard_normal((2, num_pages, 8, 32)), F32)
  v = jnp.asarray(rng.standard_normal((2, num_pages, 8, 32)), F32)
  return k, v


def _assert_nan_rows(got, want, bad):
  got, want = np.asarray(got), np.asarray(want)
  assert np.isnan(got[bad]).all()
  np.testing.assert_allclose(got[~bad], want[~bad], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", JIT_BACKENDS, ids=lambda kw: kw["backend"])
def test_traced_out_of_range_pages_give_nan_rows_not_other_pages(rng, kw):
  """Under jit the page ids cannot be checked: an id past the pool was read
  as the last page, -1 as the last page too (Python wrap), a length past
  the table read truncated. Those rows are NaN now; the others unchanged,
  and an out-of-range id in a column the row does not use is harmless."""
  k, v = _pool(rng)
  q = jnp.asarray(rng.standard_normal((5, 4, 32)), F32)
  tables = rng.integers(0, 6, (5, 3)).astype(np.int32)
  lengths = rng.integers(1, 25, 5).astype(np.int32)
  lengths[0] = 8  # one page: column 1 unused
  tables[0, 1] = -1
  row = int(rng.integers(1, 5))
  tables[row, int(rng.integers(0, -(-lengths[row] // 8)))] = int(
    rng.choice([6, 1000, -1, -7])
  )
  other = 4 if row != 4 else 3
  lengths[other] = 3 * 8 + int(rng.integers(1, 9))  # past the table
  bad = np.zeros(5, bool)
  bad[[row, other]] = True
  run = jax.jit(
    lambda t, n: pk.paged_attention(q, k, v, t, n, return_lse=True, **kw)
  )
  o, lse = run(jnp.asarray(tables), jnp.asarray(lengths))
  safe_t = np.where((tables < 0) | (tables >= 6), 0, tables)
  safe_n = np.minimum(lengths, 24)
  o_ref, lse_ref = pk.paged_attention_reference(
    q, k, v, jnp.asarray(safe_t), jnp.asarray(safe_n), return_lse=True
  )
  _assert_nan_rows(o, o_ref, bad)
  _assert_nan_rows(lse, lse_ref, bad)


@pytest.mark.parametrize("kw", JIT_BACKENDS, ids=lambda kw: kw["backend"])
def test_traced_bad_groups_and_prefixes_give_nan_rows(rng, kw):
  """A group id past the groups, a prefix of a partial page or with a page
  id past the pool: the requests they touch are NaN, the rest unchanged."""
  k, v = _pool(rng)
  args = shared_args(
    q=jnp.asarray(rng.standard_normal((4, 4, 32)), F32),
    group_of=jnp.array([0, 1, 0, 1], I32),
    suffix_block_tables=jnp.array([[4], [5], [0], [2]], I32),
    suffix_lengths=jnp.array([3, 8, 0, 5], I32),
  )
  args.update(k_pages=k, v_pages=v)
  fault = str(rng.choice(["group", "partial", "page"]))
  group_of = np.array([0, 1, 0, 1], np.int32)
  prefix_lengths = np.array([16, 8], np.int32)
  prefix_tables = np.array([[1, 2], [3, 0]], np.int32)
  if fault == "group":
    group_of[3] = int(rng.choice([2, -1]))
    bad = np.array([False, False, False, True])
  elif fault == "partial":
    prefix_lengths[1] = 5
    bad = np.array([False, True, False, True])
  else:
    prefix_tables[0, 1] = 6
    bad = np.array([True, False, True, False])

  def call(g, n, t):
    a = dict(args, group_of=g, prefix_lengths=n, prefix_block_tables=t)
    return pk.shared_prefix_attention(**a, max_group_size=4, **kw)

  got = jax.jit(call)(
    jnp.asarray(group_of),
    jnp.asarray(prefix_lengths),
    jnp.asarray(prefix_tables),
  )
  want = call(
    jnp.array([0, 1, 0, 1], I32),
    jnp.array([16, 8], I32),
    args["prefix_block_tables"],
  )
  _assert_nan_rows(got, want, bad)


@pytest.mark.parametrize("kw", JIT_BACKENDS, ids=lambda kw: kw["backend"])
def test_traced_bad_prefill_sequences_give_nan_tokens(rng, kw):
  """A sequence whose pages lie past the pool (or with more new tokens than
  kv tokens) gets NaN tokens; offsets that are not valid make every token
  NaN."""
  k, v = _pool(rng)
  args = prefill_args(
    q=jnp.asarray(rng.standard_normal((6, 4, 32)), F32), k_pages=k, v_pages=v
  )
  tables = np.array([[1, 2], [3, 0]], np.int32)
  kv = np.array([12, 2], np.int32)
  fault = str(rng.choice(["page", "longer"]))
  if fault == "page":
    tables[1, 0] = 9
  else:
    kv[1] = 1  # two new tokens, one kv token
  bad = np.array([False] * 4 + [True] * 2)

  def call(t, n, cu):
    return pk.prefill_attention(
      **dict(args, block_tables=t, kv_lengths=n, cu_q_lengths=cu), **kw
    )

  cu = jnp.array([0, 4, 6], I32)
  got = jax.jit(call)(jnp.asarray(tables), jnp.asarray(kv), cu)
  want = call(args["block_tables"], args["kv_lengths"], cu)
  _assert_nan_rows(got, want, bad)
  all_bad = jax.jit(call)(
    args["block_tables"], args["kv_lengths"], jnp.array([1, 4, 6], I32)
  )
  assert np.isnan(np.asarray(all_bad)).all()


@pytest.mark.parametrize("kw", JIT_BACKENDS, ids=lambda kw: kw["backend"])
def test_traced_pages_and_slots_past_the_pool_touch_nothing_else(rng, kw):
  """copy_blocks under jit copied the last page for a source past the pool
  (the reference) or read past it (the kernel's DMA); write_kv's kernel
  wrote past the pool for a slot past it. Now a copy from past the pool
  fills its destination with NaN, one to past the pool is dropped, and a
  write past the pool is skipped; every other page is as the valid pairs
  and slots alone leave it."""
  k, v = _pool(rng)
  good_src, good_dst = int(rng.integers(0, 3)), int(rng.integers(3, 6))
  victim = int(
    rng.choice([d for d in range(6) if d not in (good_src, good_dst)])
  )
  src = jnp.array([good_src, 6 + int(rng.integers(0, 50)), good_src], I32)
  dst = jnp.array([good_dst, victim, 6 + int(rng.integers(0, 50))], I32)
  ko, vo = jax.jit(lambda s, d: pk.copy_blocks(k, v, s, d, **kw))(src, dst)
  want_k, want_v = pk.copy_blocks_reference(
    k, v, jnp.array([good_src], I32), jnp.array([good_dst], I32)
  )
  for got, want in ((ko, want_k), (vo, want_v)):
    got, want = np.asarray(got), np.asarray(want)
    assert np.isnan(got[:, victim]).all()
    rest = [p for p in range(6) if p != victim]
    np.testing.assert_array_equal(got[:, rest], want[:, rest])

  k_new = jnp.asarray(rng.standard_normal((3, 2, 32)), F32)
  v_new = jnp.asarray(rng.standard_normal((3, 2, 32)), F32)
  slot = int(rng.integers(0, 48))
  slots = jnp.array([slot, 48 + int(rng.integers(0, 100)), -1], I32)
  ko, vo = jax.jit(lambda s: pk.write_kv(k, v, k_new, v_new, s, **kw))(slots)
  want = pk.write_kv_reference(
    k, v, k_new[:1], v_new[:1], jnp.array([slot], I32)
  )
  np.testing.assert_array_equal(np.asarray(ko), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(vo), np.asarray(want[1]))
