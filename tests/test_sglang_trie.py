"""The SGLang engine's page trie (``sglang_tree.page_trie``, vectorized with
hashes checked exactly) against a plain-Python walk of the requests with a
dict of ``(parent, page tokens)``: the same node numbers (first appearance,
request by request, page by page), parents, depths, pre-order ranges and
first-32-token groups, on random traces with heavy sharing; and its exact
fallback (``_sorted_nodes``), also through a real hash collision."""

from __future__ import annotations

import numpy as np
import pytest

from prefixjax.serving import sglang_tree as tr


def _reference(prompts, outputs, max_new, K: int) -> dict:
  """The trie by a walk: a page is new when ``(parent, its tokens)`` is."""
  ids: dict = {}
  parent, depth, rows, heads = [0], [0], [], {}
  g32 = []
  for p, o, m in zip(prompts, outputs, max_new, strict=True):
    seq = (list(p) + list(o))[: len(p) + int(m)]
    g32.append(
      heads.setdefault(tuple(seq[:32]), len(heads)) if len(seq) >= 32 else -1
    )
    node, row = 0, []
    for j in range((len(p) + int(m) - 1) // K):
      key = (node, tuple(seq[j * K : (j + 1) * K]))
      if key not in ids:
        ids[key] = len(parent)
        parent.append(node)
        depth.append(j)
      node = ids[key]
      row.append(node)
    rows.append(row)
  V = len(parent)
  kids = [[] for _ in range(V)]
  for v in range(1, V):
    kids[parent[v]].append(v)
  tin, tout = [0] * V, [0] * V
  count = 0
  stack = [(0, False)]
  while stack:  # pre-order, children by id; tout after the subtree
    v, closing = stack.pop()
    if closing:
      tout[v] = count - 1
      continue
    tin[v] = count
    count += 1
    stack.append((v, True))
    stack.extend((k, False) for k in reversed(kids[v]))
  M = max([1] + [len(r) for r in rows])
  pages = np.full((len(rows), M), -1, np.int32)
  for r, row in enumerate(rows):
    pages[r, : len(row)] = row
  return dict(
    pages=pages,
    parent=np.asarray(parent, np.int32),
    depth=np.asarray(depth, np.int32),
    tin=np.asarray(tin, np.int32),
    tout=np.asarray(tout, np.int32),
    g32=np.asarray(g32, np.int32),
  )


def _random_trace(rng):
  """Requests from a few shared stems, small alphabets (many equal pages at
  different places), some shorter than a page, ``max_new`` up to the
  output's length."""
  R = int(rng.integers(1, 40))
  alphabet = int(rng.choice([2, 3, 50]))
  stems = [
    rng.integers(0, alphabet, int(rng.integers(0, 80))) for _ in range(3)
  ]
  prompts, outputs, max_new = [], [], []
  for _ in range(R):
    stem = stems[int(rng.integers(0, 3))][: int(rng.integers(0, 80))]
    tail = rng.integers(0, alphabet, int(rng.integers(0, 40)))
    prompt = np.concatenate([stem, tail]).astype(np.int64)
    if prompt.shape[0] == 0:
      prompt = np.asarray([int(rng.integers(0, alphabet))], np.int64)
    out = rng.integers(0, alphabet, int(rng.integers(1, 30))).astype(np.int64)
    prompts.append(prompt)
    outputs.append(out)
    max_new.append(int(rng.integers(1, out.shape[0] + 1)))
  return prompts, outputs, np.asarray(max_new, np.int32)


def _assert_same(got: dict, want: dict):
  assert sorted(got) == sorted(want)
  for k in want:
    assert got[k].dtype == want[k].dtype, k
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("K", [1, 2, 3, 4, 16])
def test_page_trie_equals_a_walk(rng, K):
  for _ in range(6):
    prompts, outputs, max_new = _random_trace(rng)
    want = _reference(prompts, outputs, max_new, K)
    _assert_same(tr.page_trie(prompts, outputs, max_new, K), want)


def _occurrences(prompts, outputs, max_new, K):
  """``page_trie``'s inputs to the node functions: the page rows, each
  request's page count and first occurrence."""
  n = np.asarray(
    [(len(p) + int(m) - 1) // K for p, m in zip(prompts, max_new, strict=True)]
  )
  off = np.concatenate([[0], np.cumsum(n)])
  rows = [
    np.concatenate([p, o])[: n[r] * K]
    for r, (p, o) in enumerate(zip(prompts, outputs, strict=True))
  ]
  return np.concatenate(rows).reshape(-1, K).astype(np.int64), n, off


@pytest.mark.parametrize("K", [1, 4])
def test_exact_fallback_equals_the_hashed_nodes(rng, K):
  """``_sorted_nodes`` (the fallback) numbers the occurrences as the hashed
  path does, and both give the walk's nodes."""
  for _ in range(6):
    prompts, outputs, max_new = _random_trace(rng)
    rows, n, off = _occurrences(prompts, outputs, max_new, K)
    rid = np.repeat(np.arange(n.shape[0]), n)
    j = np.arange(rows.shape[0]) - off[rid]
    hashed = tr._hashed_nodes(rows, j, off[rid])
    assert hashed is not None
    np.testing.assert_array_equal(tr._sorted_nodes(rows, n, off), hashed)
    want = _reference(prompts, outputs, max_new, K)["pages"]
    np.testing.assert_array_equal(hashed + 1, want[want > 0])


def test_a_hash_collision_takes_the_exact_path():
  """Two different pages with one page hash: with the page hash a sum of
  token times multiplier, ``[m1, 0]`` and ``[0, m0]`` collide. The check
  sees it and the exact sorts give the walk's trie."""
  K = 2
  m0, m1 = (
    int(x)
    for x in np.random.default_rng(tr._HASH_SEED).integers(
      1, 2**63, size=(K,), dtype=np.uint64
    )
    | np.uint64(1)
  )
  prompts = [np.asarray([m1, 0, 5], np.int64), np.asarray([0, m0, 5], np.int64)]
  outputs = [np.asarray([7], np.int64)] * 2
  max_new = np.asarray([1, 1], np.int32)
  rows, n, off = _occurrences(prompts, outputs, max_new, K)
  rid = np.repeat(np.arange(2), n)
  assert tr._hashed_nodes(rows, np.arange(2) - off[rid], off[rid]) is None
  got = tr.page_trie(prompts, outputs, max_new, K)
  _assert_same(got, _reference(prompts, outputs, max_new, K))
  assert got["parent"].shape == (3,)  # two distinct first pages
