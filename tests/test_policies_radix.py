"""``lru_leaf`` vs the SGLang radix model, on workloads drawn by hypothesis.

The device cache with the ``lru_leaf`` policy and
``SglangRadixCache(granularity="page", conservative_evict=False)`` (one page
per node, so leaf-only LRU per block; evict only the pages an allocation
needs) serve the same requests one at a time; per request the hit tokens
must be equal, and at the end the number of cached blocks. Workloads have
heavy sharing (a few shared prefixes picked Zipf-like, multi-turn extensions
of recent requests, exact repeats, extra keys) and eviction pressure (10
usable blocks, sequences of up to 8 blocks), with decode (outputs of up to
``2 * K + 1`` tokens, whose blocks are published as they fill).

Two documented differences are kept out of the workloads (see
``test_policies.test_lru_leaf_matches_sglang_page_radix``); both are vLLM's
duplicate blocks, which the device keeps (a block of capacity until evicted,
and the cached original is not refreshed) and SGLang's tree frees at once:

* A prompt that ends on a block boundary with *all* its blocks cached: the
  hit is capped at ``P - 1`` tokens, so the last block is recomputed into a
  duplicate. The workload is built next to the model and such a prompt
  loses its last token; every other block-aligned prompt is kept (one whose
  last block is not cached publishes a new key, as in SGLang).
* A decode block whose key is already cached. Output tokens are fresh for
  every request (in serving they depend on the prompt, so a repeat with
  greedy decoding would recompute cached blocks), so a block holding one is
  never cached before its request; later turns still hit it, since an
  extension's prompt is a recent request's prompt plus its outputs.

What this cannot see: served one at a time, a block is used with its whole
prefix, so a parent is never older than its child, the blocks with the
oldest stamp are what is left of one request's chain, and no two leaves
share a stamp. So here ``lru_leaf`` evicts what plain LRU with the
deepest-first tie-break evicts, and what vLLM's free queue
(``lru`` with ``free_order="prepend_unhashed"``) evicts; the tie-break
among leaves never decides. Those rules need concurrent sequences (see
``test_policies.test_tie_breaking`` and the leaf fallback test). This test
catches wrong stamps (hits or publishes not refreshing, hits one step
stale, most recent first), evicting more than an allocation or a decode
step needs, and duplicate blocks.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np
from hypothesis import given, settings, target
from hypothesis import strategies as st
from reference_models import sglang_radix
from test_policies import K, M, N, T, _run_decode

from prefixjax.cache import prefix_cache as pc

R = 64  # requests per scan (real ones, then fillers): one compilation
MIN_REQUESTS = 16
VOCAB = 4  # prompt tokens; outputs are >= FRESH and never repeat
FRESH = 100
MAX_OUTPUTS = 2 * K + 1
RECENT = 6  # extensions and repeats pick one of the last RECENT requests


class New(NamedTuple):
  """A cut of a shared prefix (``cut=None``: all of it) plus a suffix."""

  prefix: int
  cut: int | None
  suffix: list[int]
  salt: int
  outputs: int


class Extend(NamedTuple):
  """The next turn: a recent request's prompt and outputs, plus a suffix."""

  back: int
  suffix: list[int]
  outputs: int


class Repeat(NamedTuple):
  """A recent request's prompt again (new outputs)."""

  back: int
  outputs: int


_tokens = st.integers(0, VOCAB - 1)
_outputs = st.one_of(st.just(1), st.integers(2, MAX_OUTPUTS))
_new = st.builds(
  New,
  prefix=st.sampled_from((0, 0, 0, 0, 1, 1, 2, 3)),  # Zipf-like reuse
  cut=st.one_of(st.none(), st.integers(0, 6 * K - 1)),
  suffix=st.lists(_tokens, max_size=3 * K),
  salt=st.sampled_from((0, 0, 0, 1)),
  outputs=_outputs,
)
_extend = st.builds(
  Extend,
  back=st.integers(0, RECENT - 1),
  suffix=st.lists(_tokens, min_size=1, max_size=K + 1),
  outputs=_outputs,
)
_repeat = st.builds(Repeat, back=st.integers(0, RECENT - 1), outputs=_outputs)
_prefix = st.integers(K, 6 * K).flatmap(
  lambda n: st.lists(_tokens, min_size=n, max_size=n)
)
WORKLOADS = st.tuples(
  st.lists(_prefix, min_size=1, max_size=4),
  st.lists(
    st.one_of(_new, _new, _extend, _repeat),
    min_size=MIN_REQUESTS,
    max_size=R,
  ),
)


class Request(NamedTuple):
  prompt: list[int]
  outputs: list[int]
  salt: int


def serve_on_model(prefixes, specs, radix):
  """Builds the requests from ``specs`` while serving them on ``radix``.

  Returns ``(requests, hits, counts)``: the requests as served, the model's
  hit tokens per request, and how many block-aligned prompts were kept
  (``"aligned"``) or lost their last token (``"trimmed"``).
  """
  requests: list[Request] = []
  hits: list[int] = []
  counts: collections.Counter[str] = collections.Counter()
  fresh = FRESH
  for spec in specs:
    if isinstance(spec, New):
      base = prefixes[spec.prefix % len(prefixes)]
      cut = len(base) if spec.cut is None else spec.cut
      prompt, salt = base[:cut] + spec.suffix, spec.salt
    else:
      prev = (
        requests[max(0, len(requests) - 1 - spec.back)] if requests else None
      )
      if prev is None:
        prompt, salt = [0], 0
      elif isinstance(spec, Extend):
        prompt, salt = prev.prompt + prev.outputs + spec.suffix, prev.salt
      else:
        prompt, salt = prev.prompt, prev.salt
    prompt = (prompt or [0])[:T]
    p = len(prompt)
    if p % K == 0:
      keys = sglang_radix.page_keys_for_tokens(prompt, K, salt)
      if radix._present(keys) == p // K:  # would make a duplicate block
        prompt = prompt[:-1]
        counts["trimmed"] += 1
      else:
        counts["aligned"] += 1
    num_outputs = min(spec.outputs, T - len(prompt) + 1)
    outputs = list(range(fresh, fresh + num_outputs))
    fresh += num_outputs
    hits.append(radix.run_request(prompt, outputs, extra=salt))
    requests.append(Request(prompt, outputs, salt))
  return requests, hits, counts


def serve_on_device(requests):
  """One scan over ``requests``; returns the final state and the outputs."""
  n = len(requests)
  tokens = np.zeros((n, T), np.int32)
  for i, r in enumerate(requests):
    seq = (r.prompt + r.outputs)[:T]  # the last output token is never KV
    tokens[i, : len(seq)] = seq
  lens = np.asarray([len(r.prompt) for r in requests], np.int32)
  olens = np.asarray([len(r.outputs) for r in requests], np.int32)
  salts = np.asarray([r.salt for r in requests], np.uint32)
  state = pc.init(N, K, max_seqs=1, max_blocks_per_seq=M, policy="lru_leaf")
  final, (status, bad, hit_tokens, _) = _run_decode(
    state, tokens, lens, olens, salts
  )
  return final, np.asarray(status), np.asarray(bad), np.asarray(hit_tokens)


def test_lru_leaf_matches_sglang_page_radix_on_drawn_workloads():
  """Equal hits per request; most examples evict; one compilation."""
  tally: collections.Counter[str] = collections.Counter()
  compiled = _run_decode._cache_size()

  @settings(max_examples=100, deadline=None)
  @given(WORKLOADS)
  def check(workload):
    prefixes, specs = workload
    radix = sglang_radix.SglangRadixCache(
      N - 1, K, granularity="page", conservative_evict=False
    )
    requests, want, counts = serve_on_model(prefixes, specs, radix)
    evicted = radix.stats["evicted_pages"]
    # Fillers: 1-token prompts (no full block) up to the scan length.
    fillers = [Request([0], [FRESH - 1], 0)] * (R - len(requests))
    want += [radix.run_request(r.prompt, r.outputs) for r in fillers]
    final, status, bad, got = serve_on_device(requests + fillers)
    assert not status.any() and not bad.any()
    mismatch = np.nonzero(got != np.asarray(want))[0]
    assert not mismatch.size, (
      f"request {mismatch[0]}: device hit {got[mismatch[0]]}, model "
      f"{want[mismatch[0]]}; requests[:{mismatch[0] + 1}] = "
      f"{requests[: mismatch[0] + 1]}"
    )
    assert int(final.stats.num_cached) == radix.cached_pages()
    radix.check_invariants()
    assert pc.check_invariants(final) == []
    target(float(evicted), label="evicted pages")
    tally["examples"] += 1
    tally["evicting"] += int(evicted > 0)
    tally["hit tokens"] += sum(want)
    tally.update(counts)
    tally["decode requests"] += sum(len(r.outputs) > 1 for r in requests)

  check()
  print(dict(tally))  # shown on failure
  assert tally["evicting"] >= tally["examples"] // 2, tally
  assert tally["hit tokens"] and tally["aligned"], tally
  assert tally["decode requests"], tally
  assert _run_decode._cache_size() - compiled <= 1
