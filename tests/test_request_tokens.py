"""``serving.simulate``'s host-side token rule (``_request_tokens``) against
a plain-Python walk of the records, written from its docstring: a prompt
empty or of ``prompt_limit`` tokens or more is rejected with no outputs;
the others sample ``min(max_tokens, total - P)`` tokens (under SGLang's
allocator bound at most ``pool - ceil_page(P) - page - 1``): the record's
``output_tok_ids`` first, then ``fabricated_token(rid, pos)``. Random
records (lists and arrays of several integer dtypes, output ids shorter
and longer than the outputs sampled) are drawn fresh per case; a bad
record among good ones must give the error that names it.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

sim = importlib.import_module("prefixjax.serving.simulate")


def _model(records, lengths):
  prompts, outputs, plen, mt, rej = [], [], [], [], []
  for rid, rec in enumerate(records):
    prompt = [int(x) for x in rec["input_tok_ids"]]
    given = rec.get("output_tok_ids")
    given = [] if given is None else [int(x) for x in given]
    m = int(rec["output_toks"]) if "output_toks" in rec else len(given)
    p = len(prompt)
    prompts.append(prompt)
    plen.append(p)
    mt.append(m)
    if not 0 < p < lengths.prompt_limit:
      rej.append(True)
      outputs.append([])
      continue
    rej.append(False)
    n = min(m, lengths.total - p)
    if lengths.pool is not None:
      k = lengths.page
      n = min(n, lengths.pool - -(-p // k) * k - k - 1)
    out = given[:n]
    out += [sim.fabricated_token(rid, pos) for pos in range(len(out), n)]
    outputs.append(out)
  return prompts, outputs, plen, mt, rej


def _records(rng, n, limit):
  out = []
  for _ in range(n):
    p = int(rng.choice([0, 1, limit - 1, limit, limit + 3, *range(2, 40)]))
    m = int(rng.integers(1, 60))
    tokens = rng.integers(0, 2**31, p)
    kind = int(rng.integers(4))
    if kind == 0:
      tokens = tokens.tolist()
    elif kind == 1:
      tokens = (tokens % 30000).astype(np.int32)
    elif kind == 2:
      tokens = (tokens % 200).astype(np.uint8)
    rec = dict(input_tok_ids=tokens)
    shape = int(rng.integers(3))
    if shape != 1:
      rec["output_toks"] = m
    if shape != 0:  # output ids, shorter or longer than the outputs
      n_ids = int(rng.integers(0 if shape == 2 else 1, 80))
      ids = rng.integers(0, 2**31, n_ids)
      rec["output_tok_ids"] = ids.tolist() if rng.random() < 0.5 else ids
    out.append(rec)
  return out


@pytest.mark.parametrize("pool", [False, True])
def test_tokens_equal_the_record_walk(rng, pool):
  for _ in range(4):
    limit = int(rng.integers(20, 50))
    total = limit + int(rng.integers(0, 30))
    lengths = sim._Lengths(limit, total)
    if pool:  # an allocator bound that binds, never below one output
      k = int(rng.choice([1, 4, 16]))
      room = int(rng.integers(1, 10))  # for the longest accepted prompt
      pool = -(-(limit - 1) // k) * k + k + 1 + room
      lengths = sim._Lengths(limit, total, pool, k)
    records = _records(rng, int(rng.integers(1, 40)), limit)
    got = sim._request_tokens(records, lengths)
    want = _model(records, lengths)
    assert [a.tolist() for a in got[0]] == want[0]
    assert [a.tolist() for a in got[1]] == want[1]
    assert got[2].tolist() == want[2] and got[2].dtype == np.int32
    assert got[3].tolist() == want[3] and got[3].dtype == np.int32
    assert got[4].tolist() == want[4]
    assert all(a.dtype == np.int64 for a in got[0] + got[1])


BAD = [
  (dict(input_tok_ids=[1, 2**31]), r"input_tok_ids\[1\]=2147483648"),
  (dict(input_tok_ids=[1, -3, 4]), r"input_tok_ids\[1\]=-3"),
  (dict(input_tok_ids=[[1, 2]]), "input_tok_ids must be a list of token ids"),
  (dict(input_tok_ids=[1.5]), "input_tok_ids must be a list of token ids"),
  (dict(input_tok_ids=[1], output_tok_ids=[5, -1]), r"output_tok_ids\[1\]=-1"),
  (dict(input_tok_ids=[1], output_toks=0), "max_tokens=0 must be >= 1"),
  (dict(input_tok_ids=[1]), "no output_toks and no output_tok_ids"),
  (dict(input_tok_ids=[1], output_toks=2**31), "max_tokens=2147483648 must"),
]


@pytest.mark.parametrize("later", [False, True])
@pytest.mark.parametrize("bad, match", BAD)
def test_a_bad_record_is_named(rng, bad, match, later):
  """The first bad record is named, wherever it is, after good ones of
  every shape (and before a later bad one)."""
  records = _records(rng, int(rng.integers(2, 30)), 40)
  at = int(rng.integers(len(records)))
  bad = dict(bad)
  if "output_toks" not in bad and "output_tok_ids" not in bad:
    if "no output_toks" not in match:
      bad["output_toks"] = 3
  records = records[:at] + [bad] + records[at:]
  if later:
    records.append(dict(input_tok_ids=[-7], output_toks=1))
  with pytest.raises(ValueError, match=rf"record {at}: {match}"):
    sim._request_tokens(records, sim._Lengths(40, 60))


def test_no_room_names_the_first_record_without_room(rng):
  """Under the allocator bound a prompt with no room for an output is
  refused by record, the first one, even with a malformed record after."""
  k = 4
  lengths = sim._Lengths(60, 70, 48, k)  # room = 48 - ceil4(P) - 5
  ok = [dict(input_tok_ids=[1] * int(rng.integers(1, 36)), output_toks=2)]
  tight = dict(input_tok_ids=[2] * 41, output_toks=2)  # 48 - 44 - 5 < 1
  records = ok * int(rng.integers(1, 5)) + [tight] + [dict(input_tok_ids=[1])]
  at = len(records) - 2
  with pytest.raises(ValueError, match=rf"record {at}: .*prefill"):
    sim._request_tokens(records, lengths)
