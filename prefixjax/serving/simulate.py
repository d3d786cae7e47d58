"""Host side of the serving simulator: trace in, oracle-format records out.

:func:`simulate` prepares a trace (token ids of every request's prompt and
outputs, its block keys, the arrival and priority orders), runs
:func:`prefixjax.serving.vllm_v1.run` (one jitted ``lax.while_loop`` over
engine steps) and returns a :class:`SimResult`, whose :meth:`SimResult.steps`
and :meth:`SimResult.requests` have the keys and values of
``tests/reference_models/vllm_scheduler.py`` ``VllmScheduler.simulate``
(arrivals ``"zero"``, or ``"time"`` for ``"trace"`` and ``"poisson"``; no
``cached_hashes``), and :meth:`SimResult.metrics` summarises them.
:func:`simulate_batch` runs many configurations that share static shapes
through one compiled program (vmapped and sharded, or one by one).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prefixjax import configs
from prefixjax._host import (
  release_compiled_near_map_limit,
  replicate,
  shard_lanes,
  thread_map,
  to_device,
)
from prefixjax.cache import hashing
from prefixjax.cache import prefix_cache as pc
from prefixjax.serving import roofline
from prefixjax.serving import vllm_v1 as engine
from prefixjax.serving.config import ServingConfig
from prefixjax.serving.engine_state import (
  first_rows,
  join_rows,
  next_pow2,
  segment_rows,
)
from prefixjax.serving.results import SimResult
from prefixjax.workloads import Trace

__all__ = [
  "ARRIVALS",
  "CLOCKS",
  "NUM_FABRICATED_VOCAB",
  "SimResult",
  "arrival_steps",
  "arrival_times_s",
  "build_inputs",
  "fabricated_token",
  "prepare_records",
  "records_from_trace",
  "simulate",
  "simulate_batch",
  "fan_out",
]

NUM_FABRICATED_VOCAB = 32000
ARRIVALS = ("zero", "trace", "poisson")
CLOCKS = ("steps", "roofline")
DEFAULT_MODEL = "llama3_8b"
DEFAULT_HARDWARE = "h100"
Arrivals = Literal["zero", "trace", "poisson"]


def fabricated_token(rid: int, pos: int) -> int:
  """The oracle harness's output token when the trace has no output ids."""
  return (rid * 7919 + pos) % NUM_FABRICATED_VOCAB + 1


def no_output_message(trace: Trace, source: str) -> str | None:
  """Why ``trace`` (read from ``source``) cannot be served, or None: a
  request with no output token (vLLM's ``max_tokens`` must be >= 1; a
  replay of the same trace is fine, it reads prompts only)."""
  empty = np.flatnonzero(np.asarray(trace.output_lengths) < 1)
  if not empty.size:
    return None
  return (
    f"{source}: request {int(empty[0])} (0-based; {empty.size} in all) has "
    "output_length 0: serving needs at least one output token per request "
    "(vLLM's max_tokens >= 1)"
  )


def records_from_trace(trace: Trace) -> list[dict[str, Any]]:
  """A :class:`prefixjax.workloads.Trace` as the harness's trace records.

  Each record has ``input_tok_ids``, ``output_toks``, ``arrival_time_ns``
  (``round(arrival_times_s * 1e9)``), with output ids ``output_tok_ids``,
  with session ids ``client`` (the ``fair`` scheduler's client) and with
  priorities ``priority`` (the ``priority`` scheduler's). A trace
  with Mooncake-style ``hash_ids`` instead of token ids is served with
  tokens synthesised from them (:meth:`Trace.with_token_ids`: equal ids,
  equal tokens, so its sharing is the trace's).

  Raises:
    ValueError: a length-only trace (no token ids, no hash ids).
  """
  trace = _with_tokens(trace)
  out = []
  for i in range(len(trace)):
    rec: dict[str, Any] = dict(
      input_tok_ids=[int(t) for t in trace.input_token_ids[i]],
      output_toks=int(trace.output_lengths[i]),
      arrival_time_ns=int(round(float(trace.arrival_times_s[i]) * 1e9)),
    )
    if trace.output_token_ids is not None:
      rec["output_tok_ids"] = [int(t) for t in trace.output_token_ids[i]]
    out.append(_per_request_fields(trace, i, rec))
  return out


def _per_request_fields(trace: Trace, i: int, rec: dict) -> dict:
  """``rec`` with request ``i``'s ``client`` (session id) and ``priority``
  where the trace has them (both record builders share this)."""
  if trace.session_ids is not None:
    rec["client"] = int(trace.session_ids[i])
  if trace.priorities is not None:
    rec["priority"] = int(trace.priorities[i])
  return rec


def _with_tokens(trace: Trace) -> Trace:
  """Token ids to serve: the trace's, or synthesised from its hash ids."""
  if trace.input_token_ids is not None:
    return trace
  if trace.hash_ids is None:
    raise ValueError(
      f"trace {trace.name!r} has lengths only (no token ids, no hash ids): "
      "it carries no prefix sharing. To serve it anyway, with every "
      "request's tokens its own (every hit 0), pass "
      "trace.with_token_ids()"
    )
  return trace.with_token_ids()


def _token_array(rid: int, name: str, value) -> np.ndarray:
  a = np.asarray(value)
  if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
    raise ValueError(f"record {rid}: {name} must be a list of token ids")
  a = a.astype(np.int64, copy=False)
  bad = (a < 0) | (a >= 2**31)
  if bad.any():  # the device hashes token ids as int32 words
    j = int(np.argmax(bad))
    raise ValueError(
      f"record {rid}: {name}[{j}]={int(a[j])} is outside [0, 2**31): token "
      "ids are int32 on the device (larger ones would alias)"
    )
  return a


def _parse(
  rid: int, rec: Mapping[str, Any]
) -> tuple[np.ndarray, int, np.ndarray]:
  """``sched_harness.py load_trace`` (the oracle's ``_parse``)."""
  prompt = _token_array(rid, "input_tok_ids", rec["input_tok_ids"])
  out_ids = rec.get("output_tok_ids")
  if out_ids is not None:
    out_ids = _token_array(rid, "output_tok_ids", out_ids)
  if "output_toks" in rec:
    max_tokens = int(rec["output_toks"])
  elif out_ids is not None:
    max_tokens = len(out_ids)
  else:
    raise ValueError(f"record {rid}: no output_toks and no output_tok_ids")
  if max_tokens < 1:
    raise ValueError(f"record {rid}: {max_tokens=} must be >= 1")
  if max_tokens >= 2**31:  # outputs stop at max_model_len anyway
    raise ValueError(
      f"record {rid}: {max_tokens=} must be < 2**31 (int32 on the device)"
    )
  return (
    prompt,
    max_tokens,
    (np.zeros((0,), np.int64) if out_ids is None else out_ids),
  )


def _records_of(trace: Trace) -> list[dict[str, Any]]:
  """:func:`records_from_trace` with numpy token rows (no Python lists)."""
  trace = _with_tokens(trace)
  with np.errstate(over="ignore"):  # refused just below, by name
    ns = np.round(np.asarray(trace.arrival_times_s, np.float64) * 1e9)
  far = ~(np.abs(ns) < 2.0**63)
  if far.any():
    i = int(np.argmax(far))
    raise ValueError(
      f"trace request {i}: arrival_times_s={float(trace.arrival_times_s[i])} "
      "does not fit int64 nanoseconds"
    )
  out = []
  for i in range(len(trace)):
    rec: dict[str, Any] = dict(
      input_tok_ids=trace.input_token_ids[i],
      output_toks=int(trace.output_lengths[i]),
      arrival_time_ns=int(ns[i]),
    )
    if trace.output_token_ids is not None:
      rec["output_tok_ids"] = trace.output_token_ids[i]
    out.append(_per_request_fields(trace, i, rec))
  return out


def _step_rows(prompts, outputs, config, *, together: bool) -> int:
  """Step-buffer rows ``T``: a power of two above the expected steps.

  All arriving together the engine keeps about ``max_num_seqs`` running:
  about ``prompt tokens / budget + output tokens / max_num_seqs`` steps,
  doubled. Spread arrivals may run one request at a time: up to ``prompt
  tokens / budget + output tokens + R``. Too few rows is not an error:
  :func:`simulate` doubles them and reruns.
  """
  p = int(np.sum(prompts, dtype=np.int64))
  o = int(np.sum(outputs, dtype=np.int64))
  prefill = -(-p // config.max_num_batched_tokens) + len(prompts)
  if together:
    est = 2 * (prefill + -(-o // config.max_num_seqs))
  else:
    est = prefill + o
  return next_pow2(est + 64)


def _clients(records: list[Mapping[str, Any]]) -> np.ndarray:
  """``[R]`` int32 dense client ids from each record's ``client`` (else 0).

  Raises:
    ValueError: a ``client`` that is not an int.
  """
  raw = []
  for rid, rec in enumerate(records):
    c = rec.get("client", 0)
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
      raise ValueError(f"record {rid}: client={c!r} must be an int")
    raw.append(int(c))
  _, dense = np.unique(np.asarray(raw, np.int64), return_inverse=True)
  return dense.astype(np.int32)


def _poisson_ns(r: int, rate: float, seed: int) -> list[int]:
  """Poisson arrival times in ns: 0, then ``exponential(1 / rate)`` gaps."""
  gaps = np.random.default_rng(seed).exponential(1.0 / rate, r)
  times = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
  return [int(round(x * 1e9)) for x in times]


def _priority_order(
  records: list[Mapping[str, Any]],
  arrivals: str,
  rate: float | None,
  seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Each record's ``priority`` and its ranks in vLLM's priority order.

  ``Request.__lt__`` orders by ``(priority, arrival_time, request_id)``;
  ``arrival_time`` is the harness's: ``arrival_time_ns / 1e9`` (the drawn
  time for ``"poisson"``), or ``rid * 1e-3`` without one; ``request_id``
  sorts as the rid.

  Returns:
    ``(priority, rank, prio_key)``: ``[R]`` int64 priorities; ``[R]`` int32
    ranks: ``rank`` is the
    position in the full order, ``prio_key`` the dense rank of
    ``(priority, arrival_time)`` (ties equal: the victim key).
  """
  r = len(records)
  priority = [int(rec.get("priority", 0)) for rec in records]
  if arrivals == "poisson":
    assert rate is not None
    ns: list[Any] = list(_poisson_ns(r, rate, seed))
  else:
    ns = [rec.get("arrival_time_ns") for rec in records]
  times = [x / 1e9 if x is not None else rid * 1e-3 for rid, x in enumerate(ns)]
  keys = list(zip(priority, times, strict=True))
  order = sorted(range(r), key=lambda rid: (keys[rid], rid))
  rank = np.zeros((r,), np.int32)
  rank[order] = np.arange(r, dtype=np.int32)
  distinct = {k: j for j, k in enumerate(sorted(set(keys)))}
  prio_key = np.asarray([distinct[k] for k in keys], np.int32)
  return np.asarray(priority, np.int64), rank, prio_key


def arrival_times_s(
  records: list[Mapping[str, Any]],
  arrivals: str,
  rate: float | None = None,
  seed: int = 0,
) -> np.ndarray:
  """``[R]`` float64 arrival time in seconds of each record (a timed clock).

  ``"zero"``: all 0; ``"trace"``: ``arrival_time_ns / 1e9``; ``"poisson"``:
  the draws of :func:`arrival_steps`.

  Raises:
    ValueError: an unknown ``arrivals``, a bad ``rate``, a record without
      ``arrival_time_ns``, or a negative time.
  """
  r = len(records)
  if arrivals not in ARRIVALS:
    raise ValueError(f"arrivals={arrivals!r}; expected one of {ARRIVALS}")
  if arrivals == "zero":
    return np.zeros((r,), np.float64)
  ns = _arrival_ns(records, arrivals, rate, seed)
  out = np.asarray(ns, np.float64) / 1e9
  if out.min() < 0 or out.max() * 1e3 >= 2**31 - 1:
    raise ValueError(
      f"arrival times span [{out.min()}, {out.max()}] s: negative, or past "
      "the timed clock's 2**31 ms"
    )
  return out


def _arrival_ns(records, arrivals: str, rate, seed: int) -> list[int]:
  """Arrival times in ns of ``"trace"`` (each record's) or ``"poisson"``.

  Raises:
    ValueError: a bad ``rate``; a record without ``arrival_time_ns``.
  """
  if arrivals == "poisson":
    if rate is None or not rate > 0:
      raise ValueError(f"arrivals='poisson' needs rate > 0, got {rate!r}")
    return _poisson_ns(len(records), rate, seed)
  ns = []
  for rid, rec in enumerate(records):
    t = rec.get("arrival_time_ns")
    if t is None:
      raise ValueError(f"record {rid}: no arrival_time_ns")
    number = isinstance(t, (int, float, np.integer, np.floating))
    if isinstance(t, bool) or not number or not abs(t) < 2.0**63:
      raise ValueError(
        f"record {rid}: arrival_time_ns={t!r} must be a finite number of "
        "nanoseconds (int64)"
      )
    ns.append(int(t))
  return ns


def _clock(clock, model, hardware):
  """``None`` for ``"steps"``, else a clock object (see :func:`simulate`)."""
  if isinstance(clock, str):
    if clock not in CLOCKS:
      raise ValueError(
        f"clock={clock!r}; expected one of {CLOCKS} or an object"
      )
    if clock == "steps":
      if model is not None or hardware is not None:
        raise ValueError("model= and hardware= need clock='roofline'")
      return None
    m = model if model is not None else DEFAULT_MODEL
    h = hardware if hardware is not None else DEFAULT_HARDWARE
    m = configs.model_config(m) if isinstance(m, str) else m
    h = configs.hardware_config(h) if isinstance(h, str) else h
    return roofline.RooflineClock(m, h)
  if model is not None or hardware is not None:
    raise ValueError("model= and hardware= go with clock='roofline' only")
  if hasattr(clock, "step_time_s"):
    if not callable(clock.step_time_s):
      raise TypeError(
        f"clock.step_time_s must be a method (new_tokens, context_tokens) -> "
        f"seconds, got {clock.step_time_s!r}"
      )
    return clock
  if callable(clock):
    return roofline.FunctionClock(clock)
  raise TypeError(
    f"clock must be 'steps', 'roofline', a clock object or a function, got "
    f"{clock!r}"
  )


def arrival_steps(
  records: list[Mapping[str, Any]],
  arrivals: str,
  step_time_ms: float | None,
  rate: float | None = None,
  seed: int = 0,
) -> np.ndarray:
  """``[R]`` int32 arrival step of each record.

  ``"zero"``: all 0. ``"trace"``: ``arrival_time_ns // step_ns`` with
  ``step_ns = round(step_time_ms * 1e6)`` (the harness's ``time``
  arrivals). ``"poisson"``: the first request at time 0, then gaps drawn
  with ``numpy.random.default_rng(seed).exponential(1 / rate)`` seconds,
  rounded to nanoseconds, then as ``"trace"``.

  Raises:
    ValueError: an unknown ``arrivals``, a missing or non-positive
      ``step_time_ms`` or ``rate``, a record without ``arrival_time_ns``.
  """
  r = len(records)
  if arrivals not in ARRIVALS:
    raise ValueError(f"arrivals={arrivals!r}; expected one of {ARRIVALS}")
  if arrivals == "zero":
    return np.zeros((r,), np.int32)
  if step_time_ms is None or not step_time_ms > 0:
    raise ValueError(
      f"arrivals={arrivals!r} needs step_time_ms > 0, got {step_time_ms!r}"
    )
  step_ns = int(round(step_time_ms * 1e6))
  if step_ns < 1:
    raise ValueError(f"step_time_ms={step_time_ms!r} is under a nanosecond")
  ns = _arrival_ns(records, arrivals, rate, seed)
  steps = [x // step_ns for x in ns]
  if min(steps) < 0 or max(steps) >= 2**31 - 1:
    raise ValueError(
      f"arrival steps span [{min(steps)}, {max(steps)}]: negative times or "
      f"too many steps of step_time_ms={step_time_ms}"
    )
  return np.asarray(steps, np.int32)


class _Lengths(NamedTuple):
  """What bounds a request's length under a configuration (hashable: the
  key of the memo entries built from it). A prompt of ``prompt_limit``
  tokens or more (or an empty one) is rejected; the others sample
  ``min(max_tokens, total - P)`` tokens, and under SGLang's allocator bound
  (``pool`` tokens, ``page`` tokens a page) at most ``pool - ceil_page(P)
  - page - 1``."""

  prompt_limit: int
  total: int
  pool: int | None = None
  page: int | None = None


def _lengths(config: ServingConfig) -> _Lengths:
  """vLLM 0.33: prompts rejected from ``max_model_len`` tokens
  (``InputProcessor``), outputs cut at ``max_model_len`` (the scheduler's
  ``check_stop``). SGLang 0.5.23's ``Scheduler.init_req_max_new_tokens``
  (``managers/scheduler.py``): ``max_new_tokens`` clipped to ``max_req_len
  - P - 1``, then to the allocator's ``max_new_tokens_for_memory``
  (``mem_cache/allocator/base.py``: ``capacity - ceil_page(P) - page -
  1``); that bound is at least ``max_model_len - P`` (so never binds) when
  the pool holds ``max_model_len + 2 * page`` tokens or more, and is left
  out of the key then, so sweeps over larger pools share one entry."""
  if config.semantics != "sglang":
    return _Lengths(config.max_model_len, config.max_model_len)
  k = config.block_size
  pool = config.usable_blocks * k
  limit = config.prompt_limit  # SGLang's max_req_input_len = max_req_len - 5
  total = limit + 5 - 1  # at most max_req_len - P - 1 outputs
  if pool >= config.max_model_len + 2 * k:
    return _Lengths(limit, total)
  return _Lengths(limit, total, pool, k)


def _request_tokens(records: list[Mapping[str, Any]], lengths: _Lengths):
  """Each record's prompt and the outputs it will sample, on the host.

  A prompt that is empty or of ``lengths.prompt_limit`` tokens or more is
  rejected (vLLM's ``InputProcessor``; SGLang aborts it) and gets no
  outputs; the others sample :class:`_Lengths`'s number of tokens: the
  record's ``output_tok_ids``, then :func:`fabricated_token`'s.

  Returns:
    ``(prompts, outputs, prompt_len, max_tokens, rejected)``: ``R`` int64
    arrays each, then ``[R]`` int32, ``[R]`` int32 and ``[R]`` bool.

  Raises:
    ValueError: a record is malformed (:func:`_parse`), or under SGLang's
      allocator bound a prompt leaves no room for an output (SGLang would
      serve it as a prefill-only request, which is not modelled).
  """
  parsed = _parse_all(records)
  if parsed is None:  # some record is bad: the exact error, record by record
    for rid, rec in enumerate(records):
      prompt, mt, _ = _parse(rid, rec)
      _check_room(rid, len(prompt), mt, lengths)
    raise AssertionError("a record failed the fast checks and none the exact")
  prompts, max_tokens, out_ids = parsed
  r = len(records)
  p = np.fromiter((a.shape[0] for a in prompts), np.int64, count=r)
  rejected = ~((p > 0) & (p < lengths.prompt_limit))
  n_out = np.minimum(max_tokens, lengths.total - p)
  if lengths.pool is not None:
    n_out = np.minimum(n_out, _pool_room(p, lengths))
    bad = ~rejected & (n_out < 1)
    if bad.any():
      rid = int(np.argmax(bad))
      raise ValueError(f"record {rid}: {_no_room_words(int(p[rid]), lengths)}")
  n_out = np.where(rejected, 0, n_out)
  # fabricated_token's rule for every position, then the given ids over it
  off = np.zeros((r + 1,), np.int64)
  np.cumsum(n_out, out=off[1:])
  rid_of = np.repeat(np.arange(r, dtype=np.int64), n_out)
  pos = np.arange(int(off[-1]), dtype=np.int64) - off[rid_of]
  flat = (rid_of * 7919 + pos) % NUM_FABRICATED_VOCAB + 1
  given = np.minimum(
    np.fromiter((a.shape[0] for a in out_ids), np.int64, count=r), n_out
  )
  for rid in np.flatnonzero(given):
    a = off[rid]
    flat[a : a + given[rid]] = out_ids[rid][: given[rid]]
  outputs = [flat[a:b] for a, b in zip(off[:-1], off[1:], strict=True)]
  return (
    prompts,
    outputs,
    p.astype(np.int32),
    max_tokens.astype(np.int32),
    rejected,
  )


def _check_room(rid: int, p: int, mt: int, lengths: _Lengths) -> None:
  """:func:`_request_tokens`' allocator bound for one record (a prompt of
  ``p`` tokens asking for ``mt``), record by record after its parse, in
  the exact error's order."""
  if not 0 < p < lengths.prompt_limit or lengths.pool is None:
    return
  n_out = min(mt, lengths.total - p, int(_pool_room(np.int64(p), lengths)))
  if n_out < 1:
    raise ValueError(f"record {rid}: {_no_room_words(p, lengths)}")


def _parse_all(records):
  """:func:`_parse` of every record with checks cheap enough for a large
  trace (the token ranges in one pass over all of them): ``(prompts
  (int64), max_tokens [R] int64, output ids)``, or ``None`` when anything
  is off (the caller then finds the exact error record by record)."""
  prompts, outs = [], []
  max_tokens = np.zeros((len(records),), np.int64)
  empty = np.zeros((0,), np.int64)
  try:
    for rid, rec in enumerate(records):
      a = _cheap_tokens(rec["input_tok_ids"])
      o = rec.get("output_tok_ids")
      o = empty if o is None else _cheap_tokens(o)
      if "output_toks" in rec:
        mt = int(rec["output_toks"])
      elif rec.get("output_tok_ids") is not None:
        mt = len(o)
      else:
        return None
      if not 1 <= mt < 2**31 or a is None or o is None:
        return None
      max_tokens[rid] = mt
      prompts.append(a)
      outs.append(o)
  except (KeyError, TypeError, ValueError, OverflowError):
    return None
  every = np.concatenate([*prompts, *outs, empty])
  if every.shape[0] and (every.min() < 0 or every.max() >= 2**31):
    return None
  return prompts, max_tokens, outs


def _cheap_tokens(value) -> np.ndarray | None:
  """:func:`_token_array`'s checks but the range (int64, or ``None``)."""
  a = value if type(value) is np.ndarray else np.asarray(value)
  if a.ndim != 1 or (a.shape[0] and a.dtype.kind not in "iu"):
    return None
  return a.astype(np.int64, copy=False)


def _pool_room(prompt_len: np.ndarray, lengths: _Lengths) -> np.ndarray:
  """SGLang's ``max_new_tokens_for_memory`` bound for these prompts."""
  k = lengths.page
  return lengths.pool - -(-prompt_len // k) * k - k - 1


def _no_room_words(p: int, lengths: _Lengths) -> str:
  k = lengths.page
  return (
    f"a prompt of {p} tokens leaves SGLang's allocator no output token "
    f"(max_new_tokens_for_memory: {lengths.pool} pool tokens - "
    f"{-(-p // k) * k} prompt page tokens - page {k} - 1 = "
    f"{int(_pool_room(np.int64(p), lengths))}); SGLang would serve it "
    "prefill-only, which is not modelled: give the pool more blocks "
    "(num_gpu_blocks; --num-blocks, a sweep's num_blocks)"
  )


def prefill_only_message(prompt_len, config: ServingConfig) -> str | None:
  """Why ``config`` cannot serve prompts of ``prompt_len`` tokens, or
  None: under ``semantics="sglang"`` with the pool within two pages of
  ``max_model_len``, an accepted prompt that SGLang's allocator bound
  leaves no output token (SGLang's prefill-only path, not modelled).
  :func:`simulate` refuses such a trace by record; a sweep checks its
  points with this before any runs."""
  lengths = _lengths(config)
  if lengths.pool is None:
    return None
  p = np.asarray(prompt_len, np.int64)
  bad = (p > 0) & (p < lengths.prompt_limit) & (_pool_room(p, lengths) < 1)
  if not bad.any():
    return None
  i = int(np.argmax(bad))
  return (
    f"request {i} (0-based; {int(bad.sum())} in all): "
    f"{_no_room_words(int(p[i]), lengths)}"
  )


def _tokens(records, config: ServingConfig, memo: dict):
  """:func:`_request_tokens` under ``config``'s :func:`_lengths`, kept in
  ``memo``: one entry serves every configuration with the same bounds
  (either semantics' loop reads it)."""
  key = ("tokens", _lengths(config))
  if key not in memo:
    memo[key] = _request_tokens(records, key[1])
  return memo[key]


def _prepare(
  records: list[Mapping[str, Any]], config: ServingConfig, memo: dict
):
  k = config.block_size
  m = config.max_blocks_per_seq
  r = len(records)
  prompts, outputs, prompt_len, max_tokens, rejected = _tokens(
    records, config, memo
  )
  empty = np.zeros((0,), np.int64)
  seqs = [
    empty if rejected[rid] else np.concatenate([prompts[rid], outputs[rid]])
    for rid in range(r)
  ]
  lens = np.fromiter((len(x) for x in seqs), np.int32, count=r)
  keys = hashing.block_hashes_batch(seqs, block_size=k, max_blocks=m)
  return keys, prompt_len, max_tokens, rejected, lens


def _arrival_arrays(
  records, arrivals, step_time_ms, rate, seed, timed: bool
) -> dict[str, Any]:
  """Arrivals as the engines read them: steps (the steps clock) or a timed
  clock's ``(ms, fraction)`` with the float64 times the device compares,
  and the key of the arrival order."""
  r = len(records)
  if not timed:
    arrival = arrival_steps(records, arrivals, step_time_ms, rate, seed)
    return dict(
      arrival=arrival,
      arrival_ms=None,
      arrival_frac=None,
      arrival_msf=None,
      arrival_s=None,
      sort_by=arrival,
    )
  if step_time_ms is not None:
    raise ValueError("step_time_ms is for clock='steps' only")
  secs = arrival_times_s(records, arrivals, rate, seed)
  ms = np.floor(secs * 1e3)
  frac = (secs * 1e3 - ms).astype(np.float32)
  ms = ms.astype(np.int32)
  msf = ms + frac.astype(np.float64)  # the times the device compares (ms)
  return dict(
    arrival=np.zeros((r,), np.int32),
    arrival_ms=ms,
    arrival_frac=frac,
    arrival_msf=msf,
    arrival_s=msf / 1e3,
    sort_by=msf / 1e3,
  )


def simulate(
  trace: Trace | Iterable[Mapping[str, Any]],
  config: ServingConfig,
  *,
  arrivals: Arrivals = "zero",
  step_time_ms: float | None = None,
  rate: float | None = None,
  seed: int = 0,
  max_steps: int | None = None,
  clock: Any = "steps",
  model: str | configs.ModelConfig | None = None,
  hardware: str | configs.HardwareConfig | None = None,
  progress: bool = False,
) -> SimResult:
  """Serves a trace with vLLM 0.33's v1 scheduler (or SGLang's), step by step.

  ``config.semantics="sglang"`` runs SGLang 0.5.23's scheduler loop over its
  paged radix cache instead (:mod:`prefixjax.serving.sglang_engine`; its
  schedulers are ``fcfs``, ``lpm``, ``dfs``, ``fair`` and ``priority``),
  with the same arguments and result.

  ``config.scheduler`` picks FCFS (the default), PRIORITY (the waiting
  queue is ordered by each record's ``priority``, lower first, default 0;
  a :class:`prefixjax.workloads.Trace` has none; then arrival time, then
  rid; the preemption victim is the running request with the largest
  ``(priority, arrival_time)``), or another order of the waiting queue
  (:mod:`prefixjax.serving.schedulers`: ``lpm``, ``dfs``, ``fair``, whose
  clients are the records' ``client`` field, a Trace's ``session_ids``).

  rid is the record's index. Requests arrive at the step of
  :func:`arrival_steps` and can be scheduled in that step; when nothing is
  running or waiting the clock jumps to the next arrival (idle steps), as
  ``sched_harness.py`` does. The whole run is one jitted loop
  (:func:`prefixjax.serving.vllm_v1.run`).

  Args:
    trace: a :class:`prefixjax.workloads.Trace` with token ids, or the
      harness's records (``input_tok_ids``, ``output_toks`` and/or
      ``output_tok_ids``; outputs past the ids are the harness's
      :func:`fabricated_token`).
    config: the engine.
    arrivals: ``"zero"`` (all at step 0), ``"trace"`` (each record's
      ``arrival_time_ns``, a Trace's ``arrival_times_s``, at step
      ``floor(t / step_time_ms)``: the oracle's ``arrivals="time"``) or
      ``"poisson"`` (times drawn at ``rate`` requests/s with ``seed``).
    step_time_ms: milliseconds per engine step; needed by ``"trace"`` and
      ``"poisson"``, optional for ``"zero"`` (the metrics in seconds).
    rate: requests per second of ``"poisson"``.
    seed: seed of ``"poisson"``'s ``numpy.random.default_rng``.
    max_steps: at most this many executed steps, in step buffers of as
      many rows (status ``OUT_OF_STEPS``, SGLang's ``STEP_ROWS``, when
      requests are left). By default no limit: the run goes a segment of
      :func:`~prefixjax.serving.engine_state.segment_rows` rows (32 MiB of
      buffers) at a time, resumed into fresh buffers while they fill.
    clock: ``"steps"`` (default: every step lasts ``step_time_ms``, a
      request arriving at ``t`` is queued at step ``floor(t /
      step_time_ms)``), ``"roofline"`` (each step's time from
      :func:`prefixjax.serving.roofline.step_time_s` over its batch, with
      ``model`` and ``hardware``, default ``"llama3_8b"`` on ``"h100"``),
      a clock object with ``step_time_s(new_tokens, context_tokens)`` or a
      function ``(new_tokens [S], context_tokens [S]) -> seconds``
      (traceable). A timed clock queues a request when the time at the
      start of a step has reached its arrival, jumps an empty engine to
      the next arrival, and needs no ``step_time_ms``.
    model, hardware: names (:data:`prefixjax.configs.MODELS`,
      :data:`prefixjax.configs.HARDWARE`) or configs, for ``"roofline"``.
    progress: a progress bar (tqdm, on stderr) of requests done while the
      loop runs, updated every 256 steps from inside it.

  Returns:
    A :class:`SimResult`; ``status`` is not ``"OK"`` when the run stalled
    or ran out of steps (then records are partial).

  Raises:
    TypeError: ``config`` is not a :class:`ServingConfig`.
    ValueError: a record without outputs or with ``max_tokens < 1``; bad
      ``arrivals``, ``step_time_ms`` or ``rate`` (see :func:`arrival_steps`).
  """
  check_run_arguments(
    step_time_ms=step_time_ms,
    rate=rate,
    seed=seed,
    max_steps=max_steps,
    progress=progress,
  )
  records = _check_records(trace)
  release_compiled_near_map_limit()
  if isinstance(config, ServingConfig) and config.semantics == "sglang":
    return _simulate_sglang(
      records, config, arrivals, step_time_ms, rate, seed, max_steps, clock,
      model, hardware, progress,
    )  # fmt: skip
  built = _build(
    records, config, arrivals, step_time_ms, rate, seed, clock, model, hardware
  )
  if not progress:
    return _run_one(built, max_steps)
  from tqdm import tqdm

  with tqdm(total=len(records), unit="req", desc="simulate") as bar:

    def update(done, steps):
      bar.set_postfix_str(f"{steps:,} steps", refresh=False)
      bar.update(done - bar.n)  # redraws at most every mininterval

    engine.set_progress_sink(update)
    try:
      result = _run_one(built, max_steps, progress=True)
    finally:
      engine.set_progress_sink(None)
    bar.update(len(records) - bar.n)
  return result


def _simulate_sglang(
  records, config, arrivals, step_time_ms, rate, seed, max_steps, clock,
  model, hardware, progress=False, memo=None,
) -> SimResult:  # fmt: skip
  """:func:`simulate`'s checks, then SGLang's loop
  (:mod:`prefixjax.serving.sglang_sim`)."""
  from prefixjax.serving.sglang_sim import simulate_sglang

  inputs, timer = _sglang_inputs(
    records, config, arrivals, step_time_ms, rate, seed, clock, model,
    hardware, memo,
  )  # fmt: skip
  return simulate_sglang(
    config,
    **inputs,
    step_time_ms=step_time_ms,
    max_steps=max_steps,
    timer=timer,
    progress=progress,
  )


def _sglang_inputs(
  records, config, arrivals, step_time_ms, rate, seed, clock, model, hardware,
  memo=None,
):  # fmt: skip
  """:func:`simulate`'s checks and host preparation for SGLang's loop:
  (the keyword arguments ``tokens``, ``arr``, ``client``, ``priority`` of
  :func:`~prefixjax.serving.sglang_sim.simulate_sglang`, the clock;
  ``step_time_ms`` was checked by :func:`check_run_arguments`; ``memo``:
  as :func:`_build`'s)."""
  memo = {} if memo is None else memo
  from prefixjax.serving.sglang_sim import page_trie

  timer = _clock(clock, model, hardware)
  tokens = _tokens(records, config, memo)
  trie_shape = ("trie", config.block_size, _lengths(config))
  if trie_shape not in memo:
    memo[trie_shape] = page_trie(tokens, config.block_size)
  if "client" not in memo:
    memo["client"] = _clients(records)
  arr = _arrival_arrays(
    records, arrivals, step_time_ms, rate, seed, timer is not None
  )
  priority = (
    _sglang_priorities(records) if config.scheduler == "priority" else None
  )
  inputs = dict(
    tokens=tokens,
    arr=arr,
    client=memo["client"],
    priority=priority,
    parent=_field(records, "parent"),
    sample=_field(records, "sample"),
    trie=memo[trie_shape],
  )
  return inputs, timer


def _sglang_priorities(records) -> np.ndarray:
  """Each record's ``priority`` (default 0) for SGLang's priority policy,
  which compares them in int32 on the device: ``|priority| < 2**30``."""
  out = np.zeros((len(records),), np.int64)
  for i, rec in enumerate(records):
    p = rec.get("priority", 0)
    if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
      raise ValueError(f"record {i}: priority={p!r} must be an int")
    if abs(int(p)) >= 2**30:
      raise ValueError(
        f"record {i}: priority={p} must be in (-2**30, 2**30) for "
        "semantics='sglang'"
      )
    out[i] = int(p)
  return out


def _run_one(
  built, max_steps, record_lanes: bool = True, progress: bool = False
) -> SimResult:
  """Runs one build: with ``max_steps``, once into that many rows; else a
  segment of :func:`~prefixjax.serving.engine_state.segment_rows` rows at
  a time, the state resumed (``num_steps`` 0 again) into fresh buffers
  while a segment ends ``OUT_OF_STEPS`` with requests left (``num_steps``
  only numbers the rows: the clock is ``step``)."""
  if max_steps is None:
    lanes = built.config.max_num_seqs if record_lanes else 0
    steps = segment_rows(built.rows, lanes)
  else:
    steps = max_steps
  state, pieces, n = built.state, [], 0
  while True:
    final, trace_out = engine.run(
      state,
      built.reqs,
      built.params,
      max_steps=steps,
      scheduler=built.scheduler,
      clock=built.timer,
      record_lanes=record_lanes,
      progress=progress,
      base=n,
    )
    rows = int(final.num_steps)
    pieces.append((jax.device_get(first_rows(trace_out, rows)), rows))
    n += rows
    err = engine.SimStatus(int(final.error))
    if max_steps is not None or err != engine.SimStatus.OUT_OF_STEPS:
      break
    state = final.replace(
      num_steps=np.int32(0), error=np.int32(engine.SimStatus.OK)
    )
  final = jax.device_get(final).replace(num_steps=np.int32(n))
  result = _collect(built, final, join_rows(pieces))
  return dataclasses.replace(result, lanes_recorded=record_lanes)


def _each_on_a_thread(fn, items) -> list:
  """``[fn(x) for x in items]``, in order: the first alone (it compiles
  the program the others reuse), the rest by
  :func:`prefixjax._host.thread_map` (16 vLLM configurations of 200
  requests: 0.53-0.61 s -> 0.36-0.42 s on 2 cores)."""
  items = list(items)
  if not items:
    return []
  return [fn(items[0]), *thread_map(fn, items[1:])]


@dataclasses.dataclass(frozen=True)
class _Built:
  """One configuration's device inputs and host facts."""

  config: ServingConfig
  state: Any
  reqs: Any
  params: Any
  scheduler: Any
  timer: Any
  rows: int
  step_time_ms: float | None
  host: dict[str, Any]


def prepare_records(trace) -> list[dict[str, Any]]:
  """A Trace or records as :func:`simulate` reads them: the harness's
  records after :func:`fan_out`.

  Raises:
    ValueError: no request, a trace without token ids, a bad ``n``.
  """
  return _check_records(trace)


def _check_records(trace) -> list:
  if isinstance(trace, Trace):
    records = _records_of(trace)
  elif isinstance(trace, (str, bytes, Mapping)) or not isinstance(
    trace, Iterable
  ):
    raise TypeError(
      "trace must be a Trace or an iterable of records (dicts with "
      f"input_tok_ids), got {type(trace).__name__}"
    )
  else:
    records = list(trace)
    for rid, rec in enumerate(records):
      if not isinstance(rec, Mapping):
        raise TypeError(
          f"record {rid} must be a dict, got {type(rec).__name__}"
        )
      if "input_tok_ids" not in rec:
        raise ValueError(
          f"record {rid} has no input_tok_ids (fields: "
          f"{', '.join(map(str, rec)) or 'none'})"
        )
      for key in ("output_toks", "priority"):
        v = rec.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
          raise ValueError(f"record {rid}: {key}={v!r} must be an int")
  if not records:
    raise ValueError("simulate needs at least one request")
  return fan_out(records)


def fan_out(records: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """Parallel sampling as vLLM 0.33 does it: a record with ``n > 1`` becomes
  ``n`` child requests.

  ``vllm/v1/engine/llm_engine.py`` ``LLMEngine.add_request`` fans a request
  with ``SamplingParams.n > 1`` out into ``n`` children (ids ``f"{idx}_{id}"``,
  ``parallel_sampling.py`` ``ParentRequest.get_child_info``), added to the
  engine core one after another with the same prompt and arrival; they are
  scheduled as independent requests and share the prompt's blocks through
  the prefix cache. Here the children are consecutive records (so they
  queue in index order and tie in priority by index), with ``parent`` (the
  record's index) and ``sample`` (``idx``); child 0 keeps the record's
  ``output_tok_ids``, the others sample their own (the harness's fabricated
  tokens of their own rid). Records without ``n`` (or ``n == 1``) pass
  through unchanged, and with no ``n > 1`` anywhere the list is returned
  as it is.

  Raises:
    ValueError: ``n`` not an int >= 1 (the message names the record).
  """
  ns, total = [], 0
  for rid, rec in enumerate(records):
    n = rec.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
      raise ValueError(f"record {rid}: n={n!r} must be an int >= 1")
    ns.append(int(n))
    total += int(n)
    if total >= 2**31:  # checked before building any sample
      raise ValueError(
        f"record {rid}: n={n} takes the requests with their samples to "
        f"{total:_}, past int32 request ids (at most {2**31 - 1:_})"
      )
  if max(ns) == 1:
    return records
  out = []
  for rid, (rec, n) in enumerate(zip(records, ns, strict=True)):
    for idx in range(n):
      child = {k: v for k, v in rec.items() if k != "n"}
      if idx > 0:
        child.pop("output_tok_ids", None)
      child.update(parent=rid, sample=idx)
      out.append(child)
  return out


@functools.partial(
  jax.jit,
  static_argnames=(
    "num_blocks",
    "block_size",
    "max_seqs",
    "max_blocks_per_seq",
    "scheduler",
  ),
)
def _initial_state(
  status,
  prompt_len,
  *,
  num_blocks,
  block_size,
  max_seqs,
  max_blocks_per_seq,
  scheduler,
):
  """An empty cache and the engine state over it, every request waiting to
  arrive: one compiled program (built op by op outside ``jit``, the ~40
  array constructors would each compile a program of their own)."""
  cache = pc.init(
    num_blocks,
    block_size,
    max_seqs=max_seqs,
    max_blocks_per_seq=max_blocks_per_seq,
    vllm_version="0.33",
  )
  return engine.init_state(
    cache,
    jnp.full(status.shape, -1, jnp.int32),
    0,
    status,
    prompt_len,
    scheduler=scheduler,
  )


def _build(
  records,
  config,
  arrivals,
  step_time_ms,
  rate,
  seed,
  clock,
  model,
  hardware,
  memo: dict | None = None,
) -> _Built:
  """The device inputs of one run (:func:`simulate`'s checks, in order).

  ``memo``: a dict shared by the builds of one batch over the same
  records, which keeps what depends on the records and the token shapes
  alone (the tokens, the block keys, the clients), so a batch hashes the
  prompts once per ``(block_size, max_model_len)``, not once per
  configuration.
  """
  memo = {} if memo is None else memo
  if not isinstance(config, ServingConfig):
    raise TypeError(f"config must be a ServingConfig, got {type(config)}")
  if step_time_ms is not None and not step_time_ms > 0:
    raise ValueError(f"step_time_ms={step_time_ms!r} must be > 0")
  timer = _clock(clock, model, hardware)
  arr = _arrival_arrays(
    records, arrivals, step_time_ms, rate, seed, timer is not None
  )
  arrival, sort_by = arr["arrival"], arr["sort_by"]
  arrival_ms, arrival_frac = arr["arrival_ms"], arr["arrival_frac"]
  arrival_msf, arrival_s = arr["arrival_msf"], arr["arrival_s"]
  priority, rank, prio_key = _priority_order(records, arrivals, rate, seed)
  scheduler = config.scheduler_object
  if "client" not in memo:
    memo["client"] = _clients(records)
  client = memo["client"]
  shape = ("prepared", config.block_size, config.max_model_len)
  if shape not in memo:
    memo[shape] = _prepare(records, config, memo)
  keys, prompt_len, max_tokens, rejected, lens = memo[shape]
  r = len(records)
  order = np.lexsort((np.arange(r), sort_by)).astype(np.int32)
  status = np.where(
    rejected, engine.ReqStatus.REJECTED, engine.ReqStatus.WAITING
  ).astype(np.int32)
  fork_parent = _fork_parents(records, config)
  if fork_parent is not None:
    child = (fork_parent >= 0) & ~rejected
    status[child] = engine.ReqStatus.DORMANT
  state = _initial_state(
    to_device(status),
    to_device(prompt_len),
    num_blocks=config.num_gpu_blocks,
    block_size=config.block_size,
    max_seqs=config.max_num_seqs,
    max_blocks_per_seq=config.max_blocks_per_seq,
    scheduler=scheduler,
  )
  reqs = engine.RequestTable(
    keys=keys,
    prompt_len=to_device(prompt_len),
    max_tokens=to_device(max_tokens),
    arrival_step=to_device(arrival),
    arrival_order=to_device(order),
    rank=to_device(rank),
    prio_key=to_device(prio_key),
    client=to_device(client),
  )
  if timer is not None:
    reqs = reqs.replace(
      arrival_ms=to_device(arrival_ms), arrival_frac=to_device(arrival_frac)
    )
  if fork_parent is not None:
    reqs = reqs.replace(fork_parent=to_device(fork_parent))
  params = engine.EngineParams(
    max_num_batched_tokens=to_device(config.max_num_batched_tokens, np.int32),
    max_model_len=to_device(config.max_model_len, np.int32),
    chunked_prefill=to_device(config.chunked_prefill, np.bool_),
    long_prefill_token_threshold=to_device(
      config.long_prefill_token_threshold, np.int32
    ),
  )
  rows = _step_rows(
    prompt_len[~rejected],
    lens[~rejected] - prompt_len[~rejected],
    config,
    together=arrivals == "zero",
  )
  return _Built(
    config=config,
    state=state,
    reqs=reqs,
    params=params,
    scheduler=scheduler,
    timer=timer,
    rows=rows,
    step_time_ms=None if step_time_ms is None else float(step_time_ms),
    host=dict(
      prompt_len=prompt_len,
      max_tokens=max_tokens,
      arrival=arrival,
      arrival_s=arrival_s,
      arrival_msf=arrival_msf,
      rejected=rejected,
      priority=priority,
      parent=_field(records, "parent"),
      sample=_field(records, "sample"),
    ),
  )


def build_inputs(
  records: list[Mapping[str, Any]],
  config: ServingConfig,
  arrivals: Arrivals = "zero",
  step_time_ms: float | None = None,
  rate: float | None = None,
  seed: int = 0,
):
  """The device inputs of a run on the steps clock.

  What :func:`simulate` builds (same checks, same arguments), for a driver
  that runs the steps itself (:class:`prefixjax.model.Engine`: the
  simulator plus a forward pass; :mod:`prefixjax.routing`: replicas).
  Records as :func:`simulate`'s, after :func:`fan_out`.

  Returns:
    ``(state, reqs, params, scheduler)``: an
    :class:`~prefixjax.serving.vllm_v1.EngineState` with a fresh cache
    (nothing queued yet: :func:`prefixjax.serving.vllm_v1.admit` queues
    the requests), the :class:`~prefixjax.serving.vllm_v1.RequestTable`
    (``keys`` of the records' prompt and outputs), the
    :class:`~prefixjax.serving.vllm_v1.EngineParams` and the
    :class:`~prefixjax.serving.schedulers.Scheduler`.
  """
  built = _build(
    records, config, arrivals, step_time_ms, rate, seed, "steps", None, None
  )
  return built.state, built.reqs, built.params, built.scheduler


def _fork_parents(records, config) -> np.ndarray | None:
  """``[R]`` int32: with ``parallel_sampling="fork"``, each child's sample-0
  sibling (the request it forks from), -1 for the others; else None."""
  if config.parallel_sampling != "fork" or "parent" not in records[0]:
    return None
  first: dict[int, int] = {}
  out = np.full((len(records),), -1, np.int32)
  for rid, rec in enumerate(records):
    parent = int(rec.get("parent", -1))
    if parent < 0:
      continue
    if rec["sample"] == 0:
      first[parent] = rid
    else:
      out[rid] = first[parent]
  return out


def _field(records, name: str) -> np.ndarray | None:
  """``[R]`` int64 of a :func:`fan_out` field, or None without one."""
  if name not in records[0]:
    return None
  return np.asarray([rec[name] for rec in records], np.int64)


def _collect(built: _Built, f, trace_out) -> SimResult:
  """A :class:`SimResult` from one run's final state (on the host)."""
  h = built.host
  err = engine.SimStatus(int(f.error))
  trace_np = engine.StepRecord(*(np.asarray(x) for x in trace_out))
  arrival = h["arrival"]
  if built.timer is not None:  # the first step that started at or after
    n = int(f.num_steps)
    start = trace_np.time_ms[:n].astype(np.float64) + trace_np.time_frac[:n]
    arrival = np.searchsorted(start, h["arrival_msf"], side="left").astype(
      np.int32
    )
  return SimResult(
    config=built.config,
    status=err.name,
    num_steps=int(f.num_steps),
    idle_steps=int(f.idle_steps),
    step_time_ms=built.step_time_ms,
    trace=trace_np,
    prompt_len=h["prompt_len"],
    max_tokens=h["max_tokens"],
    arrival_step=arrival,
    rejected=h["rejected"],
    finished=np.asarray(f.status) == engine.ReqStatus.FINISHED,
    first_sched_step=np.asarray(f.first_sched_step),
    hit_first_sched=np.asarray(f.hit_first_sched),
    first_token_step=np.asarray(f.first_token_step),
    finish_step=np.asarray(f.finish_step),
    num_output_tokens=np.asarray(f.num_output),
    num_preemptions=np.asarray(f.num_preemptions),
    resume_hit_tokens=np.asarray(f.resume_hit_tokens),
    sched_steps=np.asarray(f.sched_steps),
    prefill_steps=np.asarray(f.prefill_steps),
    priority=h["priority"],
    clock="steps" if built.timer is None else built.timer,
    arrival_s=h["arrival_s"],
    parent=h["parent"],
    sample=h["sample"],
    evictions=int(f.cache.stats.evictions),
  )


_STATIC = (
  "semantics",
  "num_gpu_blocks",
  "block_size",
  "max_num_seqs",
  "max_model_len",
  "parallel_sampling",
)


def check_run_arguments(
  *,
  step_time_ms=None,
  rate=None,
  seed=0,
  max_steps=None,
  progress=False,
  per_config=False,
) -> None:
  """The run arguments :func:`simulate`, :func:`simulate_batch` and
  :func:`prefixjax.routing.simulate_cluster` share, checked before any
  work (``step_time_ms``, ``rate``, ``seed``: one value, or with
  ``per_config`` (:func:`simulate_batch`) a value or a sequence of them)."""

  def each(name, value):
    if isinstance(value, (list, tuple, np.ndarray)):
      if per_config:
        return value
      raise TypeError(
        f"{name}={value!r} must be one value (a value per configuration "
        "is simulate_batch's)"
      )
    return [value]

  for name, values in (("step_time_ms", step_time_ms), ("rate", rate)):
    for v in each(name, values):
      if v is None:
        continue
      if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
        raise TypeError(f"{name}={v!r} must be a number")
      if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name}={v!r} must be a finite number > 0")
  for v in each("seed", seed):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
      raise TypeError(f"seed={v!r} must be an int")
    if v < 0:
      raise ValueError(f"seed={v} must be >= 0")
  if max_steps is not None:
    if isinstance(max_steps, bool) or not isinstance(
      max_steps, (int, np.integer)
    ):
      raise TypeError(f"max_steps={max_steps!r} must be an int or None")
    if not 1 <= max_steps < 2**31:
      raise ValueError(f"max_steps={max_steps} must be in [1, 2**31)")
  if not isinstance(progress, bool):
    raise TypeError(f"progress={progress!r} must be True or False")


def _per_config(name: str, value, n: int) -> list:
  """``value`` for each of ``n`` configurations (a scalar or a sequence)."""
  if isinstance(value, (list, tuple, np.ndarray)):
    if len(value) != n:
      raise ValueError(
        f"{name} has {len(value)} entries for {n} configurations"
      )
    return list(value)
  return [value] * n


@jax.jit
def _stack(trees):
  """Equal pytrees stacked leaf by leaf along a new axis 0, in one program
  (``jnp.stack`` outside ``jit`` compiles one per leaf shape)."""
  return jax.tree.map(lambda *x: jnp.stack(x), *trees)


def simulate_batch(
  trace: Trace | Iterable[Mapping[str, Any]],
  configs: Sequence[ServingConfig],
  *,
  arrivals: Arrivals = "zero",
  step_time_ms: float | Sequence[float] | None = None,
  rate: float | Sequence[float] | None = None,
  seed: int | Sequence[int] = 0,
  max_steps: int | None = None,
  clock: Any = "steps",
  model: str | configs.ModelConfig | None = None,
  hardware: str | configs.HardwareConfig | None = None,
  vectorize: bool | None = None,
  devices: Sequence[jax.Device] | None = None,
) -> list[SimResult]:
  """:func:`simulate` for many configurations with one compiled program.

  The configurations must share the static shapes, ``num_gpu_blocks``,
  ``block_size``, ``max_num_seqs``, ``max_model_len``, and the scheduler;
  they may differ in ``max_num_batched_tokens``, ``chunked_prefill`` and
  ``long_prefill_token_threshold`` (under ``semantics="sglang"`` also in
  ``max_prefill_tokens`` and ``priority_preemption_threshold``, and they
  must share ``waiting_prefix_refresh`` and ``priority_preemption``), and
  each may have its own ``step_time_ms``, ``rate`` and ``seed`` (pass a
  sequence; a scalar is shared), so a whole load curve (Poisson rates x
  seeds) is one compiled program. Each result equals :func:`simulate`'s
  for its configuration, except that only the per-step totals are kept
  (``SimResult.lanes_recorded`` is False: :meth:`SimResult.metrics` and
  :meth:`SimResult.requests` work, :meth:`SimResult.steps` does not).

  ``vectorize``: run the configurations as one ``jax.vmap``-ed loop
  (True), or one after another through the same compiled program (False).
  The default, None, vectorizes on accelerators only: on a CPU the
  vmapped loop costs far more than the configurations one by one (its
  branches all run and its scatters become general ones; measured on this
  project's 2-core CPU, 2026-12-04: 16 configurations of 200 requests
  8.5 s vmapped, 1.1 s one by one). Both give the same results.

  ``devices``: when vectorized, the configurations' axis is sharded over
  these devices (a one-axis :class:`jax.sharding.Mesh` named
  ``"configs"``; the configurations are padded with copies of the last to
  a multiple of the device count, and the copies dropped). Default: the
  default device only. The results do not depend on the device count.

  Raises:
    ValueError: no configurations, configurations that differ in a static
      field (the message names it), per-configuration sequences of the
      wrong length, and everything :func:`simulate` refuses.
  """
  return _simulate_batch(
    trace, None, configs, arrivals=arrivals, step_time_ms=step_time_ms,
    rate=rate, seed=seed, max_steps=max_steps, clock=clock, model=model,
    hardware=hardware, vectorize=vectorize, devices=devices,
  )  # fmt: skip


class TraceRuns:
  """One trace checked once for many :func:`simulate_batch` calls.

  A sweep runs each point of a group as its own call (on a CPU, where the
  configurations run one after another). Each call would check and fan
  out the records again, parse their tokens and hash their blocks; calls
  through one ``TraceRuns`` share that work, per block size and length
  bounds (:func:`_lengths`; the built-in workload's 4,000 requests: a
  call's host preparation about 0.16-0.20 s alone, 0.02 s shared, on a
  2-core CPU). The records are private copies, so the shared results
  cannot go stale; the calls may run on several threads.
  """

  def __init__(self, trace: Trace | Iterable[Mapping[str, Any]]):
    self._records = _check_records(trace)
    self._memo: dict = {}

  def simulate_batch(
    self, configs: Sequence[ServingConfig], **kwargs
  ) -> list[SimResult]:
    """:func:`simulate_batch` on this trace (the same keyword arguments)."""
    return _simulate_batch(None, self, configs, **kwargs)


def _simulate_batch(
  trace,
  runs: TraceRuns | None,
  configs,
  *,
  arrivals: Arrivals = "zero",
  step_time_ms=None,
  rate=None,
  seed=0,
  max_steps=None,
  clock: Any = "steps",
  model=None,
  hardware=None,
  vectorize=None,
  devices=None,
) -> list[SimResult]:
  """:func:`simulate_batch` on ``trace``, or on the records of ``runs``
  sharing its memo."""
  configs = list(configs)
  if not configs:
    raise ValueError("simulate_batch needs at least one configuration")
  for c in configs:
    if not isinstance(c, ServingConfig):
      raise TypeError(f"configs must be ServingConfigs, got {type(c)}")
  first = configs[0]
  for i, c in enumerate(configs):
    for name in _STATIC:
      if getattr(c, name) != getattr(first, name):
        raise ValueError(
          f"configs[{i}].{name}={getattr(c, name)} differs from "
          f"configs[0].{name}={getattr(first, name)}: a batch shares its "
          f"static shapes ({', '.join(_STATIC)})"
        )
    if c.scheduler_object != first.scheduler_object:
      raise ValueError(
        f"configs[{i}].scheduler differs from configs[0]'s: a batch shares "
        "its scheduler"
      )
  n = len(configs)
  check_run_arguments(
    step_time_ms=step_time_ms,
    rate=rate,
    seed=seed,
    max_steps=max_steps,
    per_config=True,
  )
  if runs is None:
    records, memo = _check_records(trace), {}
  else:
    records, memo = runs._records, runs._memo
  points = list(
    zip(
      configs,
      _per_config("step_time_ms", step_time_ms, n),
      _per_config("rate", rate, n),
      _per_config("seed", seed, n),
      strict=True,
    )
  )
  if vectorize is None:
    vectorize = jax.default_backend() != "cpu"
  release_compiled_near_map_limit()
  if first.semantics == "sglang":
    return _sglang_batch(
      records, points, arrivals, max_steps, clock, model, hardware,
      vectorize, devices, memo,
    )  # fmt: skip
  builds = [
    _build(records, c, arrivals, dt, rt, sd, clock, model, hardware, memo)
    for c, dt, rt, sd in points
  ]
  b0 = builds[0]
  if not vectorize:
    return _each_on_a_thread(
      lambda b: _run_one(b, max_steps, record_lanes=False), builds
    )

  state, params, reqs = _stack(
    [(b.state, b.params, b.reqs.replace(keys=None)) for b in builds]
  )
  shared = b0.reqs.keys  # equal for equal block sizes and records
  if devices is not None and len(devices) > 1:
    state, reqs, params = shard_lanes((state, reqs, params), devices)
    shared = replicate(shared, devices)
  if max_steps is None:  # segments for all lanes, resumed together
    steps = segment_rows(max(b.rows for b in builds), 0, configs=n)
  else:
    steps = max_steps
  pieces = []
  while True:
    final, trace_out = engine.run_batched(
      state,
      reqs,
      params,
      shared,
      max_steps=steps,
      scheduler=b0.scheduler,
      clock=b0.timer,
      until_full=max_steps is None,
    )
    rows = np.asarray(final.num_steps)[:n]
    cut = first_rows(trace_out, int(rows.max()), axis=1)
    pieces.append((jax.device_get(cut), rows))
    errors = np.asarray(final.error)
    if max_steps is not None or not np.any(
      errors[:n] == engine.SimStatus.OUT_OF_STEPS
    ):
      break
    out_of_steps = final.error == engine.SimStatus.OUT_OF_STEPS
    state = final.replace(
      num_steps=jnp.zeros_like(final.num_steps),
      error=jnp.where(out_of_steps, engine.SimStatus.OK, final.error),
    )
  final = jax.device_get(final)
  out = []
  for i, b in enumerate(builds):
    f = jax.tree.map(lambda x, i=i: x[i], final)
    f = f.replace(num_steps=np.int32(sum(r[i] for _, r in pieces)))
    t = join_rows(
      [(jax.tree.map(lambda x, i=i: x[i], p), r[i]) for p, r in pieces]
    )
    out.append(dataclasses.replace(_collect(b, f, t), lanes_recorded=False))
  return out


def _sglang_batch(
  records, points, arrivals, max_steps, clock, model, hardware, vectorize,
  devices, memo,
) -> list[SimResult]:  # fmt: skip
  """:func:`simulate_batch` under ``semantics="sglang"``: one vmapped loop
  (:func:`~prefixjax.serving.sglang_sim.simulate_sglang_batch`) or the
  configurations one after another."""
  from prefixjax.serving.sglang_sim import BATCH_STATIC, simulate_sglang_batch

  first = points[0][0]
  for i, (c, *_) in enumerate(points):
    for name in BATCH_STATIC:
      if getattr(c, name) != getattr(first, name):
        raise ValueError(
          f"configs[{i}].{name} differs from configs[0]'s: under "
          "semantics='sglang' a batch shares it"
        )
  if not vectorize:

    def one(point):
      c, dt, rt, sd = point
      res = _simulate_sglang(
        records, c, arrivals, dt, rt, sd, max_steps, clock, model, hardware,
        memo=memo,
      )  # fmt: skip
      return dataclasses.replace(res, lanes_recorded=False)

    return _each_on_a_thread(one, points)
  inputs, timer = [], None
  for c, dt, rt, sd in points:
    one, timer = _sglang_inputs(
      records, c, arrivals, dt, rt, sd, clock, model, hardware, memo
    )
    inputs.append(one)
  return simulate_sglang_batch(
    [c for c, *_ in points],
    inputs,
    step_times=[dt for _, dt, _, _ in points],
    max_steps=max_steps,
    timer=timer,
    devices=devices,
  )
