"""Runs random operation streams on the device and on the Python model.

The device side applies a whole stream inside one jitted ``lax.scan`` (so
10^5 operations cost seconds, not minutes) and returns the state after every
step; the host side replays the same stream on
:class:`reference_models.paging_model.PagingModel` and compares everything:
results, block tables, token counts, refcounts, published flags and the exact
free-queue order and links.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
from reference_models.paging_model import PagingModel

from prefixjax.cache import paging

ALLOCATE, APPEND, FORK, COPY, RELEASE, PUBLISH, NOOP, RELEASE_HEAD = range(8)
"""``RELEASE_HEAD``: ``release(..., vllm_version="0.33")`` (vLLM >= 0.23);
``RELEASE`` is vLLM 0.22's all-to-the-tail order."""
NUM_KINDS = 8


@functools.partial(jax.jit, static_argnames=())
def run_stream(state: paging.PagingState, ops: jax.Array):
  """Applies ``ops`` (``[L, 3]`` int32 rows ``kind, a, b``) in a scan.

  Returns the final state and per-step ``(states, results)`` stacked.
  """
  m = state.max_blocks_per_seq
  none_m = jnp.full((m,), paging.NO_BLOCK, jnp.int32)
  none_1 = jnp.full((1,), paging.NO_BLOCK, jnp.int32)

  def pack(status, new=none_m, src=none_1, dst=none_1, freed=none_m):
    return dict(status=status, new=new, src=src, dst=dst, freed=freed)

  def step(state, op):
    kind, a, b = op[0], op[1], op[2]

    def do_allocate(s):
      s, r = paging.allocate(s, a, b)
      return s, pack(r.status, new=r.new_blocks)

    def do_append(s):
      s, r = paging.append(s, a, b)
      return s, pack(r.status, new=r.new_blocks, src=r.src, dst=r.dst)

    def do_fork(s):
      s, status = paging.fork(s, a, b)
      return s, pack(status)

    def do_copy(s):
      s, r = paging.copy_on_write(s, a)
      return s, pack(r.status, src=r.src, dst=r.dst)

    def do_release(s):
      s, r = paging.release(s, a, vllm_version="0.22")
      return s, pack(r.status, freed=r.freed_blocks)

    def do_publish(s):
      # Marks column b of sequence a published if the sequence holds it.
      seq = jnp.clip(a, 0, s.max_seqs - 1)
      held = paging.blocks_for(s.num_tokens[seq], s.block_size)
      ok = (a >= 0) & (a < s.max_seqs) & s.active[seq] & (b >= 0) & (b < held)
      block = s.block_tables[seq, jnp.clip(b, 0, m - 1)]
      published = paging.scatter(s.published, block[None], True, ok)
      return s.replace(published=published), pack(jnp.int32(0))

    def do_noop(s):
      return s, pack(jnp.int32(0))

    def do_release_head(s):
      s, r = paging.release(s, a, vllm_version="0.33")
      return s, pack(r.status, freed=r.freed_blocks)

    state, result = jax.lax.switch(
      kind,
      [
        do_allocate,
        do_append,
        do_fork,
        do_copy,
        do_release,
        do_publish,
        do_noop,
        do_release_head,
      ],
      state,
    )
    return state, (state, result)

  return jax.lax.scan(step, state, ops)


def random_ops(
  rng: np.random.Generator,
  length: int,
  sizes: dict,
  head_releases: float = 0.0,
  publish_share: float = 0.05,
) -> np.ndarray:
  """A random stream biased to fill the pool, with some invalid arguments.

  ``head_releases`` of the releases are ``RELEASE_HEAD`` (vLLM 0.33's
  order); ``publish_share`` of the operations publish a
  block (taken from the allocations).
  """
  s, m, k = sizes["max_seqs"], sizes["max_blocks_per_seq"], sizes["block_size"]
  kinds = rng.choice(
    NOOP,
    size=length,
    p=[0.35 - publish_share, 0.3, 0.12, 0.06, 0.17, publish_share],
  )
  if head_releases:
    head = (kinds == RELEASE) & (rng.random(length) < head_releases)
    kinds = np.where(head, RELEASE_HEAD, kinds)
  seq = rng.integers(-1, s + 1, size=length)  # includes out-of-range ids
  counts = rng.integers(0, 2 * k + 1, size=length)
  big = rng.random(length) < 0.03
  counts = np.where(big, rng.integers(0, (m + 1) * k + 1, size=length), counts)
  counts = np.where(rng.random(length) < 0.01, -1, counts)
  children = rng.integers(-1, s + 1, size=length)
  columns = rng.integers(-1, m + 1, size=length)
  b = np.where(kinds == FORK, children, counts)
  b = np.where(kinds == PUBLISH, columns, b)
  return np.stack([kinds, seq, b], axis=1).astype(np.int32)


def _apply_model(model: PagingModel, kind: int, a: int, b: int):
  if kind == ALLOCATE:
    return model.allocate(a, b)
  if kind == APPEND:
    return model.append(a, b)
  if kind == FORK:
    return model.fork(a, b)
  if kind == COPY:
    return model.copy_on_write(a)
  if kind == RELEASE:
    return model.release(a)
  if kind == RELEASE_HEAD:
    return model.release(a, unpublished_first=True)
  if kind == PUBLISH:
    if 0 <= a < model.max_seqs and a in model.tables:
      held = -(-model.tokens[a] // model.block_size)
      if 0 <= b < held:
        model.publish(model.tables[a][b])
  return None


def _expected_links(model: PagingModel):
  """The free queue's ``next`` / ``prev`` lists, head and tail."""
  nxt = [paging.NO_BLOCK] * model.num_blocks
  prv = [paging.NO_BLOCK] * model.num_blocks
  q = model.free_queue
  for before, after in zip(q, q[1:], strict=False):
    nxt[before] = after
    prv[after] = before
  head = q[0] if q else paging.NO_BLOCK
  tail = q[-1] if q else paging.NO_BLOCK
  return nxt, prv, head, tail


def _padded(values, width) -> list:
  return list(values) + [paging.NO_BLOCK] * (width - len(values))


STATE_FIELDS = (
  "block_tables",
  "num_tokens",
  "active",
  "refcounts",
  "published",
  "free_next",
  "free_prev",
  "free_head",
  "free_tail",
  "num_free",
)
"""The device state's fields compared with the model after every step."""


def _expected_lists(model: PagingModel) -> dict:
  """:data:`STATE_FIELDS` as the model implies them, in plain lists."""
  m, s = model.max_blocks, model.max_seqs
  tables = [[0] * m for _ in range(s)]
  tokens = [0] * s
  active = [False] * s
  for seq, row in model.tables.items():
    tables[seq][: len(row)] = row
    tokens[seq] = model.tokens[seq]
    active[seq] = True
  nxt, prv, head, tail = _expected_links(model)
  return dict(
    block_tables=tables,
    num_tokens=tokens,
    active=active,
    refcounts=list(model.refcounts),
    published=list(model.published),
    free_next=nxt,
    free_prev=prv,
    free_head=head,
    free_tail=tail,
    num_free=len(model.free_queue),
  )


def compare_stream(sizes: dict, ops: np.ndarray, check_every: int = 1) -> int:
  """Runs ``ops`` on both sides; raises AssertionError on the first mismatch.

  ``check_invariants`` runs on the device state every ``check_every`` steps.
  Returns the number of operations compared.

  The device's per-step states and results are turned into Python lists
  once and compared with the model's lists (10^5 steps in seconds, where
  numpy's assertions cost tens of microseconds per array); a difference is
  then worded by :func:`assert_state_equal` and numpy's assertions.
  """
  state = paging.init(**sizes)
  model = PagingModel(**sizes)
  _, (states, results) = run_stream(state, jnp.asarray(ops))
  fields = {
    f: np.asarray(getattr(states, f))
    for f in paging.PagingState.__dataclass_fields__
    if f != "block_size"
  }
  assert set(STATE_FIELDS) <= set(fields), sorted(fields)
  lists = {f: fields[f].tolist() for f in STATE_FIELDS}
  results = jax.tree.map(np.asarray, results)
  result_lists = {k: v.tolist() for k, v in results.items()}
  m = sizes["max_blocks_per_seq"]
  for i, (kind, a, b) in enumerate(ops.tolist()):
    where = f"step {i} op {(kind, a, b)}"
    out = _apply_model(model, kind, a, b)
    if out is not None:
      assert result_lists["status"][i] == out.status, (
        f"{where}: status {results['status'][i]} != model {out.status}"
      )
      want = {
        "new": _padded(out.new_blocks, m),
        "src": _padded([c[0] for c in out.copies], 1),
        "dst": _padded([c[1] for c in out.copies], 1),
        "freed": _padded(out.freed, m),
      }
      for key, value in want.items():
        if result_lists[key][i] != value:
          np.testing.assert_array_equal(results[key][i], value, where)
          raise AssertionError(f"{where}: {key} {results[key][i]} != {value}")
    expected = _expected_lists(model)
    if any(lists[f][i] != expected[f] for f in STATE_FIELDS):
      one = types.SimpleNamespace(**{f: v[i] for f, v in fields.items()})
      assert_state_equal(one, model, where)
      raise AssertionError(f"{where}: the state differs from the model")
    if check_every and i % check_every == 0:
      one = {f: v[i] for f, v in fields.items()}
      one = paging.PagingState(**one, block_size=states.block_size)
      errors = paging.check_invariants(one)
      assert not errors, f"{where}: {errors}"
  return len(ops)


def assert_state_equal(state, model: PagingModel, where):
  """Every field of ``state`` equals what the model implies."""
  m, s = model.max_blocks, model.max_seqs
  tables = np.zeros((s, m), np.int32)
  tokens = np.zeros(s, np.int32)
  active = np.zeros(s, bool)
  for seq, row in model.tables.items():
    tables[seq, : len(row)] = row
    tokens[seq] = model.tokens[seq]
    active[seq] = True
  np.testing.assert_array_equal(state.block_tables, tables, where)
  np.testing.assert_array_equal(state.num_tokens, tokens, where)
  np.testing.assert_array_equal(state.active, active, where)
  np.testing.assert_array_equal(state.refcounts, model.refcounts, where)
  np.testing.assert_array_equal(state.published, model.published, where)
  nxt, prv, head, tail = _expected_links(model)
  np.testing.assert_array_equal(state.free_next, nxt, where)
  np.testing.assert_array_equal(state.free_prev, prv, where)
  assert int(state.free_head) == head, where
  assert int(state.free_tail) == tail, where
  assert int(state.num_free) == len(model.free_queue), where
